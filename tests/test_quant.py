"""mm3::mxfp8_quantize and mm3::swiglu_oai_mxfp8_quant: bit-exact against the float64 reference.

Every platform's value dtype is exercised through emulation (sm_90: OCP e4m3fn, gfx942: FNUZ
e4m3fnuz), so the FNUZ numerics are tested without MI300 hardware.
"""

import math

import pytest
import torch

from mm3_compile import platform
from mm3_compile.kernels.mxfp8.naive import (
    mxfp8_dequantize_ref,
    mxfp8_quantize_floor_ref,
    mxfp8_quantize_ref,
    swiglu_oai_ref,
)

TARGETS = ("sm_90", "gfx942")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture(params=TARGETS)
def target(request):
    with platform.emulate(request.param):
        yield request.param


def value_format(device):
    return platform.fp8_format(platform.mxfp8_value_dtype(device))


def assert_bits_equal(actual, expected):
    assert actual.dtype == expected.dtype
    a, e = actual.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu()
    mismatch = (a != e).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} bytes differ, first at {mismatch[:4].tolist()}"


def wide_range(shape, dtype, device, seed=0):
    """Values spread over ~2^-24..2^24 so blocks have very different scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-24, 24, shape, generator=g).float())
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(77, 96), (2, 5, 64), (1, 32)])  # 77 rows: not a multiple of the row tile
def test_mxfp8_quantize_bit_exact(target, dtype, shape, device):
    x = wide_range(shape, dtype, device)
    values, scales = torch.ops.mm3.mxfp8_quantize(x)
    fmt = value_format(device)
    ref_values, ref_scales = mxfp8_quantize_ref(x, fmt)
    assert values.dtype == fmt.dtype and scales.dtype == platform.E8M0_DTYPE
    assert values.shape == x.shape and scales.shape == (*shape[:-1], shape[-1] // 32)
    assert_bits_equal(scales, ref_scales)
    assert_bits_equal(values, ref_values)


def test_value_dtype_follows_platform(device):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(device)
    with platform.emulate("sm_90"):
        ocp_values, ocp_scales = torch.ops.mm3.mxfp8_quantize(x)
    with platform.emulate("gfx942"):
        fnuz_values, fnuz_scales = torch.ops.mm3.mxfp8_quantize(x)
    assert (ocp_values.dtype, fnuz_values.dtype) == (platform.FP8_E4M3_OCP, platform.FP8_E4M3_FNUZ)
    # FNUZ's max (240) is ~half of OCP's (448): the block exponent grows by 0 or 1 ...
    step = fnuz_scales.view(torch.uint8).int() - ocp_scales.view(torch.uint8).int()
    assert step.min() >= 0 and step.max() <= 1 and step.max() == 1
    # ... and both dequantize to x within half an e4m3 step (2^-4 relative) of the block maximum.
    block_max = x.abs().reshape(4, 2, 32).amax(-1, keepdim=True).repeat_interleave(32, -1).reshape(4, 64)
    for values, scales in ((ocp_values, ocp_scales), (fnuz_values, fnuz_scales)):
        err = (mxfp8_dequantize_ref(values, scales) - x).abs()
        assert torch.all(err <= block_max * 2.0**-4)


def test_special_blocks(target, device):
    fmt = value_format(device)
    x = torch.randn(8, 64)
    x[0, :32] = 0.0  # all-zero block: sb = 0 and zeros, no NaN
    x[1, :32] = 2.0**-10  # mixed magnitudes (upstream #53668)
    x[1, 0] = 1.0
    x[2, :32] = fmt.max  # exactly at FP8_MAX
    x[3, :32] = torch.linspace(-4 * fmt.max, 4 * fmt.max, 32)  # above FP8_MAX: scaled back into range
    x[4, 3] = float("nan")
    x[5, 7] = float("inf")
    x[5, 40] = -float("inf")
    x[6, :32] = torch.finfo(torch.float32).tiny / 4  # fp32 subnormals
    x[7, :32] = torch.finfo(torch.float32).max
    x = x.to(device)
    values, scales = torch.ops.mm3.mxfp8_quantize(x)
    ref_values, ref_scales = mxfp8_quantize_ref(x, fmt)
    assert_bits_equal(scales, ref_scales)
    assert_bits_equal(values, ref_values)

    sb = scales.view(torch.uint8).cpu()
    deq = mxfp8_dequantize_ref(values, scales).cpu()
    assert sb[0, 0] == 0 and torch.all(deq[0, :32] == 0)
    assert torch.all(deq[1, 1:32] == 2.0**-10), "small values sharing a block with 1.0 must survive"
    assert torch.equal(deq[2, :32], x[2, :32].cpu())
    # NaN stays NaN and does not poison the block's scale; +-Inf saturate to +-FP8_MAX * 2^(254-127).
    assert torch.isnan(deq[4, 3]) and torch.isfinite(deq[4, torch.arange(64) != 3]).all()
    assert sb[5, 0] == 254 and sb[5, 1] == 254
    assert values[5, 7].float() == fmt.max and values[5, 40].float() == -fmt.max
    assert sb[6, 0] == 0  # amax floored at fp32 tiny
    largest = torch.finfo(torch.float32).max
    assert sb[7, 0] == math.ceil(math.log2(largest / fmt.max)) + 127 < 254  # finite amax never reaches 254


def test_floor_formula_negative_control(device):
    """The old ``floor(log2(amax)) + 127`` rule flushes 2^-10 next to 1.0; our reference must not."""
    with platform.emulate("sm_90"):
        fmt = value_format(device)
        x = torch.full((1, 32), 2.0**-10)
        x[0, 0] = 1.0
        values, scales = torch.ops.mm3.mxfp8_quantize(x.to(device))
        old_values, old_scales = mxfp8_quantize_floor_ref(x, fmt)
        assert torch.all(mxfp8_dequantize_ref(old_values, old_scales)[0, 1:] == 0)  # the bug
        assert old_scales.view(torch.uint8).item() - scales.view(torch.uint8).item() == 8  # "assert 8 <= 1"
        assert torch.all(mxfp8_dequantize_ref(values, scales).cpu()[0, 1:] == 2.0**-10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit", [7.0, None])
def test_swiglu_oai_mxfp8_matches_unfused(target, dtype, limit, device):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(70, 2 * 96, generator=g) * 4).to(dtype).to(device)  # |x| up to ~16: the clamps bite
    values, scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up, 1.702, 1.0, limit)
    fmt = value_format(device)
    ref_values, ref_scales = mxfp8_quantize_ref(swiglu_oai_ref(gate_up, 1.702, 1.0, limit), fmt)
    assert values.shape == (70, 96) and scales.shape == (70, 3)
    assert_bits_equal(scales, ref_scales)
    # exp/sigmoid may differ by an ulp from torch's: at most one FP8 code on at most 1e-4 of elements
    diff = (values.view(torch.uint8).cpu().int() - ref_values.view(torch.uint8).cpu().int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-4


def test_swiglu_oai_mxfp8_special_values(target, device):
    """NaN (either sign) stays NaN through the clamps, as in the reference (torch.clamp propagates NaN; a
    plain min/max would turn it into the limit); +-inf and huge inputs are clamped; a block of NaNs gets
    the smallest scale.  The sign of a NaN that arithmetic produced is not defined (the GPU returns a
    canonical NaN, numpy keeps an operand's), so NaN codes are compared as NaN."""
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(8, 2 * 128, generator=g) * 4  # gate = [:, :128], up = [:, 128:]
    gate_up[0, 3] = float("nan")
    gate_up[1, 130] = -float("nan")
    gate_up[2, 5] = float("inf")
    gate_up[3, 131] = -float("inf")
    gate_up[4, :32] = 0.0
    gate_up[5, 160:192] = float("nan")  # a whole block of the activation
    gate_up[6, 10] = 100.0
    gate_up[7, 140] = -100.0
    gate_up = gate_up.to(torch.bfloat16).to(device)
    values, scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up)
    ref_values, ref_scales = mxfp8_quantize_ref(swiglu_oai_ref(gate_up), value_format(device))
    assert_bits_equal(scales, ref_scales)
    nan = torch.isnan(ref_values.float().cpu())
    assert torch.equal(torch.isnan(values.float().cpu()), nan)
    assert nan[0, 3] and nan[1, 2] and nan[5, 32:64].all() and nan.sum() == 34
    codes, ref_codes = values.view(torch.uint8).cpu(), ref_values.view(torch.uint8).cpu()
    assert torch.equal(codes[~nan], ref_codes[~nan])
    assert scales.view(torch.uint8)[5, 1] == 0


@pytest.mark.parametrize("row_width", [136, 144, 200])  # row strides: 8 (mod 16), a multiple of 16, 8 again
def test_strided_rows(target, row_width, device):
    """Rows of a wider buffer: the kernels take the row stride in units of 16 elements only when it is a
    multiple of 16 (alignment the compiler may then assume), in elements otherwise."""
    base = wide_range((9, row_width), torch.bfloat16, device, seed=4)
    x = base[:, :96]
    values, scales = torch.ops.mm3.mxfp8_quantize(x)
    ref_values, ref_scales = mxfp8_quantize_ref(x.contiguous(), value_format(device))
    assert_bits_equal(scales, ref_scales)
    assert_bits_equal(values, ref_values)
    gate_up = base[:, :128].float().clamp(-30, 30).to(torch.bfloat16)  # contiguous: the expectation
    strided = torch.empty_like(base)[:, :128].copy_(gate_up)
    got = torch.ops.mm3.swiglu_oai_mxfp8_quant(strided)
    want = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up)
    assert strided.stride(0) == row_width and gate_up.stride(0) == 128
    assert_bits_equal(got[0], want[0])
    assert_bits_equal(got[1], want[1])


def test_swiglu_oai_mxfp8_alpha_beta_3d(target, device):
    gate_up = torch.randn(2, 3, 128, device=device)
    values, scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up, alpha=1.0, beta=0.5, limit=2.0)
    ref_values, ref_scales = mxfp8_quantize_ref(swiglu_oai_ref(gate_up.cpu(), 1.0, 0.5, 2.0), value_format(device))
    assert values.shape == (2, 3, 64) and scales.shape == (2, 3, 2)
    assert_bits_equal(scales, ref_scales)
    diff = (values.view(torch.uint8).cpu().int() - ref_values.view(torch.uint8).cpu().int()).abs()
    assert diff.max() <= 1 and (diff > 0).sum() <= 1  # 384 values: at most one sigmoid-ulp code flip


@pytest.mark.parametrize("shape", [(3, 64), (17, 32), (2, 4, 96)])
def test_opcheck(target, shape, device):
    x = torch.randn(shape, device=device)
    torch.library.opcheck(torch.ops.mm3.mxfp8_quantize.default, (x,))
    gate_up = torch.randn(*shape[:-1], 2 * shape[-1], device=device)
    torch.library.opcheck(torch.ops.mm3.swiglu_oai_mxfp8_quant.default, (gate_up, 1.702, 1.0, 7.0))
    torch.library.opcheck(torch.ops.mm3.swiglu_oai_mxfp8_quant.default, (gate_up, 1.702, 1.0, None))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda d: torch.randn(4, 48, device=d),
            ValueError,
            "x: the quantized width must be a positive multiple of 32",
        ),
        (lambda d: torch.ones(4, 64, dtype=torch.int32, device=d), TypeError, "x: expected dtype"),
        (lambda d: torch.randn(64, 4, device=d).t(), ValueError, "x: the last dim must be contiguous"),
        (lambda d: torch.randn(4, 64, device=d).to(platform.FP8_E4M3_OCP), TypeError, "x: expected dtype"),
        (
            lambda d: torch.randn(4, 0, device=d),
            ValueError,
            "x: the quantized width must be a positive multiple of 32, got 0",
        ),
        (lambda d: torch.tensor(1.0, device=d), ValueError, "x: expected at least 1 dims"),
    ],
)
def test_mxfp8_quantize_bad_input(make, error, match, device):
    with pytest.raises(error, match=match):
        torch.ops.mm3.mxfp8_quantize(make(device))


def test_swiglu_bad_input(device):
    with pytest.raises(ValueError, match="gate_up: the last dim must be 2\\*I"):
        torch.ops.mm3.swiglu_oai_mxfp8_quant(torch.randn(2, 65, device=device))
    with pytest.raises(ValueError, match="gate_up: the quantized width must be a positive multiple of 32"):
        torch.ops.mm3.swiglu_oai_mxfp8_quant(torch.randn(2, 96, device=device))
    with pytest.raises(ValueError, match="gate_up: the quantized width must be a positive multiple of 32, got 0"):
        torch.ops.mm3.swiglu_oai_mxfp8_quant(torch.randn(2, 0, device=device))
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="limit: expected a clamp limit >= 0 or None"):
            torch.ops.mm3.swiglu_oai_mxfp8_quant(torch.randn(2, 64, device=device), 1.702, 1.0, bad)
    with pytest.raises(ValueError, match="alpha: expected a finite number"):
        torch.ops.mm3.swiglu_oai_mxfp8_quant(torch.randn(2, 64, device=device), float("inf"), 1.0, 7.0)


def test_no_fp8_platform_refuses(device):
    with platform.emulate("gfx90a"), pytest.raises(RuntimeError, match="gfx90a.*no FP8"):
        torch.ops.mm3.mxfp8_quantize(torch.randn(2, 32, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_large_bit_exact(dtype, device):
    x = wide_range((4096, 6144), dtype, device, seed=3)
    fmt = value_format(device)
    values, scales = torch.ops.mm3.mxfp8_quantize(x)
    ref_values, ref_scales = mxfp8_quantize_ref(x, fmt)
    assert_bits_equal(scales, ref_scales)
    assert_bits_equal(values, ref_values)
    gate_up = (torch.randn(4096, 6144, device=device) * 4).to(dtype)
    values, scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up)
    ref_values, ref_scales = mxfp8_quantize_ref(swiglu_oai_ref(gate_up), fmt)
    assert_bits_equal(scales, ref_scales)
    diff = (values.view(torch.uint8).cpu().int() - ref_values.view(torch.uint8).cpu().int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-4


def bf16_subnormals(rows: int, width: int) -> torch.Tensor:
    """Every bf16 subnormal magnitude m * 2^-133 (m = 1..127), both signs, tiled over [rows, width]."""
    m = torch.arange(1, 128, dtype=torch.float64)
    magnitudes = torch.cat([m, -m]) * 2.0**-133  # exact in bf16
    tiled = magnitudes.repeat(rows * width // magnitudes.numel() + 1)[: rows * width]
    return tiled.reshape(rows, width).to(torch.bfloat16)


def test_bf16_subnormal_input_exact(target, device):
    """The interpreter's bf16 -> fp32 cast turned 3 * 2^-133 into 2^-127 (value 1.0 instead of
    0.046875 at scale byte 0); the kernels widen bf16 through its bits."""
    fmt = value_format(device)
    x = torch.full((1, 32), 3 * 2.0**-133, dtype=torch.bfloat16, device=device)
    values, scales = torch.ops.mm3.mxfp8_quantize(x)
    assert scales.view(torch.uint8).item() == 0 and torch.all(values.float() == 0.046875)
    x = bf16_subnormals(4, 256).to(device)
    x[3, 32:64] = 1.0  # a normal block beside the subnormal ones
    values, scales = torch.ops.mm3.mxfp8_quantize(x)
    ref_values, ref_scales = mxfp8_quantize_ref(x, fmt)
    assert_bits_equal(scales, ref_scales)
    assert_bits_equal(values, ref_values)
    assert (ref_values.float() != 0).sum() > 500  # the comparison is not of flushed zeros


def test_swiglu_bf16_subnormal_input_exact(target, device):
    """The fused op reads bf16 the same exact way: a subnormal gate g gives sigmoid(alpha g) = 1/2 and
    up + beta = 1 in fp32, so the activation is exactly g / 2 and the codes are bit-exact."""
    gate = bf16_subnormals(4, 128)
    gate_up = torch.cat([gate, gate.flip(-1)], dim=-1).to(device)
    values, scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up)
    ref_values, ref_scales = mxfp8_quantize_ref(swiglu_oai_ref(gate_up), value_format(device))
    assert torch.equal(swiglu_oai_ref(gate_up), gate.float().to(device) / 2)
    assert_bits_equal(scales, ref_scales)
    assert_bits_equal(values, ref_values)
