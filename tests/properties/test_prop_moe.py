"""Properties of the MoE ops against kernels/moe/naive.py (float64) and a plain-Python routing layout.

``moe_align`` is compared exactly with a layout built pair by pair (groups by expert in pair order, each
padded to ``block_m``, empty experts taking no block).  The GEMMs dequantize MXFP8 operands into the dot's
operand dtype (bf16 on a GPU for bf16 or MXFP8 x, fp32 otherwise): exact, except that a value below that dtype's
subnormals rounds (an FP8 code times 2^-127 reaches 2^-136; bf16 stops at 2^-133), so the reference dequantizes
the same way.  A float output then differs from the float64 product by the fp32 accumulation (at most
``K * 2^-24`` of ``sum |x| |w|`` in any order), operands or products in the fp32 subnormals that the hardware
may flush (``2^-126`` times ``sum |w| + sum |x| + K``) and one rounding to the output dtype (half an ulp, or half
its smallest subnormal).  The bound below doubles each term.  NaN and +-Inf positions (x's specials, E8M0 NaN
scale bytes, Inf times a flushed zero) must match the reference's exactly.  The routed MoE chain is compared like
tests/test_moe.py: ``2e-2`` of max |out| (a GEMM1 value an accumulation-order ulp away may move an MXFP8
activation code across a rounding tie).
"""

import math
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mm3_compile import platform
from mm3_compile.contract import MX_BLOCK_SIZE
from mm3_compile.kernels.moe import align as align_kernels
from mm3_compile.kernels.moe.naive import grouped_gemm_ref, mx_dequantize_f64
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

ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}  # one ulp (2x half)
SMALLEST = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149}  # smallest subnormal
# x exponents per dtype: |x| * |w| * K stays inside the output dtype (fp16 tops out at 65504)
X_MAX_EXP = {torch.bfloat16: 30, torch.float32: 30, torch.float16: 6}
MOE_TOL = 2e-2


def value_format():
    return platform.fp8_format(platform.mxfp8_value_dtype(torch.device("cpu")))


@st.composite
def mx_weights(draw, shape, nan_scales=True):
    """MXFP8 weights of ``shape`` from the reference quantizer (per-row magnitudes 2^-10..2^10), some E8M0
    NaN bytes (255) and 2^-127 bytes (0) planted among the scales."""
    w = draw(adversarial(shape, torch.float32, specials=False, subnormal=False, min_exp=-10, max_exp=10))
    values, scales = mxfp8_quantize_ref(w, value_format())
    scales = scales.view(torch.uint8).clone()
    if nan_scales and draw(st.booleans()):
        flat = scales.view(-1)
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        where = torch.randint(0, flat.numel(), (max(1, flat.numel() // 64),), generator=g)
        flat[where] = torch.tensor([255, 0], dtype=torch.uint8)[torch.randint(0, 2, where.shape, generator=g)]
    return values, scales


def error_bound(x_abs, w_abs_t, ref, K, out_dtype):
    """The per-element bound of the module docstring: x_abs [M, K], w_abs_t [K, N] (float64, no NaN)."""
    acc = x_abs @ w_abs_t  # sum |x| |w|
    flushed = 2.0**-126 * (x_abs.sum(-1, keepdim=True) + w_abs_t.sum(0, keepdim=True) + K)
    return ROUNDING[out_dtype] * ref.abs() + 2 * K * 2.0**-24 * acc + 2 * flushed + SMALLEST[out_dtype]


def dot_operand(t64, bf16_dot):
    """An MXFP8 operand as the kernel's dot sees it: bf16 on a GPU for bf16 / MXFP8 x, fp32 otherwise."""
    return t64.to(torch.bfloat16 if bf16_dot else torch.float32).double()


def bf16_dot(x_dtype):
    return DEVICE.type == "cuda" and (x_dtype == torch.bfloat16 or x_dtype.itemsize == 1)  # bf16 or MXFP8 x


def grouped_ref(x64, values, scales, ids, bf16):
    """Per pair ``x[t] @ W[ids[t, j]]^T`` in float64, with the weights as the dot sees them (``x64`` likewise)."""
    flat = ids.reshape(-1)
    rows = x64 if x64.shape[0] == flat.numel() else x64.repeat_interleave(ids.shape[1], dim=0)
    return torch.einsum("pk,pnk->pn", rows, dot_operand(mx_dequantize_f64(values, scales), bf16)[flat])


def assert_within(got, ref, bound, what, out_dtype):
    """NaN positions equal; Inf positions and signs equal, except that a finite reference within its bound of the
    output dtype's largest value may overflow to the Inf of its sign; everything else within the bound."""
    got = got.double().cpu()
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN positions differ ({int((got.isnan() != nan).sum())})"
    may_overflow = ~ref.isinf() & (ref.abs() + bound >= torch.finfo(out_dtype).max)
    overflowed = may_overflow & got.isinf() & (got.sign() == ref.sign())
    ref = torch.where(overflowed, got, ref)
    inf = ref.isinf()
    assert torch.equal(got.isinf() & ~nan, inf), f"{what}: Inf positions differ"
    assert torch.equal(got[inf], ref[inf]), f"{what}: Inf signs differ"
    finite = ~nan & ~inf
    excess = ((got - ref).abs() - bound)[finite]
    assert excess.numel() == 0 or float(excess.max()) <= 0, f"{what}: {int((excess > 0).sum())} past the bound"


def abs_dequant(values, scales):
    """|dequant| with NaN (NaN scale bytes, NaN codes) as 0: only the finite entries' bound uses it."""
    return torch.nan_to_num(mx_dequantize_f64(values, scales).abs(), nan=0.0)


def align_layout(ids, num_experts, block_m):
    """The aligned layout, pair by pair: (sorted_pairs, block_expert) as lists."""
    flat = ids.reshape(-1).tolist()
    P = len(flat)
    nb = min(P, math.ceil((P + num_experts * (block_m - 1)) / block_m))
    pairs, blocks, row = [-1] * (nb * block_m), [-1] * nb, 0
    for e in range(num_experts):
        members = [p for p in range(P) if flat[p] == e]
        pairs[row : row + len(members)] = members
        for b in range(math.ceil(len(members) / block_m)):
            blocks[row // block_m + b] = e
        row += math.ceil(len(members) / block_m) * block_m
    return pairs, blocks


@st.composite
def routes(draw, max_tokens=24):
    """ids [T, k] (repeats allowed, some experts left empty) over num_experts experts."""
    num_experts = draw(st.integers(1, 9))
    T = draw(st.integers(1, max_tokens * SCALE))
    k = draw(st.integers(1, 4))
    used = draw(st.integers(1, num_experts))  # routes land on the first `used` experts, shifted
    shift = draw(st.integers(0, num_experts - used))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ids = torch.randint(0, used, (T, k), generator=g) + shift
    return ids, num_experts


@settings(max_examples=examples(20))
@given(
    route=routes(max_tokens=40),
    block_m=st.sampled_from([16, 32, 64]),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    path=st.sampled_from(["one program", "one program, chunks of 32", "torch ops"]),
    more_experts=st.sampled_from([0, 0, 120, 300]),  # 129 (M3 with the shared expert), past a 256-wide tile
)
def test_align_layout_exact(route, block_m, dtype, path, more_experts):
    """Both implementations (the one-program kernel of decode-sized routings, sorting the routing whole or in
    chunks carried over by counts; the torch ops of larger ones)."""
    ids, num_experts = route
    num_experts += more_experts
    small = -1 if path == "torch ops" else align_kernels.SMALL_PAIRS
    chunk = 32 if path.endswith("32") else align_kernels.MAX_CHUNK
    with mock.patch.object(align_kernels, "SMALL_PAIRS", small), mock.patch.object(align_kernels, "MAX_CHUNK", chunk):
        pairs, blocks = torch.ops.mm3.moe_align(*on_device(ids.to(dtype)), num_experts, block_m)
    ref_pairs, ref_blocks = align_layout(ids, num_experts, block_m)
    assert pairs.dtype == torch.int32 and blocks.dtype == torch.int32
    assert pairs.cpu().tolist() == ref_pairs and blocks.cpu().tolist() == ref_blocks


@settings(max_examples=examples(10))
@given(
    target=targets(),
    route=routes(),
    block_m=st.sampled_from([16, 32, 64]),
    n=st.sampled_from([16, 48, 96]),
    k_blocks=st.integers(1, 6),
    dtype=st.sampled_from(FLOAT_DTYPES),
    data=st.data(),
)
def test_grouped_gemm1_within_bound(target, route, block_m, n, k_blocks, dtype, data):
    ids, num_experts = route
    K = k_blocks * MX_BLOCK_SIZE
    T, top_k = ids.shape
    x = data.draw(adversarial((T, K), dtype, max_exp=X_MAX_EXP[dtype]))
    with platform.emulate(target):
        values, scales = data.draw(mx_weights((num_experts, n, K)))
        pairs, blocks = torch.ops.mm3.moe_align(*on_device(ids), num_experts, block_m)
        got = torch.ops.mm3.mxfp8_grouped_gemm(*on_device(x, values, scales), pairs, blocks, block_m, top_k)
    assert got.shape == (T * top_k, n) and got.dtype == dtype
    ref = grouped_ref(x.double(), values, scales, ids, bf16_dot(dtype))
    w_abs = abs_dequant(values, scales)  # [E, n, K]
    x_abs = torch.nan_to_num(x.double().abs(), nan=0.0, posinf=0.0).repeat_interleave(top_k, 0)
    bound = torch.stack(
        [error_bound(x_abs[p : p + 1], w_abs[e].T, ref[p : p + 1], K, dtype)[0] for p, e in enumerate(ids.flatten())]
    )
    assert_within(got, ref, bound, "gemm1", dtype)


@settings(max_examples=examples(10))
@given(
    target=targets(),
    route=routes(),
    block_m=st.sampled_from([16, 32, 64]),
    n=st.sampled_from([16, 64]),
    k_blocks=st.integers(1, 6),
    weighted=st.booleans(),
    data=st.data(),
)
def test_grouped_gemm2_mx_activation_within_bound(target, route, block_m, n, k_blocks, weighted, data):
    """GEMM2: one MXFP8 row per pair (the fused quant's output), the product rounded to bf16, then the pair weight."""
    ids, num_experts = route
    K = k_blocks * MX_BLOCK_SIZE
    P = ids.numel()
    act = data.draw(adversarial((P, K), torch.float32, max_exp=20))
    with platform.emulate(target):
        x_values, x_scales = mxfp8_quantize_ref(act, value_format())
        values, scales = data.draw(mx_weights((num_experts, n, K)))
        pair_w = torch.rand(P, generator=torch.Generator().manual_seed(P)) if weighted else None
        pairs, blocks = torch.ops.mm3.moe_align(*on_device(ids), num_experts, block_m)
        got = torch.ops.mm3.mxfp8_grouped_gemm(
            *on_device(x_values, values, scales), pairs, blocks, block_m, 1, *on_device(x_scales, pair_w)
        )
    assert got.dtype == (torch.float32 if weighted else torch.bfloat16)
    x64 = dot_operand(mx_dequantize_f64(x_values, x_scales), bf16_dot(x_values.dtype))
    ref = grouped_ref(x64, values, scales, ids, bf16_dot(x_values.dtype))
    w_abs = abs_dequant(values, scales)
    x_abs = torch.nan_to_num(x64.abs(), nan=0.0, posinf=0.0)
    bound = torch.stack(
        [
            error_bound(x_abs[p : p + 1], w_abs[e].T, ref[p : p + 1], K, torch.bfloat16)[0]
            for p, e in enumerate(ids.flatten())
        ]
    )
    if weighted:
        ref, bound = ref * pair_w.double()[:, None], bound * pair_w.double()[:, None] * (1 + 2.0**-23)
    assert_within(got, ref, bound, "gemm2", got.dtype)


@settings(max_examples=examples(10))
@given(
    target=targets(),
    lead=st.sampled_from([(1,), (7,), (2, 3), (40 * SCALE,)]),
    n=st.sampled_from([16, 80]),
    k_blocks=st.integers(1, 5),
    dtype=st.sampled_from(FLOAT_DTYPES),
    data=st.data(),
)
def test_linear_within_bound(target, lead, n, k_blocks, dtype, data):
    K = k_blocks * MX_BLOCK_SIZE
    x = data.draw(adversarial((*lead, K), dtype, max_exp=X_MAX_EXP[dtype]))
    with platform.emulate(target):
        values, scales = data.draw(mx_weights((n, K)))
        got = torch.ops.mm3.mxfp8_linear(*on_device(x, values, scales))
    assert got.shape == (*lead, n) and got.dtype == dtype
    ref = x.double() @ dot_operand(mx_dequantize_f64(values, scales), bf16_dot(dtype)).T
    x_abs = torch.nan_to_num(x.double().abs(), nan=0.0, posinf=0.0)
    assert_within(got, ref, error_bound(x_abs, abs_dequant(values, scales).T, ref, K, dtype), "linear", dtype)


@settings(max_examples=examples(6))
@given(target=targets(), route=routes(), data=st.data())
def test_moe_experts_matches_float64_chain(target, route, data):
    ids, num_experts = route
    H, I = 64, 32 * data.draw(st.integers(1, 3))
    T = ids.shape[0]
    x = data.draw(adversarial((T, H), torch.bfloat16, specials=False, subnormal=False, min_exp=-2, max_exp=2))
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(T))
    with platform.emulate(target):
        fmt = value_format()
        v1, s1 = data.draw(mx_weights((num_experts, 2 * I, H), nan_scales=False))
        v2, s2 = data.draw(mx_weights((num_experts, H, I), nan_scales=False))
        out = torch.ops.mm3.moe_experts(*on_device(x, ids, w, v1, s1, v2, s2), 1.702, 1.0, 7.0).cpu()
    gate_up = grouped_gemm_ref(x.double(), v1, s1, ids).to(torch.bfloat16)
    act_v, act_s = mxfp8_quantize_ref(swiglu_oai_ref(gate_up, 1.702, 1.0, 7.0), fmt)
    y = grouped_gemm_ref(mx_dequantize_f64(act_v, act_s), v2, s2, ids).to(torch.bfloat16).double()
    ref = (y.view(*ids.shape, -1) * w.double().unsqueeze(-1)).sum(1)
    assert out.shape == (T, H) and out.dtype == torch.float32
    err = float((out.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-300))
    assert err <= MOE_TOL, err
