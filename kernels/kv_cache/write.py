"""Paged KV-cache insert: ``key``/``value`` rows -> their slots in ``[num_blocks, Hkv, 128, 2D]`` pages.

One program writes ``BLOCK_R`` (token, KV head) rows, each the ``D`` key and ``D`` value elements
of one token and head; row ``r`` is token ``r // Hkv``, head ``r % Hkv``.  The destination of a
row is ``page * s_blk + head * s_head + offset * s_pos`` (K at ``+ d``, V at ``+ D + d``) with
``slot = page * 128 + offset``, so any block/head/position strides work (HND, or NHD exposed as a
permuted view).  Rows whose slot is negative (padding) or beyond ``num_blocks * 128`` are masked
out: they are neither read nor written.

FP8 caches are written as bytes (the kernel casts its pointer to uint8): ``x / scale`` in fp32
(correctly rounded division, like torch), then ``fp8_encode`` (round-to-nearest-even, saturating
to the format's max) in the flavour the authority resolved.  bf16/fp16 caches store the values
unchanged (the op requires key/value in the cache dtype); scales only apply to FP8 caches.
"""

import torch
import triton
import triton.language as tl

from mm3_compile.contract import PAGE_SIZE, SCALE_NONE, SCALE_PER_TOKEN_HEAD, SCALE_SCALAR
from mm3_compile.kernels._launch import launch
from mm3_compile.kernels.fp8 import fp8_encode, fp8_launch
from mm3_compile.kernels.widen import exact_bf16, to_fp32
from mm3_compile.platform import FP8Format, hardware_vendor, interpreting

PAGE = tl.constexpr(PAGE_SIZE)  # a Triton global must be a constexpr instance
MODE_SCALAR = tl.constexpr(SCALE_SCALAR)
MODE_PER_TOKEN_HEAD = tl.constexpr(SCALE_PER_TOKEN_HEAD)


@triton.jit
def _scale_rows(x, scale_ptr, heads, slots, row_ok, stride_sh, stride_ss, SCALE_MODE: tl.constexpr):
    """x [BLOCK_R, D] fp32 divided by its scale (none, one scalar, or scale[head, slot])."""
    # div_rn: a plain fp32 `/` is approximate on NVIDIA GPUs, torch's division is correctly rounded.
    scaled = x
    if SCALE_MODE == MODE_SCALAR:
        scaled = tl.math.div_rn(x, tl.zeros_like(x) + tl.load(scale_ptr))
    elif SCALE_MODE == MODE_PER_TOKEN_HEAD:
        s = tl.load(scale_ptr + heads.to(tl.int64) * stride_sh + slots * stride_ss, mask=row_ok, other=1.0)
        scaled = tl.math.div_rn(x, s[:, None] + tl.zeros_like(x))
    # GPU arithmetic returns a canonical (positive) NaN; keep the input's, whose sign OCP FP8 encodes.
    return tl.where(x != x, x, scaled)


@triton.jit
def _kv_cache_write_kernel(
    key_ptr,  # [num_tokens, Hkv, D]
    value_ptr,  # [num_tokens, Hkv, D]
    cache_ptr,  # [num_blocks, Hkv, 128, 2D] bf16/fp16, typed FP8 or uint8 bytes; strided, last dim contiguous
    slot_ptr,  # [num_tokens] int64
    k_scale_ptr,  # [1] or [Hkv, num_slots] fp32 (unused with SCALE_MODE 0)
    v_scale_ptr,
    num_rows,  # num_tokens * Hkv
    num_heads,
    num_slots,  # num_blocks * 128
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_cp,
    stride_ksh,
    stride_kss,
    stride_vsh,
    stride_vss,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    FP8: tl.constexpr,  # the FP8 launch constants (kernels/fp8.py); FP8 == 0: a bf16/fp16 cache
    FP8_MAX: tl.constexpr,
    FP8_NATIVE_LOAD: tl.constexpr,
    FP8_NATIVE_STORE: tl.constexpr,
    EXACT_BF16: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    tokens = rows // num_heads
    heads = rows % num_heads
    in_range = rows < num_rows
    slots = tl.load(slot_ptr + tokens, mask=in_range, other=-1)  # int64
    row_ok = in_range & (slots >= 0) & (slots < num_slots)
    slots = tl.where(row_ok, slots, 0)
    pages = slots // PAGE
    offsets = slots % PAGE
    d = tl.arange(0, D)
    mask = row_ok[:, None]
    k = tl.load(key_ptr + (tokens * stride_kt + heads * stride_kh)[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + (tokens * stride_vt + heads * stride_vh)[:, None] + d[None, :], mask=mask, other=0.0)
    dst = cache_ptr + (pages * stride_cb + heads * stride_ch + offsets * stride_cp)[:, None] + d[None, :]
    if FP8 != 0:
        dst = dst.to(tl.pointer_type(tl.uint8))  # FP8 is stored as the encoder's bytes
        k = _scale_rows(to_fp32(k, EXACT_BF16), k_scale_ptr, heads, slots, row_ok, stride_ksh, stride_kss, SCALE_MODE)
        v = _scale_rows(to_fp32(v, EXACT_BF16), v_scale_ptr, heads, slots, row_ok, stride_vsh, stride_vss, SCALE_MODE)
        tl.store(dst, fp8_encode(k, FP8, FP8_MAX).to(tl.uint8), mask=mask)
        tl.store(dst + D, fp8_encode(v, FP8, FP8_MAX).to(tl.uint8), mask=mask)
    else:
        tl.store(dst, k, mask=mask)
        tl.store(dst + D, v, mask=mask)


def rows_per_program(interpreting: bool) -> int:
    """``BLOCK_R``: (token, KV head) rows per program; the interpreter runs one numpy program at a time, so
    few, large programs are fastest there."""
    return 64 if interpreting else 16


def kv_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: FP8Format | None,
    scale_mode: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Write key/value [num_tokens, Hkv, D] into ``cache`` (typed view, validated by the op) in place.

    ``fmt`` is the cache's FP8 format (None for bf16/fp16 caches).  ``cache`` is the caller's
    tensor, uint8 or typed: the kernel casts its pointer to bytes.  A dtype-changing ``.view`` here
    would make Inductor copy a cache that is a graph input (measured on the H200: +1 GiB for a
    1 GiB typed cache); only Triton on NVIDIA, which has no fnuz pointer type, gets a byte view.
    """
    num_tokens, num_heads, D = key.shape
    num_slots = cache.shape[0] * PAGE_SIZE
    nvidia_fnuz = (
        fmt is not None and fmt.fnuz and cache.device.type == "cuda" and hardware_vendor(cache.device) == "nvidia"
    )
    target = cache.view(torch.uint8) if nvidia_fnuz and cache.dtype != torch.uint8 else cache
    if scale_mode == SCALE_NONE:
        k_scale = v_scale = slot_mapping  # never read; any pointer will do
    k_strides = tuple(k_scale.stride()) if scale_mode == SCALE_PER_TOKEN_HEAD else (0, 0)
    v_strides = tuple(v_scale.stride()) if scale_mode == SCALE_PER_TOKEN_HEAD else (0, 0)
    num_rows = num_tokens * num_heads
    block_r = rows_per_program(interpreting())
    fp8 = fp8_launch(fmt, target)  # the kernel always encodes with integer arithmetic (stores bytes)
    launch(
        _kv_cache_write_kernel,
        (triton.cdiv(num_rows, block_r),),
        key,
        value,
        target,
        slot_mapping,
        k_scale,
        v_scale,
        num_rows,
        num_heads,
        num_slots,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        target.stride(0),
        target.stride(1),
        target.stride(2),
        *k_strides,
        *v_strides,
        D=D,
        BLOCK_R=block_r,
        SCALE_MODE=scale_mode,
        EXACT_BF16=exact_bf16(),
        num_warps=4,
        **fp8.constexprs(),
    )
