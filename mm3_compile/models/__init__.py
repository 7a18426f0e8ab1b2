"""MiniMax-M3 layers on the mm3 ops, a paged-KV runtime, an independent reference model, tensor parallelism."""

from mm3_compile.models.config import MiniMaxM3Config  # noqa: F401
from mm3_compile.models.layers import AttentionMetadata, MiniMaxM3ForCausalLM, build_model, random_full_state  # noqa: F401
from mm3_compile.models.runtime import PagedKVRuntime, compile_model, run_demo_workload  # noqa: F401
