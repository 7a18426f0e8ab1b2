"""Exact widening of loaded float tiles to fp32, shared by the kernels that read bf16.

The Triton interpreter converts bf16 to fp32 with a float-format converter that gets bf16
subnormals wrong (3 * 2^-133 becomes 2^-127, 2^-133 becomes 0; fp16 and fp32 are fine).  A bf16
is the top half of the fp32 with the same value, so ``bits << 16`` is the exact conversion, for
subnormals, infinities and NaN payloads alike.  On GPUs the hardware conversion (``cvt.f32.bf16``)
is already exact and is one PTX instruction where the shift is two (``cvt.u32.u16`` + ``shl``):
launchers pass ``EXACT_BF16=interpreting()`` so the measured GPU code is unchanged.
"""

import triton
import triton.language as tl

from mm3_compile.platform import interpreting


def exact_bf16() -> bool:
    """The ``EXACT_BF16`` constexpr for a launch: the bit-level widening where the cast is wrong (the interpreter)."""
    return interpreting()


@triton.jit
def to_fp32(x, EXACT_BF16: tl.constexpr):
    """A loaded tile (bf16/fp16/fp32) -> fp32, exactly; bf16 through its bits when ``EXACT_BF16``."""
    if EXACT_BF16 and x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)
