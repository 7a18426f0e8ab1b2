"""Op declarations (``torch.library.custom_op`` + explicit fakes). Importing this registers ``torch.ops.mm3.*``."""

from mm3_compile.ops.indexer import index_topk  # noqa: F401
from mm3_compile.ops.kv_cache import kv_cache_write  # noqa: F401
from mm3_compile.ops.moe import moe_align, moe_experts, mxfp8_grouped_gemm, mxfp8_linear  # noqa: F401
from mm3_compile.ops.quant import mxfp8_quantize, swiglu_oai_mxfp8_quant  # noqa: F401
from mm3_compile.ops.sparse_attn import sparse_attn_decode, sparse_attn_prefill  # noqa: F401
