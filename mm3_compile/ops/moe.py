"""MoE ops: ``mm3::router_logits`` and ``mm3::moe_route`` (the router's logits and top-k) and, on MXFP8
weights, ``mm3::moe_align``, ``mm3::mxfp8_grouped_gemm``, ``mm3::mxfp8_linear``, ``mm3::moe_experts``.

Weights are ``values [E, N, K]`` in the platform's MXFP8 value dtype (asked from the dtype authority for the
input's device, at trace time under torch.compile) + E8M0 scale bytes ``[E, N, K/32]`` (uint8 or
float8_e8m0fnu); the kernels dequantize them in registers. ``mm3::moe_experts`` chains the ops into one routed MoE
(align, GEMM1 on bf16 rows, fused SwiGLU-OAI + MXFP8 quant, GEMM2 on the MXFP8 activation with the router
weights in its epilogue, sum over the top-k slots).
"""

import dataclasses

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from mm3_compile import platform
from mm3_compile.contract import MX_BLOCK_SIZE
from mm3_compile.kernels._launch import eager_launches, empty_row_major, require_kernel_device, size_hint, sm_count
from mm3_compile.kernels.moe import align as align_kernels
from mm3_compile.kernels.moe import gemm as gemm_kernels
from mm3_compile.kernels.moe import route as route_kernels
from mm3_compile.kernels.moe.schedule import layout_m, num_blocks, router_schedule, schedule, tail_schedule
from mm3_compile.ops._checks import FLOAT_DTYPES, check_finite, check_same_device, check_tensor, values_checked
from mm3_compile.platform import E8M0_DTYPE

SCALE_DTYPES = (torch.uint8, E8M0_DTYPE)
INDEX_DTYPES = (torch.int32, torch.int64)


def _contiguous_as(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``t`` (made contiguous) viewed as ``shape`` through explicit row-major strides.

    Inductor lowers a reshape that merges or splits the token dim by comparing sizes, which guards on a
    backed size's hint: a decode graph traced at one token got the guard ``T == 1`` (torch 2.11,
    ``_dynamic_reshape_indexer``) and recompiled for the next batch. ``as_strided`` lowers to a plain
    reinterpretation of the buffer, with no comparison.
    """
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = step * size
    return torch.as_strided(t.contiguous(), shape, tuple(reversed(strides)))


def gemm_schedule(
    rows,
    n: int,
    k: int,
    num_experts: int,
    device: torch.device,
    x_mx: bool = False,
    x_bytes: int = 2,
    splittable: bool = True,
):
    """The GEMM tiles for ``rows`` pairs (a size hint under tracing: one config per graph)."""
    sms = (
        sm_count(device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else None
    )
    return schedule(size_hint(rows), n, k, num_experts, platform.interpreting(), x_mx, sms, x_bytes, splittable)


def _check_weight(values: torch.Tensor, scales: torch.Tensor, ndim: int, prefix: str = "") -> None:
    value_dtype = platform.mxfp8_value_dtype(values.device)
    check_tensor(prefix + "values", values, dtypes=(value_dtype,), ndim=ndim)
    check_tensor(prefix + "scales", scales, dtypes=SCALE_DTYPES, ndim=ndim)
    check_same_device(prefix + "values", values, **{prefix + "scales": scales})
    K = values.shape[-1]
    if K % MX_BLOCK_SIZE != 0 or guard_or_false(K == 0):
        raise ValueError(f"{prefix}values: the input width K must be a positive multiple of {MX_BLOCK_SIZE}, got {K}")
    if values.shape[-2] % 16 != 0:
        raise ValueError(f"{prefix}values: the output width N must be a multiple of 16, got {values.shape[-2]}")
    expected = (*values.shape[:-1], K // MX_BLOCK_SIZE)
    if tuple(scales.shape) != tuple(expected):
        raise ValueError(
            f"{prefix}scales: expected shape {tuple(expected)} (one E8M0 byte per 32 values), got {tuple(scales.shape)}"
        )
    for name, t in ((prefix + "values", values), (prefix + "scales", scales)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")


def _check_x(x: torch.Tensor, x_scales: torch.Tensor | None, K: int) -> None:
    if x_scales is None:
        check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    else:
        check_tensor("x", x, dtypes=(platform.mxfp8_value_dtype(x.device),), ndim=2)
        check_tensor("x_scales", x_scales, dtypes=SCALE_DTYPES, ndim=2)
        if tuple(x_scales.shape) != (x.shape[0], x.shape[1] // MX_BLOCK_SIZE):
            raise ValueError(
                f"x_scales: expected shape {(x.shape[0], x.shape[1] // MX_BLOCK_SIZE)}, got {tuple(x_scales.shape)}"
            )
    if x.shape[1] != K:
        raise ValueError(f"x: expected K = {K} columns (the weights' input width), got shape {tuple(x.shape)}")


# ---------------------------------------------------------------------------------------------------
# router_logits


def _check_router(x, weight) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("weight", weight, dtypes=(torch.float32,), ndim=2)
    check_same_device("x", x, weight=weight)
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x: expected {weight.shape[1]} columns (the router weight's width), got {tuple(x.shape)}")


@torch.library.custom_op("mm3::router_logits", mutates_args=())
def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The M3 router's fp32 logits ``x.float() @ weight^T``, on bf16 tensor cores for a prefill's bf16 x.

    Args:
        x: ``[T, H]`` hidden states (bf16/fp16/fp32).
        weight: ``[E, H]`` fp32 router weight.

    Returns:
        ``[T, E]`` fp32 with fp32 products and fp32 sums (the weight split into three bf16 pieces, each product
        exact; ``kernels/moe/route.py``), summed in another order than a cuBLAS fp32 GEMM. Few tokens (a decode
        step; ``schedule.router_schedule``) or a non-bf16 x take the plain fp32 linear.

    Examples:
        >>> logits = torch.ops.mm3.router_logits(x, gate_weight)  # [T, E]
    """
    _check_router(x, weight)
    interpreting = platform.interpreting()
    config = router_schedule(size_hint(x.shape[0]), weight.shape[0], weight.shape[1], interpreting)
    on_kernel_device = x.device.type == "cuda" or (x.device.type == "cpu" and interpreting)
    if config is None or x.dtype != torch.bfloat16 or not on_kernel_device:
        return torch.nn.functional.linear(x.float(), weight)
    with eager_launches():
        return route_kernels.router_logits(x.contiguous(), weight.contiguous(), config, interpreting)


@router_logits.register_fake
def _(x, weight):
    _check_router(x, weight)
    return empty_row_major((x.shape[0], weight.shape[0]), torch.float32, x.device)


# ---------------------------------------------------------------------------------------------------
# moe_route


def _check_route(logits, correction_bias, top_k, scaling) -> None:
    check_tensor("logits", logits, dtypes=(torch.float32,), ndim=2)
    check_tensor("correction_bias", correction_bias, dtypes=(torch.float32,), ndim=1)
    check_same_device("logits", logits, correction_bias=correction_bias)
    E = logits.shape[1]
    if correction_bias.shape[0] != E:
        raise ValueError(f"correction_bias: expected shape ({E},) (one per expert), got {tuple(correction_bias.shape)}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected 1..{E} (the experts in logits), got {top_k}")
    check_finite("scaling", scaling)


@torch.library.custom_op("mm3::moe_route", mutates_args=())
def moe_route(
    logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """M3 sigmoid routing in one kernel: the top-k experts of ``sigmoid(logits) + correction_bias`` per token.

    Args:
        logits: ``[T, E]`` fp32 router logits.
        correction_bias: ``[E]`` fp32, added for the choice only.
        top_k: experts per token; scaling: the routed scaling factor.

    Returns:
        ``ids [T, top_k]`` int32 (highest key first, ties by the lower expert index, a NaN key above every
        number) and ``weights [T, top_k]`` fp32: the chosen experts' un-biased sigmoids over their sum, times
        ``scaling`` (a NaN logit makes its token's weights NaN).

    Examples:
        >>> ids, w = torch.ops.mm3.moe_route(torch.tensor([[0.0, 2.0, 1.0]]), torch.zeros(3), 2, 1.0)
        >>> ids.tolist()
        [[1, 2]]
    """
    _check_route(logits, correction_bias, top_k, scaling)
    require_kernel_device("logits", logits)
    with eager_launches():
        return route_kernels.moe_route(
            logits.contiguous(), correction_bias.contiguous(), top_k, scaling, platform.interpreting()
        )


@moe_route.register_fake
def _(logits, correction_bias, top_k, scaling):
    _check_route(logits, correction_bias, top_k, scaling)
    T = logits.shape[0]
    return (
        empty_row_major((T, top_k), torch.int32, logits.device),
        empty_row_major((T, top_k), torch.float32, logits.device),
    )


# ---------------------------------------------------------------------------------------------------
# moe_align


def _check_align(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    check_tensor("ids", ids, dtypes=INDEX_DTYPES, ndim=2)
    if num_experts < 1:
        raise ValueError(f"num_experts: expected >= 1, got {num_experts}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m: expected a power of two >= 16 (a tl.dot row tile), got {block_m}")


def _align_outputs(ids: torch.Tensor, num_experts: int, block_m: int):
    nb = num_blocks(ids.shape[0] * ids.shape[1], num_experts, block_m)
    return (
        empty_row_major((nb * block_m,), torch.int32, ids.device),
        empty_row_major((nb,), torch.int32, ids.device),
    )


@torch.library.custom_op("mm3::moe_align", mutates_args=())
def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the router's (token, slot) pairs by expert, each group padded to ``block_m`` rows.

    Args:
        ids: ``[T, k]`` int32/int64 expert of each pair (pair index ``t * k + j``), values in ``[0, num_experts)``.
        num_experts: experts of the layer.
        block_m: rows per block, ``layout_m(gemm_schedule(...))`` (GEMM1's row tile, or half of a 256-row one).

    Returns:
        ``sorted_pairs [NB * block_m]`` int32 (pair indices by expert, -1 pads) and ``block_expert [NB]`` int32
        (-1: no rows), ``NB = min(T*k, ceil((T*k + E*(block_m-1)) / block_m))`` (static in T).

    Examples:
        >>> pairs, experts = torch.ops.mm3.moe_align(torch.tensor([[1, 0], [1, 1]]), 4, 16)
        >>> pairs[:2].tolist(), pairs[16:19].tolist(), experts.tolist()
        ([1, -1], [0, 2, 3], [0, 1, -1, -1])
    """
    _check_align(ids, num_experts, block_m)
    if values_checked(ids) and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"ids: expected expert ids in [0, {num_experts}), got [{int(ids.min())}, {int(ids.max())}]")
    with eager_launches():
        return align_kernels.moe_align(ids, num_experts, block_m)


@moe_align.register_fake
def _(ids, num_experts, block_m):
    _check_align(ids, num_experts, block_m)
    return _align_outputs(ids, num_experts, block_m)


# ---------------------------------------------------------------------------------------------------
# mxfp8_grouped_gemm


def _check_shared(values, scales, like: torch.Tensor, like_name: str, prefix: str) -> None:
    """The shared expert's ``[N, K]`` weight beside the routed ``like [E, N, K]`` (both or neither given)."""
    if (values is None) != (scales is None):
        raise ValueError(f"{prefix}values / {prefix}scales: expected both or neither, got one")
    if values is None:
        return
    _check_weight(values, scales, 2, prefix)
    check_same_device(like_name, like, **{prefix + "values": values})
    if tuple(values.shape) != tuple(like.shape[1:]) or values.dtype != like.dtype:
        raise ValueError(
            f"{prefix}values: expected the routed experts' {tuple(like.shape[1:])} {like.dtype} (one more expert), "
            f"got {tuple(values.shape)} {values.dtype}"
        )


def _check_grouped(x, w_values, w_scales, sorted_pairs, block_expert, block_m, top_k, x_scales, pair_weights):
    _check_weight(w_values, w_scales, 3, "w_")
    _check_x(x, x_scales, w_values.shape[2])
    if top_k < 1:
        raise ValueError(f"top_k: expected >= 1, got {top_k}")
    check_tensor("sorted_pairs", sorted_pairs, dtypes=(torch.int32,), ndim=1)
    check_tensor("block_expert", block_expert, dtypes=(torch.int32,), ndim=1)
    if guard_or_false(sorted_pairs.shape[0] != block_expert.shape[0] * block_m):
        raise ValueError(
            f"sorted_pairs: expected block_expert.shape[0] * block_m = {block_expert.shape[0] * block_m} rows "
            f"(the layout of moe_align with this block_m), got {sorted_pairs.shape[0]}"
        )
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m: expected a power of two >= 16, got {block_m}")
    if pair_weights is not None:
        check_tensor("pair_weights", pair_weights, dtypes=(torch.float32,), ndim=1)
        if guard_or_false(pair_weights.shape[0] != x.shape[0] * top_k):
            raise ValueError(
                f"pair_weights: expected {x.shape[0] * top_k} entries (one per pair), got {pair_weights.shape[0]}"
            )
    check_same_device(
        "x",
        x,
        w_values=w_values,
        sorted_pairs=sorted_pairs,
        block_expert=block_expert,
        x_scales=x_scales,
        pair_weights=pair_weights,
    )


def _grouped_dtype(x, x_scales, pair_weights) -> torch.dtype:
    if x_scales is None:
        return x.dtype
    return torch.float32 if pair_weights is not None else torch.bfloat16


def _grouped_out(x, w_values, top_k, x_scales, pair_weights):
    dtype = _grouped_dtype(x, x_scales, pair_weights)
    return empty_row_major((x.shape[0] * top_k, w_values.shape[1]), dtype, x.device)


@torch.library.custom_op("mm3::mxfp8_grouped_gemm", mutates_args=())
def mxfp8_grouped_gemm(
    x: torch.Tensor,
    w_values: torch.Tensor,
    w_scales: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    block_m: int,
    top_k: int = 1,
    x_scales: torch.Tensor | None = None,
    pair_weights: torch.Tensor | None = None,
    shared_values: torch.Tensor | None = None,
    shared_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per (token, slot) pair p: ``out[p] = w(p) * x[p // top_k] @ dequant(W[expert(p)])^T``.

    Args:
        x: ``[M, K]`` float rows (GEMM1: the tokens, ``top_k`` = the router's k), or MXFP8 values in the platform
            dtype with ``x_scales [M, K/32]`` (GEMM2: one row per pair from ``swiglu_oai_mxfp8_quant``, top_k 1).
        w_values: ``[E, N, K]`` platform MXFP8 values; ``w_scales``: ``[E, N, K/32]`` E8M0 bytes.
        sorted_pairs, block_expert: from ``moe_align(ids, E, block_m)`` with the same ``block_m``.
        pair_weights: optional ``[M * top_k]`` fp32 factor per pair (the router weights) applied in fp32.
        shared_values, shared_scales: optional ``[N, K]`` / ``[N, K/32]`` weight of expert ``E`` (one past
            ``w_values``; align with ``E + 1`` experts): the shared expert in the same launch as the routed ones.

    Returns:
        ``[M * top_k, N]`` in pair order: x's dtype for float x; for MXFP8 x the product rounded to bf16 (the
        expert output in the model dtype), weighted in fp32 when ``pair_weights`` is given (fp32 result), else
        bf16. Only experts that received pairs are read.

    Examples:
        >>> pairs, blocks = torch.ops.mm3.moe_align(ids, E, block_m)
        >>> gate_up = torch.ops.mm3.mxfp8_grouped_gemm(x, w1, s1, pairs, blocks, block_m, ids.shape[1])
    """
    _check_grouped(x, w_values, w_scales, sorted_pairs, block_expert, block_m, top_k, x_scales, pair_weights)
    _check_shared(shared_values, shared_scales, w_values, "w_values", "shared_")
    require_kernel_device("x", x)
    N, K = w_values.shape[1], w_values.shape[2]
    shared = None if shared_values is None else (shared_values, shared_scales.view(torch.uint8))
    groups = w_values.shape[0] + (shared is not None)
    # a grouped launch never splits k, even over one group
    config = gemm_schedule(
        x.shape[0] * top_k, N, K, groups, x.device, x_scales is not None, x.element_size(), splittable=False
    )
    tail = None
    if config.BLOCK_M == 2 * block_m:  # paired tiles: two blocks of an expert per tile, its odd last block apart
        tail = tail_schedule(config, x.element_size())
    elif block_m % config.BLOCK_M != 0:  # the schedule's row tile runs over the layout when it divides its blocks
        config = dataclasses.replace(config, BLOCK_M=block_m)
    fmt = platform.fp8_format(w_values.dtype)
    with eager_launches():
        return gemm_kernels.mxfp8_gemm(
            x.contiguous(),
            None if x_scales is None else x_scales.view(torch.uint8).contiguous(),
            w_values,
            w_scales.view(torch.uint8),
            fmt,
            config,
            _grouped_dtype(x, x_scales, pair_weights),
            sorted_pairs,
            block_expert,
            top_k,
            pair_weights,
            shared,
            layout_m=block_m,
            tail_config=tail,
        )


@mxfp8_grouped_gemm.register_fake
def _(
    x,
    w_values,
    w_scales,
    sorted_pairs,
    block_expert,
    block_m,
    top_k=1,
    x_scales=None,
    pair_weights=None,
    shared_values=None,
    shared_scales=None,
):
    _check_grouped(x, w_values, w_scales, sorted_pairs, block_expert, block_m, top_k, x_scales, pair_weights)
    _check_shared(shared_values, shared_scales, w_values, "w_values", "shared_")
    return _grouped_out(x, w_values, top_k, x_scales, pair_weights)


# ---------------------------------------------------------------------------------------------------
# mxfp8_linear


def _check_linear(x, values, scales, x_scales):
    _check_weight(values, scales, 2)
    if x_scales is None:
        check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
    else:
        check_tensor("x", x, dtypes=(platform.mxfp8_value_dtype(x.device),), min_ndim=1)
        check_tensor("x_scales", x_scales, dtypes=SCALE_DTYPES, min_ndim=1)
        expected = (*x.shape[:-1], x.shape[-1] // MX_BLOCK_SIZE)
        if tuple(x_scales.shape) != tuple(expected):
            raise ValueError(f"x_scales: expected shape {tuple(expected)}, got {tuple(x_scales.shape)}")
    if x.shape[-1] != values.shape[1]:
        raise ValueError(f"x: expected the last dim {values.shape[1]} (the weight's input width), got {tuple(x.shape)}")
    check_same_device("x", x, values=values, x_scales=x_scales)


@torch.library.custom_op("mm3::mxfp8_linear", mutates_args=())
def mxfp8_linear(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, x_scales: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ dequant(W)^T`` for one MXFP8 weight, dequantized in registers (the one-expert GEMM).

    Args:
        x: ``[..., K]`` bf16/fp16/fp32, or MXFP8 values in the platform dtype with ``x_scales [..., K/32]``
            (the output of ``swiglu_oai_mxfp8_quant``, consumed without dequantizing it to memory).
        values: ``[N, K]`` platform MXFP8 values; scales: ``[N, K/32]`` E8M0 bytes.

    Returns:
        ``[..., N]``: x's dtype for float x, bf16 for MXFP8 x (fp32 accumulation, rounded once).

    Examples:
        >>> y = torch.ops.mm3.mxfp8_linear(x, weight.values, weight.scales)
    """
    _check_linear(x, values, scales, x_scales)
    require_kernel_device("x", x)
    N, K = values.shape
    x2 = x.reshape(-1, K).contiguous()
    xs = None if x_scales is None else x_scales.view(torch.uint8).reshape(-1, K // MX_BLOCK_SIZE).contiguous()
    config = gemm_schedule(x2.shape[0], N, K, 1, x.device, xs is not None, x2.element_size())
    fmt = platform.fp8_format(values.dtype)
    out_dtype = x.dtype if x_scales is None else torch.bfloat16
    with eager_launches():
        out = gemm_kernels.mxfp8_gemm(x2, xs, values[None], scales.view(torch.uint8)[None], fmt, config, out_dtype)
    return out.view(*x.shape[:-1], N)


@mxfp8_linear.register_fake
def _(x, values, scales, x_scales=None):
    _check_linear(x, values, scales, x_scales)
    dtype = x.dtype if x_scales is None else torch.bfloat16
    return empty_row_major((*x.shape[:-1], values.shape[0]), dtype, x.device)


# ---------------------------------------------------------------------------------------------------
# The routed MoE from the ops


def _check_experts(x, ids, weights, gate_up_values, gate_up_scales, down_values, down_scales, shared):
    """``shared``: the four optional shared-expert tensors (gate_up values, scales, down values, scales)."""
    _check_weight(gate_up_values, gate_up_scales, 3, "gate_up_")
    _check_weight(down_values, down_scales, 3, "down_")
    _check_shared(shared[0], shared[1], gate_up_values, "gate_up_values", "shared_gate_up_")
    _check_shared(shared[2], shared[3], down_values, "down_values", "shared_down_")
    if (shared[0] is None) != (shared[2] is None):
        raise ValueError("shared_gate_up_values / shared_down_values: expected both of the shared expert or neither")
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("ids", ids, dtypes=INDEX_DTYPES, ndim=2)
    check_tensor("weights", weights, dtypes=FLOAT_DTYPES, ndim=2)
    E, two_i, H = gate_up_values.shape
    if tuple(down_values.shape) != (E, H, two_i // 2):
        raise ValueError(
            f"down_values: expected shape {(E, H, two_i // 2)} (gate_up is {tuple(gate_up_values.shape)}), got {tuple(down_values.shape)}"
        )
    if x.shape[1] != H:
        raise ValueError(f"x: expected {H} columns (the experts' hidden size), got shape {tuple(x.shape)}")
    if guard_or_false(ids.shape[0] != x.shape[0]) or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(
            f"ids/weights: expected [T, k] with T = {x.shape[0]}, got {tuple(ids.shape)} and {tuple(weights.shape)}"
        )
    check_same_device("x", x, ids=ids, weights=weights, gate_up_values=gate_up_values, down_values=down_values)


@torch.library.custom_op("mm3::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_values: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_values: torch.Tensor,
    down_scales: torch.Tensor,
    alpha: float = 1.702,
    beta: float = 1.0,
    limit: float | None = 7.0,
    shared_gate_up_values: torch.Tensor | None = None,
    shared_gate_up_scales: torch.Tensor | None = None,
    shared_down_values: torch.Tensor | None = None,
    shared_down_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed MoE: fp32 ``[T, H] = sum_j weights[:, j] * down(swiglu_mx(gate_up(x)))`` of expert ``ids[:, j]``.

    Args:
        x: ``[T, H]`` hidden states; ids / weights: ``[T, k]`` the router's experts and weights.
        gate_up_values / gate_up_scales: ``[E, 2I, H]`` / ``[E, 2I, H/32]`` MXFP8 (gate rows then up rows).
        down_values / down_scales: ``[E, H, I]`` / ``[E, H, I/32]`` MXFP8.
        alpha, beta, limit: the SwiGLU-OAI constants.
        shared_*: optional shared expert of the same widths (``[2I, H]``, ``[H, I]`` and their scales): added to
            every token with weight 1, as one more slot of the same launches (its programs fill the SMs the
            routed experts leave idle at small T), numerically the same as its own ``mxfp8_linear`` chain.

    Returns:
        ``[T, H]`` fp32. The chain ``moe_align -> mxfp8_grouped_gemm -> swiglu_oai_mxfp8_quant ->
        mxfp8_grouped_gemm`` in one op, so the row tile is chosen from the shapes inside the op
        (at trace time under torch.compile, never by Dynamo): the activation between the GEMMs is the MXFP8
        output of ``swiglu_oai_mxfp8_quant``, never dequantized to memory; the router weights scale GEMM2's fp32
        accumulator; the k slots (then the shared expert) are summed in a fixed order (deterministic).

    Examples:
        >>> out = torch.ops.mm3.moe_experts(x, ids, weights, w1.values, w1.scales, w2.values, w2.scales)
    """
    shared = (shared_gate_up_values, shared_gate_up_scales, shared_down_values, shared_down_scales)
    _check_experts(x, ids, weights, gate_up_values, gate_up_scales, down_values, down_scales, shared)
    E, two_i, H = gate_up_values.shape
    weights = weights.float()
    groups = E
    if shared_gate_up_values is not None:  # one more slot per token: expert E, weight 1
        T = ids.shape[0]
        ids = torch.cat([ids, torch.full((T, 1), E, dtype=ids.dtype, device=ids.device)], 1)
        weights = torch.cat([weights, torch.ones((T, 1), dtype=torch.float32, device=weights.device)], 1)
        groups = E + 1
    T, k = ids.shape
    block_m = layout_m(gemm_schedule(T * k, two_i, H, groups, x.device))
    pairs, blocks = torch.ops.mm3.moe_align(ids, groups, block_m)
    gate_up = torch.ops.mm3.mxfp8_grouped_gemm(
        x,
        gate_up_values,
        gate_up_scales,
        pairs,
        blocks,
        block_m,
        k,
        None,
        None,
        shared_gate_up_values,
        shared_gate_up_scales,
    )
    act, act_scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up, alpha, beta, limit)  # [T*k, I] MXFP8
    ys = torch.ops.mm3.mxfp8_grouped_gemm(
        act,
        down_values,
        down_scales,
        pairs,
        blocks,
        block_m,
        1,
        act_scales,
        _contiguous_as(weights, (T * k,)),
        shared_down_values,
        shared_down_scales,
    )  # [T*k, H] fp32, weighted
    return _contiguous_as(ys, (T, k, H)).sum(1)


@moe_experts.register_fake
def _(
    x,
    ids,
    weights,
    gate_up_values,
    gate_up_scales,
    down_values,
    down_scales,
    alpha=1.702,
    beta=1.0,
    limit=7.0,
    shared_gate_up_values=None,
    shared_gate_up_scales=None,
    shared_down_values=None,
    shared_down_scales=None,
):
    shared = (shared_gate_up_values, shared_gate_up_scales, shared_down_values, shared_down_scales)
    _check_experts(x, ids, weights, gate_up_values, gate_up_scales, down_values, down_scales, shared)
    return empty_row_major((x.shape[0], gate_up_values.shape[2]), torch.float32, x.device)
