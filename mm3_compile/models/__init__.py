"""MiniMax-M3 layers on the ``torch.ops.mm3`` kernels, a paged-KV runtime, an independent reference, TP.

Public API (what ``mm3-compile demo`` uses)::

    import torch
    from mm3_compile.models import (MiniMaxM3Config, build_model, random_full_state, PagedKVRuntime,
                                    run_demo_workload, compile_model, compare_with_reference)

    config = MiniMaxM3Config.tiny()            # or .m3_1layer() (GPU), MiniMaxM3Config.preset("tiny")
    state = random_full_state(config, seed=0, device="cpu")  # full bf16 weights (fp32 router), seeded
    model = build_model(config, seed=0, device="cpu", dtype=torch.bfloat16, state=state)  # group=... for TP
    runtime = PagedKVRuntime(model, num_blocks=16, max_blocks_per_request=4, kv_cache_dtype="fp8")
    eager = run_demo_workload(model, runtime, batch=2, prompt_lens=[300, 140], steps=4, compiled=False)
    fns = compile_model(model, backend="inductor")              # (prefill, decode), fullgraph=True
    comp = run_demo_workload(model, runtime, batch=2, prompt_lens=[300, 140], steps=4, compiled=fns,
                             on_step=lambda step: ...)           # progress bar hook
    report = compare_with_reference(eager, config, state, model.dtype, "fp8", device="cpu")

* ``run_demo_workload`` resets the runtime, prefills ``batch`` seeded random prompts (one length or one per
  request) and runs ``steps`` uniform decode steps of one token per request; decode tokens are seeded too
  (teacher forcing: eager, compiled and reference runs see the same inputs).  It returns a
  ``WorkloadResult`` whose ``steps`` are ``StepResult(kind, q_lens, input_ids, logits [T, V] fp32,
  hiddens, topk, seconds)`` (tensors on the CPU; ``seconds`` synchronised per step, the first compiled step
  includes compilation).
* ``compare_with_reference`` replays a result through the pure-PyTorch reference: ``worst_sub_block``
  (teacher forced: every attention / MLP / MoE sub-block fed the op model's own input, error beyond one
  bf16 ulp relative to the sub-block's update; ~1e-2 expected; an MoE token whose k-th and (k+1)-th
  experts are near-tied may match either route, ``route_swaps`` counts those that took the swapped one),
  ``topk_mismatch`` (selected block sets that differ beyond near-tied blocks, expected 0;
  ``topk_near_ties`` counts the lists that differ only by
  blocks the reference scores within ``INDEX_TIE`` of each other) and ``logits_max_err`` (free-running end
  to end, informative only: routing and MXFP8 rounding are discontinuous, so a bf16-level difference can
  flip one token's expert choice).
* Two graphs per compiled model (prefill, decode); token and request counts are dynamic, so later steps and
  other batch shapes do not recompile.  Graph breaks: none (``fullgraph=True``).

* ``GraphedDecode(model, runtime)`` (:mod:`.graphs`) replays the compiled decode step from one CUDA graph per
  batch-size bucket over static metadata buffers updated in place; its module docstring is the recipe
  (capture sizes, what must stay static, the arrival-counter rule).

Cost on the CPU interpreter: prefill runs one Triton program per (token, KV head) per layer (~10-25 ms
each), so a tiny prefill of ~440 tokens takes ~20-40 s eagerly; decode steps take well under a second.

Real checkpoints (the Hugging Face release layout, MXFP8 or bf16; see :mod:`.checkpoint`)::

    config = MiniMaxM3Config.from_pretrained(path)          # config.json, VL or text-only form
    model = load_checkpoint(config, path, device="cuda")    # group=... loads only this rank's slices
    state = full_state_from_checkpoint(path, config)         # tiny models: the reference's weights

Tensor parallelism: ``build_model(..., group=pg)`` keeps this rank's shard (see :mod:`.tp` for the rules
and how to run with NCCL); everything else is unchanged.
"""

from mm3_compile.models import checkpoint
from mm3_compile.models.attention import AttentionMetadata
from mm3_compile.models.checkpoint import CheckpointError, full_state_from_checkpoint, load_checkpoint
from mm3_compile.models.config import MiniMaxM3Config
from mm3_compile.models.graphs import GraphedDecode
from mm3_compile.models.model import MiniMaxM3ForCausalLM, build_model
from mm3_compile.models.reference import Comparison, ReferenceModel, compare_with_reference
from mm3_compile.models.runtime import PagedKVRuntime, StepResult, WorkloadResult, compile_model, run_demo_workload
from mm3_compile.models.weights import random_full_state

__all__ = [
    "AttentionMetadata",
    "CheckpointError",
    "Comparison",
    "GraphedDecode",
    "MiniMaxM3Config",
    "MiniMaxM3ForCausalLM",
    "PagedKVRuntime",
    "ReferenceModel",
    "StepResult",
    "WorkloadResult",
    "build_model",
    "checkpoint",
    "compare_with_reference",
    "compile_model",
    "full_state_from_checkpoint",
    "load_checkpoint",
    "random_full_state",
    "run_demo_workload",
]
