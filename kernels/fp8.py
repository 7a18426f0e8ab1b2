"""FP8 encode/decode as integer arithmetic, shared by every kernel that touches FP8 bytes.

Triton's own fp32 -> fp8 casts differ between versions and the interpreter (rounding,
saturation, missing FNUZ types), so kernels that *write* FP8 build the byte themselves:
round-to-nearest-even onto the format's grid, saturate to +-max, NaN stays NaN.  Kernels that
*read* FP8 use the typed hardware conversion where ``platform.triton_native_fp8`` allows and
``fp8_decode`` otherwise.  The format constants come from ``mm3_compile.platform.fp8_format``.
"""

import triton
import triton.language as tl

from mm3_compile.platform import FP8Format


# FP8_NATIVE codes for fp8_encode_native: which typed conversion the hardware does.
NATIVE_NONE, NATIVE_E4M3FN, NATIVE_E5M2 = 0, 1, 2


def native_encode_code(fmt: FP8Format, native: bool) -> int:
    """The FP8_NATIVE constexpr for ``fmt``: hardware conversion only for OCP formats on NVIDIA (cvt.rn.satfinite)."""
    if not native or fmt.fnuz:
        return NATIVE_NONE
    return NATIVE_E4M3FN if fmt.mantissa_bits == 3 else NATIVE_E5M2


def format_constants(fmt: FP8Format) -> dict:
    """Keyword constexprs describing ``fmt`` for ``fp8_encode`` / ``fp8_decode``."""
    return dict(
        FP8_MANT=fmt.mantissa_bits,
        FP8_BIAS=fmt.exponent_bias,
        FP8_MAX=fmt.max,
        FP8_FNUZ=fmt.fnuz,
        FP8_HAS_INF=fmt.has_inf,
    )


@triton.jit
def fp8_encode(v, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_MAX: tl.constexpr, FP8_FNUZ: tl.constexpr):
    """fp32 -> FP8 byte (int32 in [0, 255]); RNE, saturating, NaN -> NaN, -0 -> 0 on FNUZ."""
    EMIN: tl.constexpr = 1 - FP8_BIAS
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    is_nan = v != v
    mag = tl.minimum(tl.abs(v), FP8_MAX)  # saturate (inf included) before rounding
    mbits = mag.to(tl.int32, bitcast=True)
    exp = (mbits >> 23) - 127
    significand = (mbits & 0x7FFFFF) | 0x800000
    # Drop the low bits below the target quantum 2^(max(exp, EMIN) - MANT), ties to even.
    shift = tl.minimum(23 - FP8_MANT + tl.maximum(EMIN - exp, 0), 25)
    lsb = (significand >> shift) & 1
    units = (significand + (1 << (shift - 1)) - 1 + lsb) >> shift
    unit_exp = tl.maximum(exp, EMIN)
    carry = units >> (FP8_MANT + 1)  # rounding overflowed into the next binade
    units = units >> carry
    unit_exp = unit_exp + carry
    normal = units >= (1 << FP8_MANT)
    exp_field = tl.where(normal, unit_exp + FP8_BIAS, 0)
    mant_field = tl.where(normal, units - (1 << FP8_MANT), units)
    code = (exp_field << FP8_MANT) | mant_field
    if FP8_FNUZ:
        sign = tl.where(code == 0, 0, sign)  # FNUZ has no -0: 0x80 is its NaN
        nan_code = 0x80
    else:
        nan_code = (sign << 7) | 0x7F
    return tl.where(is_nan, nan_code, (sign << 7) | code)


@triton.jit
def fp8_decode(code, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_FNUZ: tl.constexpr, FP8_HAS_INF: tl.constexpr):
    """FP8 byte (any integer type, value in [0, 255]) -> fp32, exact for every format."""
    code = code.to(tl.int32) & 0xFF
    EXP_BITS: tl.constexpr = 7 - FP8_MANT
    exp_field = (code >> FP8_MANT) & ((1 << EXP_BITS) - 1)
    mant_field = code & ((1 << FP8_MANT) - 1)
    significand = tl.where(exp_field == 0, mant_field, mant_field + (1 << FP8_MANT)).to(tl.float32)
    unit = ((tl.maximum(exp_field, 1) - FP8_BIAS - FP8_MANT + 127) << 23).to(tl.float32, bitcast=True)
    value = significand * unit
    value = tl.where((code >> 7) == 1, -value, value)
    if FP8_FNUZ:
        value = tl.where(code == 0x80, float("nan"), value)
    elif FP8_HAS_INF:
        top = exp_field == (1 << EXP_BITS) - 1
        value = tl.where(top & (mant_field == 0), value * float("inf"), value)
        value = tl.where(top & (mant_field != 0), float("nan"), value)
    else:
        value = tl.where((code & 0x7F) == 0x7F, float("nan"), value)
    return value


@triton.jit
def fp8_encode_native(v, sign_source, FP8_NATIVE: tl.constexpr):
    """fp32 -> FP8 byte with the hardware's RNE saturating conversion; same bytes as ``fp8_encode``.

    The conversion gives every non-NaN value its sign (-0 included) but a positive NaN for every
    NaN, and OCP formats keep a NaN's sign: the sign bit of ``sign_source`` (``v``, or what ``v`` was
    scaled from when the product may have lost a NaN's sign) is or-ed in, two integer instructions
    instead of a NaN test and a select per element.
    """
    if FP8_NATIVE == 1:
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        code = v.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
    return code | ((sign_source.to(tl.int32, bitcast=True) >> 24) & 0x80)
