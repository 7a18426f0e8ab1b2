"""MXFP8 quantization kernels: plain ``x -> (values, scales)`` and fused SwiGLU-OAI + quant.

One program quantizes a ``[BLOCK_M, BLOCK_K]`` tile (``BLOCK_K / 32`` MX blocks per row).
The E8M0 exponent is exact integer arithmetic on the fp32 bits of the block amax:
``sb = ceil(log2(amax / FP8_MAX)) + 127`` (clamped to [0, 254]) without a division or a
``log2`` whose rounding could differ between GPU, interpreter and the reference.
Values are ``x * 2^(127 - sb)`` -- a multiply by a normal power of two, never a divide by
the possibly subnormal ``2^(sb - 127)`` (upstream #58089) -- then encoded by ``fp8_encode``.
"""

import struct

import torch
import triton
import triton.language as tl

from mm3_compile.contract import E8M0_BIAS, E8M0_MAX_FINITE, LOG2E, MX_BLOCK_SIZE
from mm3_compile.kernels._launch import empty_row_major, launch
from mm3_compile.kernels.fp8 import FP8Launch, fp8_encode, fp8_encode_native, fp8_launch
from mm3_compile.kernels.widen import exact_bf16, to_fp32
from mm3_compile.platform import E8M0_DTYPE, FP8Format, interpreting

MX = tl.constexpr(MX_BLOCK_SIZE)  # values per E8M0 scale (a Triton global must be a constexpr instance)
NEG_LOG2E = tl.constexpr(-LOG2E)
SCALE_MAX = tl.constexpr(E8M0_MAX_FINITE)  # the largest scale byte emitted
# 2^(E8M0_BIAS - sb) as fp32 bits has the exponent field FP32_BIAS + E8M0_BIAS - sb
UNSCALE_FIELD = tl.constexpr(127 + E8M0_BIAS)


@triton.jit
def _sigmoid(x, FLUSH_SUBNORMALS: tl.constexpr):
    """1 / (1 + 2^(-x log2 e)).  On NVIDIA the flush-to-zero ex2/rcp: ``tl.sigmoid``'s IEEE versions
    add subnormal fix-up sequences (a third of the fused kernel's instructions with the NaN selects);
    1 + 2^(...) >= 1 is never subnormal, and a flushed 2^(...) only rounds 1 + tiny to 1 as well."""
    if FLUSH_SUBNORMALS:
        e = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * NEG_LOG2E], dtype=tl.float32, is_pure=True, pack=1
        )
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e], dtype=tl.float32, is_pure=True, pack=1
        )
    return tl.sigmoid(x)


@triton.jit
def _mx_quantize_tile(
    v,  # [BLOCK_M, BLOCK_K] fp32
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MAX_EXP: tl.constexpr,  # FP8_MAX = (1 + MAX_MANT / 2^23) * 2^MAX_EXP
    MAX_MANT: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_NATIVE_STORE: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_K // MX
    blocks = tl.reshape(v, (BLOCK_M, NB, MX))
    if FP8_NATIVE_STORE != 0:
        # NVIDIA's max.f32 returns the other operand when one is NaN: NaN takes no part in the scale
        # without a NaN test and select per element (an all-NaN block reduces to NaN, floored below).
        magnitude = tl.abs(blocks)
    else:  # the interpreter's (numpy) and AMD's max propagate NaN
        magnitude = tl.where(blocks != blocks, 0.0, tl.abs(blocks))
    amax = tl.maximum(tl.max(magnitude, axis=2), 1.1754943508222875e-38)  # [BLOCK_M, NB], >= fp32 tiny
    abits = amax.to(tl.int32, bitcast=True)
    # ceil(log2(amax / FP8_MAX)): exponent difference, plus one when amax's significand is larger.
    sb = (abits >> 23) - MAX_EXP + ((abits & 0x7FFFFF) > MAX_MANT).to(tl.int32)  # biased exponents: +127 cancels
    sb = tl.where(amax == float("inf"), SCALE_MAX, tl.minimum(tl.maximum(sb, 0), SCALE_MAX))
    # 2^(127 - sb) as fp32 bits; sb = 254 (only an infinite amax) would need the subnormal 2^-127,
    # so use 2^-126 and an extra halving.
    # (a constexpr global stays right of the tensor: the interpreter cannot put it on the left)
    factor = ((sb == SCALE_MAX).to(tl.int32) - sb + UNSCALE_FIELD) << 23
    factor = factor.to(tl.float32, bitcast=True)
    factor = tl.where(sb == SCALE_MAX, factor * 0.5, factor)
    scaled = tl.reshape(blocks * tl.reshape(factor, (BLOCK_M, NB, 1)), (BLOCK_M, BLOCK_K))
    if FP8_NATIVE_STORE != 0:
        codes = fp8_encode_native(scaled, v, FP8_NATIVE_STORE)  # signs from v: a NaN product may lose its sign
    else:
        scaled = tl.where(v != v, v, scaled)  # keep the input NaN (and its sign)
        codes = fp8_encode(scaled, FP8, FP8_MAX)
    return codes, sb


@triton.jit
def _store_tile(values_ptr, scales_ptr, codes, sb, rows, cols, mask, pid_k, M, K, BLOCK_K: tl.constexpr):
    """Store a quantized tile: FP8 bytes into values [M, K], its E8M0 bytes into scales [M, K / 32]."""
    tl.store(values_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], codes.to(tl.uint8), mask=mask)
    NB: tl.constexpr = BLOCK_K // MX
    scale_cols = pid_k * NB + tl.arange(0, NB)
    scale_mask = (rows[:, None] < M) & (scale_cols[None, :] < K // MX)
    tl.store(
        scales_ptr + rows[:, None].to(tl.int64) * (K // MX) + scale_cols[None, :], sb.to(tl.uint8), mask=scale_mask
    )


@triton.jit
def _mxfp8_quantize_kernel(
    x_ptr,  # [M, K] any float dtype, last dim contiguous
    values_ptr,  # [M, K] uint8 view of the FP8 output
    scales_ptr,  # [M, K / 32] uint8 view of the E8M0 output
    M,
    k_blocks,  # K / 32
    stride_units,  # x's row stride / ROW_ALIGN
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXACT_BF16: tl.constexpr,
    MAX_EXP: tl.constexpr,
    MAX_MANT: tl.constexpr,  # quant_constexprs: FP8_MAX's fp32 fields, the FP8 launch constants
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_NATIVE_LOAD: tl.constexpr,
    FP8_NATIVE_STORE: tl.constexpr,
):
    K = k_blocks * MX  # sizes rebuilt from units: the compiler sees their alignment (see _row_units)
    stride_xm = stride_units * ROW_ALIGN
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = to_fp32(x, EXACT_BF16)
    codes, sb = _mx_quantize_tile(x, BLOCK_M, BLOCK_K, MAX_EXP, MAX_MANT, FP8, FP8_MAX, FP8_NATIVE_STORE)
    _store_tile(values_ptr, scales_ptr, codes, sb, rows, cols, mask, pid_k, M, K, BLOCK_K)


@triton.jit
def _swiglu_oai_mxfp8_kernel(
    gate_up_ptr,  # [M, 2I] split layout: gate = [:, :I], up = [:, I:]
    values_ptr,  # [M, I] uint8 view of the FP8 output
    scales_ptr,  # [M, I / 32] uint8 view of the E8M0 output
    M,
    i_blocks,  # I / 32
    stride_units,  # gate_up's row stride / ROW_ALIGN
    alpha,
    beta,
    limit,
    HAS_LIMIT: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXACT_BF16: tl.constexpr,
    MAX_EXP: tl.constexpr,
    MAX_MANT: tl.constexpr,  # quant_constexprs: FP8_MAX's fp32 fields, the FP8 launch constants
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_NATIVE_LOAD: tl.constexpr,
    FP8_NATIVE_STORE: tl.constexpr,
):
    I = i_blocks * MX
    stride_m = stride_units * ROW_ALIGN
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K] activation columns
    mask = (rows[:, None] < M) & (cols[None, :] < I)
    row_ptr = gate_up_ptr + rows[:, None].to(tl.int64) * stride_m
    gate = to_fp32(tl.load(row_ptr + cols[None, :], mask=mask, other=0.0), EXACT_BF16)
    up = to_fp32(tl.load(row_ptr + I + cols[None, :], mask=mask, other=0.0), EXACT_BF16)
    # Inductor passes Python floats as fp64 scalars: without the casts the activation would be fp64.
    alpha, beta, limit = tl.cast(alpha, tl.float32), tl.cast(beta, tl.float32), tl.cast(limit, tl.float32)
    if HAS_LIMIT:  # NaN stays NaN, as in torch.clamp (a plain min/max would return the limit)
        gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(
            tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL
        )
    act = gate * _sigmoid(alpha * gate, FP8_NATIVE_STORE != 0) * (up + beta)  # fp32, never rounded before the quant
    codes, sb = _mx_quantize_tile(act, BLOCK_M, BLOCK_K, MAX_EXP, MAX_MANT, FP8, FP8_MAX, FP8_NATIVE_STORE)
    _store_tile(values_ptr, scales_ptr, codes, sb, rows, cols, mask, pid_k, M, I, BLOCK_K)


def quant_constexprs(fp8: FP8Launch) -> dict:
    """The quantizers' constexprs: the FP8 launch constants and FP8_MAX's fp32 exponent and significand bits."""
    bits = struct.unpack("<I", struct.pack("<f", fp8.fmt.max))[0]
    return dict(MAX_EXP=(bits >> 23) - 127, MAX_MANT=bits & 0x7FFFFF, EXACT_BF16=exact_bf16(), **fp8.constexprs())


def _row_units(stride) -> tuple:
    """A row stride as ``(stride_units, ROW_ALIGN)``.

    Sizes and strides reach the kernels as plain ints.  Triton specialises an int argument divisible by 16
    when it launches a kernel itself, but Inductor's launch of a user kernel with symbolic sizes does not: its
    loads then lose their alignment and are not vectorised (the compiled fused SwiGLU op ran at half the
    eager bandwidth on the H200).  Passing sizes in units of their known alignment (K / 32 for MX widths) and
    strides in units of 16 elements when they are multiples of 16 (a divisibility guard under tracing) keeps
    the alignment visible in the kernel in both launches.
    """
    align = 16 if stride % 16 == 0 else 1
    return stride // align, align


def quant_tile(K: int, interpreting: bool) -> dict:
    """The quantizers' tile and warps for rows of ``K`` values: a pure function shared with the tests.

    The interpreter runs one numpy program at a time: few, large programs are fastest there.
    """
    if interpreting:
        return dict(BLOCK_M=64, BLOCK_K=min(256, triton.next_power_of_2(K)), num_warps=4)
    # 4 x 1024 / 8 warps reaches the copy ceiling at large M; 8 x 256 / 4 warps wastes no columns when
    # K % 1024 != 0 (bench/NOTES.md).
    if K % 1024 == 0:
        return dict(BLOCK_M=4, BLOCK_K=1024, num_warps=8)
    return dict(BLOCK_M=8, BLOCK_K=256, num_warps=4)


def _outputs(rows, K: int, device):
    values = empty_row_major((rows, K), torch.uint8, device)
    scales = empty_row_major((rows, K // MX_BLOCK_SIZE), torch.uint8, device)
    return values, scales


def mxfp8_quantize(x: torch.Tensor, fmt: FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % 32 == 0, last dim contiguous) -> values [..., K] fmt.dtype, scales [..., K/32] e8m0."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)  # [M, K]
    M = x2.shape[0]
    values, scales = _outputs(M, K, x.device)
    tile = quant_tile(K, interpreting())
    grid = (triton.cdiv(M, tile["BLOCK_M"]), triton.cdiv(K, tile["BLOCK_K"]))
    units, align = _row_units(x2.stride(0))
    launch(
        _mxfp8_quantize_kernel,
        grid,
        x2,
        values,
        scales,
        M,
        K // MX_BLOCK_SIZE,
        units,
        ROW_ALIGN=align,
        **tile,
        **quant_constexprs(fp8_launch(fmt, values)),
    )
    return (
        values.view(fmt.dtype).view(x.shape),
        scales.view(E8M0_DTYPE).view(*x.shape[:-1], K // MX_BLOCK_SIZE),
    )


def swiglu_oai_mxfp8_quant(
    gate_up: torch.Tensor, alpha: float, beta: float, limit: float | None, fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [..., 2I] -> values [..., I] fmt.dtype, scales [..., I/32] e8m0 (one fused kernel)."""
    I = gate_up.shape[-1] // 2
    g2 = gate_up.reshape(-1, 2 * I)  # [M, 2I]
    M = g2.shape[0]
    values, scales = _outputs(M, I, gate_up.device)
    tile = quant_tile(I, interpreting())
    grid = (triton.cdiv(M, tile["BLOCK_M"]), triton.cdiv(I, tile["BLOCK_K"]))
    units, align = _row_units(g2.stride(0))
    launch(
        _swiglu_oai_mxfp8_kernel,
        grid,
        g2,
        values,
        scales,
        M,
        I // MX_BLOCK_SIZE,
        units,
        float(alpha),
        float(beta),
        float(limit if limit is not None else 0.0),
        HAS_LIMIT=limit is not None,
        ROW_ALIGN=align,
        **tile,
        **quant_constexprs(fp8_launch(fmt, values)),
    )
    lead = gate_up.shape[:-1]
    return values.view(fmt.dtype).view(*lead, I), scales.view(E8M0_DTYPE).view(*lead, I // MX_BLOCK_SIZE)
