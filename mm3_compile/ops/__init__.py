"""Op declarations (``torch.library.custom_op`` + explicit fakes). Importing this registers ``torch.ops.mm3.*``.

``values_checked`` tells a caller whether an op call on these tensors checks its index values (the rule of
``MM3_VALIDATE``), so layers can validate their own metadata under the same rule.
"""

from mm3_compile.ops._checks import values_checked
from mm3_compile.ops.indexer import index_topk
from mm3_compile.ops.kv_cache import kv_cache_write
from mm3_compile.ops.moe import moe_align, moe_experts, moe_route, mxfp8_grouped_gemm, mxfp8_linear, router_logits
from mm3_compile.ops.quant import mxfp8_quantize, swiglu_oai_mxfp8_quant
from mm3_compile.ops.sparse_attn import (
    decode_workspace,
    sparse_attn_decode,
    sparse_attn_decode_with_workspace,
    sparse_attn_prefill,
)

__all__ = [
    "decode_workspace",
    "index_topk",
    "kv_cache_write",
    "moe_align",
    "moe_experts",
    "moe_route",
    "mxfp8_grouped_gemm",
    "mxfp8_linear",
    "mxfp8_quantize",
    "router_logits",
    "sparse_attn_decode",
    "sparse_attn_decode_with_workspace",
    "sparse_attn_prefill",
    "swiglu_oai_mxfp8_quant",
    "values_checked",
]
