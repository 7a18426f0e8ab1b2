"""FP8 encode/decode as integer arithmetic, and the one rule that turns a format into kernel constants.

Triton's own fp32 -> fp8 casts differ between versions and the interpreter (rounding,
saturation, missing FNUZ types), so kernels that *write* FP8 build the byte themselves:
round-to-nearest-even onto the format's grid, saturate to +-max, NaN stays NaN.  Kernels that
*read* FP8 use the typed hardware conversion where ``platform.triton_native_fp8`` allows and
``fp8_decode`` otherwise.

Every kernel family launches through :func:`fp8_launch`: the authority's format and the tensor the
kernel reads or writes give one :class:`FP8Launch`, whose ``constexprs()`` are the same four
arguments in every kernel: ``FP8`` (the format packed in one integer, 0 = not FP8), ``FP8_MAX``,
``FP8_NATIVE_LOAD`` (the tensor is read typed, converted in hardware) and ``FP8_NATIVE_STORE``
(which hardware conversion an encoder may use).  The jit helpers unpack ``FP8`` themselves, so a
helper level passes one constexpr instead of four.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from mm3_compile import platform
from mm3_compile.platform import FP8Format

# FP8_NATIVE_STORE codes for fp8_encode_native: which typed conversion the hardware does.
NATIVE_NONE, NATIVE_E4M3FN, NATIVE_E5M2 = 0, 1, 2
# Bit fields of the packed FP8 constexpr: mantissa bits [0, 2), exponent bias [2, 7), FNUZ, IEEE infinities.
# The jit helpers unpack it with the same literals (the interpreter cannot shift an int by a constexpr global).
BIAS_SHIFT, FNUZ_BIT, INF_BIT = 2, 7, 8
NOT_FP8 = 0


def format_code(fmt: FP8Format | None) -> int:
    """The ``FP8`` constexpr of ``fmt``: its encoding parameters in one integer (0 for no FP8)."""
    if fmt is None:
        return NOT_FP8
    return (
        fmt.mantissa_bits
        | (fmt.exponent_bias << BIAS_SHIFT)
        | (int(fmt.fnuz) << FNUZ_BIT)
        | (int(fmt.has_inf) << INF_BIT)
    )


@dataclasses.dataclass(frozen=True)
class FP8Launch:
    """How one kernel launch reads or writes its FP8 tensor (``fmt`` None: the tensor is not FP8).

    Build it with :func:`fp8_launch`; construct it directly only where no device exists (compiling
    ahead for a GPU target on the CPU).
    """

    fmt: FP8Format | None
    native_load: bool = False  # typed loads, converted in hardware; else bytes through ``fp8_decode``
    native_store: int = NATIVE_NONE  # NATIVE_* conversion of ``fp8_encode_native``; else ``fp8_encode``

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the kernel gets it: typed where it converts in hardware, else its bytes."""
        if self.fmt is None or self.native_load or t.dtype == torch.uint8:
            return t
        return t.view(torch.uint8)

    def constexprs(self) -> dict:
        """The kernel's FP8 constexprs (the same four for every kernel family)."""
        return dict(
            FP8=format_code(self.fmt),
            FP8_MAX=self.fmt.max if self.fmt is not None else 0.0,
            FP8_NATIVE_LOAD=self.native_load,
            FP8_NATIVE_STORE=self.native_store,
        )


def fp8_launch(fmt: FP8Format | None, t: torch.Tensor) -> FP8Launch:
    """The FP8 launch constants for a kernel that reads or writes ``t`` (stored in ``fmt``, None: not FP8).

    Args:
        fmt: the authority's format for ``t`` (``platform.fp8_format``), or None for bf16/fp16/fp32 data.
        t: the tensor the kernel reads or writes, typed FP8 or its uint8 bytes.

    Returns:
        An :class:`FP8Launch`: typed loads where ``platform.triton_native_fp8`` allows them and ``t`` is
        typed; the hardware encoder where ``platform.triton_native_fp8_encode`` allows it.

    Examples:
        >>> fmt = platform.fp8_format(platform.FP8_E4M3_OCP)
        >>> fp8_launch(fmt, torch.zeros(4, dtype=torch.uint8)).constexprs()["FP8_NATIVE_LOAD"]
        False
    """
    if fmt is None:
        return FP8Launch(None)
    native_load = t.dtype != torch.uint8 and platform.triton_native_fp8(fmt.dtype, t.device)
    native_store = NATIVE_NONE
    if platform.triton_native_fp8_encode(fmt.dtype, t.device):
        native_store = NATIVE_E4M3FN if fmt.mantissa_bits == 3 else NATIVE_E5M2
    return FP8Launch(fmt, native_load, native_store)


@triton.jit
def fp8_encode(v, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """fp32 -> FP8 byte (int32 in [0, 255]); RNE, saturating, NaN -> NaN, -0 -> 0 on FNUZ."""
    FP8_MANT: tl.constexpr = FP8 & 3
    FP8_BIAS: tl.constexpr = (FP8 >> 2) & 31
    FP8_FNUZ: tl.constexpr = (FP8 >> 7) & 1
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
def fp8_decode(code, FP8: tl.constexpr):
    """FP8 byte (any integer type, value in [0, 255]) -> fp32, exact for every format."""
    FP8_MANT: tl.constexpr = FP8 & 3
    FP8_BIAS: tl.constexpr = (FP8 >> 2) & 31
    FP8_FNUZ: tl.constexpr = (FP8 >> 7) & 1
    FP8_HAS_INF: tl.constexpr = (FP8 >> 8) & 1
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
def fp8_encode_native(v, sign_source, FP8_NATIVE_STORE: tl.constexpr):
    """fp32 -> FP8 byte with the hardware's RNE saturating conversion; same bytes as ``fp8_encode``.

    The conversion gives every non-NaN value its sign (-0 included) but a positive NaN for every
    NaN, and OCP formats keep a NaN's sign: the sign bit of ``sign_source`` (``v``, or what ``v`` was
    scaled from when the product may have lost a NaN's sign) is or-ed in, two integer instructions
    instead of a NaN test and a select per element.
    """
    if FP8_NATIVE_STORE == 1:
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        code = v.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
    return code | ((sign_source.to(tl.int32, bitcast=True) >> 24) & 0x80)
