"""Everything that touches Inductor/AOTAutograd internals, gated on the torch versions it was checked on.

``install()`` (run by ``import mm3_compile``) registers, for every ``mm3`` op, the functional
decomposition that puts its Triton kernels into Inductor's generated code on GPUs, and restores the
compile options Inductor drops for them (``kernel_options``: register caps, programmatic dependent launch).
``compile_options()`` adds the post-grad SwiGLU+MXFP8 fusion pass; ``dynamic_shapes()`` is the
symbolic-shape configuration under which serving batches never recompile.
"""

import contextlib
import logging

import torch
import torch.fx.experimental._config

from mm3_compile import ops
from mm3_compile.lowerings import kernel_options
from mm3_compile.lowerings.decompose import register_functional_decomposition
from mm3_compile.lowerings.fusion import Mm3PostGradPass, fusion_installed

log = logging.getLogger("mm3_compile")

__all__ = ["SUPPORTED_TORCH", "compile_options", "dynamic_shapes", "install", "supported", "torch_version"]

# torch 2.11 (GPU machine) and 2.13 (CI) are exercised; 2.12-2.15 share the same internals
# (CustomOpDef.register_torch_dispatch, export's custom_triton_ops_decomposition_disabled,
# CustomGraphPass, pattern_matcher.register_replacement).
SUPPORTED_TORCH = ((2, 11), (2, 15))


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def supported() -> bool:
    return SUPPORTED_TORCH[0] <= torch_version() <= SUPPORTED_TORCH[1]


def install() -> None:
    if not supported():
        log.warning(
            "torch %s is outside the range %s-%s mm3_compile's lowerings were checked on: mm3 ops stay opaque "
            "custom ops in compiled graphs",
            torch.__version__,
            *SUPPORTED_TORCH,
        )
        return
    kernel_options.install()
    register_functional_decomposition(ops.quant.mxfp8_quantize, defer=fusion_installed)
    register_functional_decomposition(ops.quant.swiglu_oai_mxfp8_quant)
    for opdef in (
        ops.kv_cache.kv_cache_write,
        ops.indexer.index_topk,
        ops.sparse_attn.sparse_attn_prefill,
        ops.sparse_attn.sparse_attn_decode,
        ops.sparse_attn.sparse_attn_decode_with_workspace,
        ops.moe.router_logits,
        ops.moe.moe_route,
        ops.moe.moe_align,
        ops.moe.mxfp8_grouped_gemm,
        ops.moe.mxfp8_linear,
        ops.moe.moe_experts,
    ):
        register_functional_decomposition(opdef)


def compile_options() -> dict:
    """Options for ``torch.compile``: the SwiGLU+MXFP8 fusion pass and a platform-keyed FX graph cache.

    Returns:
        ``{"post_grad_custom_post_pass": Mm3PostGradPass()}``; empty outside ``SUPPORTED_TORCH``, like the
        lowerings themselves (the pass rewrites through Inductor internals).

    Examples:
        >>> compiled = torch.compile(model, fullgraph=True, options=mm3_compile.compile_options())  # doctest: +SKIP
    """
    return {"post_grad_custom_post_pass": Mm3PostGradPass()} if supported() else {}


def dynamic_shapes(tokens: int | None = None):
    """Context manager for compiling serving code: batch and token dims of any size, 1 included, share a graph.

    ``torch.compile(dynamic=True)`` alone still specialises sizes 0/1 (decode batch 1 recompiles) and
    duck-sizes equal sizes into one symbol (a batch of 2 requests would be tied to 2 KV heads).

    Args:
        tokens: the token count of the call (the size hint a first call traces with). At 1, Inductor's loop
            reordering after fusion is turned off: on torch 2.11 it fused the residual add (``6144 * s`` flat)
            into the next RMSNorm's reduction (``s`` rows of 6144) of an M3 decode step traced at one token,
            then failed its code generation (``CantSplit: 6144 not divisible by 6144*s31``; H200, session 16).

    Examples:
        >>> with mm3_compile.dynamic_shapes(input_ids.shape[0]):  # doctest: +SKIP
        ...     logits = compiled_decode(input_ids, meta, caches)
    """
    shapes = torch.fx.experimental._config.patch(use_duck_shape=False, backed_size_oblivious=True)
    if tokens != 1:
        return shapes
    stack = contextlib.ExitStack()
    stack.enter_context(shapes)
    stack.enter_context(torch._inductor.config.patch(loop_ordering_after_fusion=False))
    return stack
