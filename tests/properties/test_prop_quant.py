"""Properties of mm3::mxfp8_quantize and mm3::swiglu_oai_mxfp8_quant against kernels/mxfp8/naive.py.

Plain quantization is bit-exact for every input (NaN, +-Inf, zeros, subnormals of every input dtype,
magnitudes 2^-30..2^30) under every emulated platform.  The fused op quantizes the fp32 activation by
exactly the MX rule, but its sigmoid is the platform's ``1 / (1 + exp(-x))`` (numpy's exp in the
interpreter, ``ex2.approx`` on NVIDIA) while the reference uses torch's: the activations may differ
by a few fp32 ulps, which changes an FP8 code (by one) only where the activation lies within
``MIDPOINT_TOLERANCE`` quanta of a rounding midpoint.  Measured: at most 9.5e-7 quanta on the
interpreter (262,144 fp16-subnormal activations), 1.5e-6 in a longer fuzz run; the scales are
always equal.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mm3_compile import platform
from mm3_compile.contract import MX_BLOCK_SIZE
from mm3_compile.kernels.mxfp8.naive import mxfp8_quantize_ref, swiglu_oai_ref
from tests.properties.strategies import (
    DEVICE,
    FLOAT_DTYPES,
    SCALE,
    adversarial,
    device_mark,
    examples,
    on_device,
    targets,
)

pytestmark = device_mark()

# A few fp32 ulps of relative activation error (2^-21) times at most 2^(MANT + 1) = 16 quanta per value.
MIDPOINT_TOLERANCE = 2.0**-17


def value_format():
    return platform.fp8_format(platform.mxfp8_value_dtype(DEVICE))


def assert_bits_equal(actual, expected, what):
    a, e = actual.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu()
    bad = (a != e).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ, first at {bad[:4].tolist()}"


def midpoint_distance(act, scale_bytes, fmt):
    """|act * 2^(127 - sb)| measured from its nearest FP8 rounding midpoint, in quanta (float64, exact)."""
    sb = scale_bytes.view(torch.uint8).double().repeat_interleave(MX_BLOCK_SIZE, -1)
    scaled = act.double().abs() * torch.exp2(127 - sb)
    e = torch.floor(torch.log2(scaled.clamp(min=1e-300))).clamp(min=1 - fmt.exponent_bias)
    units = scaled / torch.exp2(e - fmt.mantissa_bits)
    return (units - torch.floor(units) - 0.5).abs()


@st.composite
def mx_shapes(draw, max_rows=70):
    lead = draw(st.sampled_from([(), (2,), (1, 3)]))
    rows = draw(st.integers(1, max_rows * SCALE))
    width = MX_BLOCK_SIZE * draw(st.integers(1, 9))
    return (*lead, rows, width)


@settings(max_examples=examples(10))
@given(target=targets(), dtype=st.sampled_from(FLOAT_DTYPES), shape=mx_shapes(), data=st.data())
def test_mxfp8_quantize_bit_exact(target, dtype, shape, data):
    x = data.draw(adversarial(shape, dtype))
    with platform.emulate(target):
        values, scales = (t.cpu() for t in torch.ops.mm3.mxfp8_quantize(*on_device(x)))
        ref_values, ref_scales = mxfp8_quantize_ref(x, value_format())
    assert values.shape == x.shape and scales.shape == (*shape[:-1], shape[-1] // MX_BLOCK_SIZE)
    assert_bits_equal(scales, ref_scales, "scales")
    assert_bits_equal(values, ref_values, "values")


def check_swiglu(gate_up, alpha, beta, limit):
    values, scales = (t.cpu() for t in torch.ops.mm3.swiglu_oai_mxfp8_quant(*on_device(gate_up), alpha, beta, limit))
    fmt = value_format()
    act = swiglu_oai_ref(gate_up, alpha, beta, limit)
    ref_values, ref_scales = mxfp8_quantize_ref(act, fmt)
    assert_bits_equal(scales, ref_scales, "scales")
    # A NaN that arithmetic produced has no defined sign (a canonical NaN on GPUs): compared as NaN.  Nor has
    # a zero clamped against a zero limit (IEEE leaves min(-0, +0) open: numpy gives +0, torch.clamp keeps -0).
    nan = torch.isnan(ref_values.float())
    assert torch.equal(torch.isnan(values.float()), nan), "NaN positions differ"
    codes, ref_codes = values.view(torch.uint8)[~nan].int(), ref_values.view(torch.uint8)[~nan].int()
    mag, ref_mag = codes & 0x7F, ref_codes & 0x7F
    assert torch.equal((codes >> 7)[(mag > 0) & (ref_mag > 0)], (ref_codes >> 7)[(mag > 0) & (ref_mag > 0)]), "signs"
    flips = mag != ref_mag
    if flips.any():
        assert (mag - ref_mag)[flips].abs().max() == 1, "a code differs by more than one step"
        dist = midpoint_distance(act, ref_scales, fmt)[~nan][flips]
        assert dist.max() <= MIDPOINT_TOLERANCE, f"a code differs {dist.max():.3g} quanta from a midpoint"
    return values, scales


@settings(max_examples=examples(10))
@given(
    target=targets(),
    dtype=st.sampled_from(FLOAT_DTYPES),
    shape=mx_shapes(max_rows=40),
    alpha=st.sampled_from([1.702, 1.0, 0.25]),
    beta=st.sampled_from([1.0, 0.0, -0.5]),
    limit=st.sampled_from([7.0, None, 0.0, 1e4]),
    data=st.data(),
)
def test_swiglu_oai_mxfp8_matches_reference(target, dtype, shape, alpha, beta, limit, data):
    gate_up = data.draw(adversarial((*shape[:-1], 2 * shape[-1]), dtype))
    with platform.emulate(target):
        values, scales = check_swiglu(gate_up, alpha, beta, limit)
    assert values.shape == shape and scales.shape == (*shape[:-1], shape[-1] // MX_BLOCK_SIZE)


@settings(max_examples=examples(6))
@given(target=targets(), data=st.data())
def test_swiglu_fp16_subnormal_activations(target, data):
    """fp16-subnormal gate/up (|x| ~ 1e-6) give activations with few significant bits,
    often next to an FP8 midpoint: the flips stay within MIDPOINT_TOLERANCE."""
    rows = data.draw(st.integers(1, 64 * SCALE))
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(-1023, 1024, (rows, 2 * 128), generator=g).double()
    gate_up = (m * 2.0**-24).to(torch.float16)  # every fp16 subnormal (and zero)
    with platform.emulate(target):
        check_swiglu(gate_up, 1.702, 1.0, 7.0)


@settings(max_examples=examples(2))
@given(target=targets(), dtype=st.sampled_from(FLOAT_DTYPES), shape=mx_shapes(max_rows=9), data=st.data())
def test_compiled_matches_eager(target, dtype, shape, data):
    x = data.draw(adversarial(shape, dtype))
    gate_up = data.draw(adversarial((*shape[:-1], 2 * shape[-1]), dtype))

    def both(x, gate_up):
        return torch.ops.mm3.mxfp8_quantize(x), torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up, 1.702, 1.0, 7.0)

    torch._dynamo.reset()
    x, gate_up = on_device(x, gate_up)
    with platform.emulate(target):
        compiled = torch.compile(both, backend="aot_eager", fullgraph=True)(x, gate_up)
        eager = both(x, gate_up)
    for got, want in zip((*compiled[0], *compiled[1]), (*eager[0], *eager[1])):
        assert got.dtype == want.dtype
        assert_bits_equal(got, want, "compiled vs eager")
