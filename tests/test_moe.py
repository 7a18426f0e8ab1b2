"""MoE ops on MXFP8 weights (align, grouped GEMM, linear, the routed MoE) vs independent float64 references.

Tiny widths in the interpreter (E 8, top-2, H 64, I 64); both MXFP8 value dtypes (emulated sm_90: e4m3fn, gfx942:
e4m3fnuz). Tolerances, measured on these inputs (CPU interpreter):

* GEMM outputs in bf16 (GEMM1, the linear): one round-to-nearest of the fp32 accumulator, against the float64
  product: ``rtol 2^-8, atol 1e-6`` (measured max relative error 3.9e-3 on near-zero outputs, where the fp32
  summation order shows).
* GEMM2 (MXFP8 activation, bf16 rounding point, fp32 weighting) against the float64 product rounded to bf16 at
  the same point: the same tolerance (a near-tie may round the other way; measured 5.9e-8).
* The whole routed MoE vs the float64 chain (bf16 GEMM1 output, reference SwiGLU + MXFP8 quantizer, bf16 GEMM2
  output, fp32 weighting): ``2e-2`` of max |out|, room for one GEMM1 value a bf16 ulp away moving an MXFP8 byte
  across a rounding tie (on GPU accumulation orders); measured 6.1e-8 here.
"""

import dataclasses
import math

import pytest
import torch
import torch._dynamo.testing
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode

import mm3_compile
from mm3_compile import platform
from mm3_compile.kernels.moe import gemm as gemm_kernels
from mm3_compile.kernels.moe.naive import grouped_gemm_ref, mx_dequantize_f64, mxfp8_linear_ref, route_ref
from mm3_compile.kernels.moe.schedule import GemmConfig, num_blocks, schedule, split_k
from mm3_compile.kernels.mxfp8.naive import mxfp8_quantize_ref, swiglu_oai_ref
from tests.python_process import run_python

E, K_TOP, H, I = 8, 2, 64, 64
BLOCK_M = 16
TARGETS = ["sm_90", "gfx942"]
BF16_RTOL = 2.0**-8
MOE_TOL = 2e-2

pytestmark = pytest.mark.interpreter


def weights(target, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    with platform.emulate(target):
        values, scales = torch.ops.mm3.mxfp8_quantize(w)
    return values, scales.view(torch.uint8)


def routes(T, seed=0, experts=E):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(T, experts, generator=g).topk(K_TOP, dim=-1).indices  # distinct experts per token


def assert_bf16_close(got, ref):
    torch.testing.assert_close(got.double(), ref, rtol=BF16_RTOL, atol=1e-6, equal_nan=True)


def test_schedule_is_pure_and_picks_decode_or_prefill():
    assert schedule(4, 6144, 6144, 128, False) == schedule(4, 6144, 6144, 128, False)
    decode, prefill = schedule(4, 6144, 6144, 128, False), schedule(16384, 6144, 6144, 128, False)
    assert decode.BLOCK_M == 16 and prefill.BLOCK_M == 128
    # 256-row GEMM1 tiles from 256 rows per expert on (8192 tokens x top-4 of 128); GEMM2's tile divides them (it
    # runs over GEMM1's align layout)
    assert schedule(32768, 6144, 6144, 128, False).BLOCK_M == 256
    assert 256 % schedule(32768, 6144, 3072, 128, False, True).BLOCK_M == 0
    # scales loaded a step ahead in prefill tiles only (decode tiles measured 6x slower with it)
    assert prefill.PREFETCH_SCALES and not decode.PREFETCH_SCALES
    # 64-column decode tiles (the fastest measured at 1 and 32 tokens, for 4 experts and for one), narrower only
    # for a narrower weight
    assert decode.BLOCK_N == 64 and schedule(1, 1024, 6144, 1, False).BLOCK_N == 64
    assert schedule(1, 32, 64, 1, False).BLOCK_N == 32
    # grouped GEMM2 (MXFP8 x, decoded per tile): 128 columns, each x tile decoded for twice the outputs
    assert schedule(4, 6144, 3072, 129, False, x_mx=True).BLOCK_N == 128
    assert schedule(4, 6144, 3072, 1, False, x_mx=True).BLOCK_N == 64
    assert schedule(None, 6144, 6144, 128, False).BLOCK_M == 16
    # prefill: the dequantized weight as the dot's register operand; GEMM2 one 8-warp tile capped at 128 registers
    # for every prefill size (two programs per SM), its 128 rows dividing both align layouts
    assert prefill.SWAP_AB and not decode.SWAP_AB
    gemm2 = {schedule(rows, 6144, 3072, 128, False, x_mx=True) for rows in (8192, 16384, 32768)}
    assert len(gemm2) == 1 and (gemm2.pop().BLOCK_M, decode.maxnreg, prefill.maxnreg) == (128, None, None)
    assert isinstance(schedule(4, 64, 64, 8, True), GemmConfig)
    # the one-expert linear splits k until its grid fills 3 programs per SM (132 SMs): qkv and o at one token; never
    # a grouped GEMM, a prefill-sized linear or a device of unknown size
    assert schedule(1, 9856, 6144, 1, False, sms=132).SPLIT_K == 3
    assert schedule(None, 6144, 8192, 1, False, sms=132).SPLIT_K == 5
    assert schedule(32, 9856, 6144, 1, False, sms=132).SPLIT_K == 2
    assert schedule(4, 6144, 6144, 128, False, sms=132).SPLIT_K == 1
    assert schedule(8192, 9856, 6144, 1, False, sms=132).SPLIT_K == 1
    assert schedule(1, 9856, 6144, 1, False).SPLIT_K == 1
    # no split for a grouped launch over one group, and none for zero rows
    assert schedule(1, 9856, 6144, 1, False, sms=132, splittable=False).SPLIT_K == 1
    assert schedule(0, 9856, 6144, 1, False, sms=132).SPLIT_K == 3
    # fp32 x: the prefill tiles keep their shape and drop stages to fit shared memory
    for rows in (16384, 32768):
        wide, bf16 = schedule(rows, 6144, 6144, 128, False, x_bytes=4), schedule(rows, 6144, 6144, 128, False)
        assert (wide.BLOCK_M, wide.BLOCK_N, wide.BLOCK_K) == (bf16.BLOCK_M, bf16.BLOCK_N, bf16.BLOCK_K)
        assert 2 <= wide.num_stages < bf16.num_stages
    for tiles, steps in [(1, 1), (1, 7), (3, 24), (96, 32), (154, 24), (500, 3)]:
        split = split_k(1, tiles, steps, 132)
        per = -(-steps // split)
        assert 1 <= split <= steps and (split - 1) * per < steps  # no empty split
    # the bound: min(pairs, ceil((pairs + E*(BM-1)) / BM))
    assert num_blocks(4, 128, 16) == 4 and num_blocks(32768, 128, 128) == math.ceil((32768 + 128 * 127) / 128)


@pytest.mark.parametrize("case", ["random", "one_expert", "empty_experts"])
def test_align_groups_pairs_by_expert(case):
    T = 21
    ids = {"random": routes(T), "one_expert": torch.full((T, K_TOP), 3), "empty_experts": routes(T, experts=3) + 4}[
        case
    ]
    pairs, blocks = torch.ops.mm3.moe_align(ids, E, BLOCK_M)
    P = T * K_TOP
    nb = min(P, -(-(P + E * (BLOCK_M - 1)) // BLOCK_M))
    assert pairs.shape == (nb * BLOCK_M,) and blocks.shape == (nb,)
    flat = ids.flatten()
    got = pairs.view(nb, BLOCK_M)
    seen = []
    for b in range(nb):
        row = got[b][got[b] >= 0]
        if blocks[b] < 0:
            assert row.numel() == 0  # blocks past the last group are empty
            continue
        assert row.numel() > 0 and bool((flat[row.long()] == blocks[b]).all())
        assert bool((got[b][: row.numel()] >= 0).all())  # rows first, padding after
        seen += row.tolist()
    assert sorted(seen) == list(range(P))  # every pair exactly once
    used = [int(e) for e in blocks if e >= 0]
    assert used == sorted(used) and set(used) == set(flat.tolist())  # only experts that received pairs


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("T", [1, 19])  # one token; 38 pairs, not a multiple of the 16-row tile
def test_grouped_gemms_match_float64(target, T):
    v1, s1 = weights(target, (E, 2 * I, H), 1)
    v2, s2 = weights(target, (E, H, I), 2)
    assert v1.dtype == platform.mxfp8_value_dtype(torch.device("cpu")) or target == "gfx942"
    x = torch.randn(T, H).to(torch.bfloat16)
    ids = routes(T, T)
    w = torch.rand(T, K_TOP)
    with platform.emulate(target):
        pairs, blocks = torch.ops.mm3.moe_align(ids, E, BLOCK_M)
        g = torch.ops.mm3.mxfp8_grouped_gemm(x, v1, s1, pairs, blocks, BLOCK_M, K_TOP)
        act, act_s = torch.ops.mm3.swiglu_oai_mxfp8_quant(g, 1.702, 1.0, 7.0)
        y = torch.ops.mm3.mxfp8_grouped_gemm(act, v2, s2, pairs, blocks, BLOCK_M, 1, act_s, w.reshape(-1))
    assert g.dtype == torch.bfloat16 and y.dtype == torch.float32 and act.dtype == v1.dtype
    ulp = dict(rtol=2.0**-7, atol=1e-6)
    torch.testing.assert_close(g.double(), grouped_gemm_ref(x.double(), v1, s1, ids), **ulp)
    y_ref = grouped_gemm_ref(mx_dequantize_f64(act, act_s), v2, s2, ids)
    torch.testing.assert_close(y.double(), y_ref.to(torch.bfloat16).double() * w.reshape(-1, 1).double(), **ulp)


@pytest.mark.parametrize("target", TARGETS)
def test_linear_matches_float64(target):
    v, s = weights(target, (2 * I, H), 3)
    x = torch.randn(2, 3, H)
    with platform.emulate(target):
        y = torch.ops.mm3.mxfp8_linear(x.to(torch.bfloat16), v, s)
        y32 = torch.ops.mm3.mxfp8_linear(x, v, s)  # fp32 x: fp32 dot operands, fp32 out
    assert y.shape == (2, 3, 2 * I) and y.dtype == torch.bfloat16
    assert_bf16_close(y, mxfp8_linear_ref(x.to(torch.bfloat16), v, s))
    torch.testing.assert_close(y32.double(), mxfp8_linear_ref(x, v, s), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_logits_match_float64(dtype):
    """``mm3::router_logits`` (the weight as three bf16 pieces for bf16 x, the fp32 linear for fp32 x) against the
    float64 product: within ``2^-21`` (4.8e-7) of ``sum |x w|`` per logit, fp32 summation's bound at this width
    (measured max 2.6e-8 of it for bf16 x, 1.0e-7 for fp32 x; the H200's bound is in the GPU test below); 70
    tokens (two 64-token programs), 12 experts (a masked column tile), H 320 (a masked k step)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, 320, generator=g).to(dtype)
    w = torch.randn(12, 320, generator=g) / math.sqrt(320)
    w[3] *= 1e-30  # tiny weights: the small pieces stay normal in bf16 (it has fp32's exponent range)
    got = torch.ops.mm3.router_logits(x, w)
    ref = x.double() @ w.double().T
    bound = x.double().abs() @ w.double().abs().T
    assert got.dtype == torch.float32 and got.shape == (70, 12)
    assert bool(((got.double() - ref).abs() <= 2.0**-21 * bound).all())
    torch.testing.assert_close(torch.ops.mm3.router_logits(x[:1], w), got[:1])  # one token: the same sums


@pytest.mark.parametrize(("T", "k"), [(1, 3), (70, 3), (70, 8)])  # 70: two 64-token interpreter programs
def test_route_matches_the_reference(T, k):
    """``mm3::moe_route`` against the plain-PyTorch routing: the same experts in the same order (exact), weights
    within (k + 3) fp32 ulps relative (the sigmoid, the k-term sum in another order, the division and the scaling;
    measured at most 4.4 / 5.7 / 4.5 ulps for k = 3 / 5 / 8 over 8 seeds of E 5-128: the kernel's sigmoid is
    ``1 / (1 + exp(-x))``, torch's may differ by an ulp); ties go to the lower expert index and a NaN logit is
    routed first with NaN weights."""
    g = torch.Generator().manual_seed(T + k)
    logits, bias = torch.randn(T, 2 * E, generator=g) * 3, torch.randn(2 * E, generator=g) * 0.1
    ids, w = torch.ops.mm3.moe_route(logits, bias, k, 2.5)
    ref_ids, ref_w = route_ref(logits, bias, k, 2.5)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=(k + 3) * 2.0**-24, atol=0)
    tied = torch.zeros(2, 2 * E)
    tied[1, 5] = torch.nan
    ids, w = torch.ops.mm3.moe_route(tied, torch.zeros(2 * E), 3, 1.0)
    assert ids.tolist() == [[0, 1, 2], [5, 0, 1]] and torch.equal(
        ids.long(), route_ref(tied, torch.zeros(2 * E), 3, 1.0)[0]
    )
    assert torch.allclose(w[0], torch.full((3,), 1 / 3)) and bool(w[1].isnan().all())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("x_mx", [False, True])
def test_split_k_linear_matches_float64(target, x_mx, monkeypatch):
    """``SPLIT_K`` programs along k write fp32 partials that a second kernel adds in split order: the same linear
    (bf16 x, and the MXFP8 activation of GEMM2) within one bf16 ulp of the float64 reference, 1 and 19 rows, a
    last split shorter than the others (5 k steps over 3 splits), and deterministic (bit-identical reruns); past
    ``SPLIT_MAX_ROWS`` rows (8 here) the same config runs one split."""
    v, s = weights(target, (64, 5 * 32), 40)
    x = torch.randn(19, 5 * 32)
    with platform.emulate(target):
        fmt = platform.fp8_format(platform.mxfp8_value_dtype(x.device))
        config = dataclasses.replace(schedule(19, 64, 5 * 32, 1, True), BLOCK_K=32, SPLIT_K=3)
        for rows, max_rows in ((1, 256), (19, 256), (19, 8)):
            monkeypatch.setattr(gemm_kernels, "SPLIT_MAX_ROWS", max_rows)
            if x_mx:
                xq, xs = torch.ops.mm3.mxfp8_quantize(x[:rows])
                ref = mxfp8_linear_ref(mx_dequantize_f64(xq, xs), v, s)
                args = (xq, xs.view(torch.uint8))
            else:
                xb = x[:rows].to(torch.bfloat16)
                ref, args = mxfp8_linear_ref(xb, v, s), (xb, None)
            y = gemm_kernels.mxfp8_gemm(*args, v[None], s[None], fmt, config, torch.bfloat16)
            again = gemm_kernels.mxfp8_gemm(*args, v[None], s[None], fmt, config, torch.bfloat16)
            assert_bf16_close(y, ref)
            assert torch.equal(y, again)
        with pytest.raises(ValueError, match="SPLIT_K 6 leaves a split without k steps"):
            gemm_kernels.mxfp8_gemm(
                *args, v[None], s[None], fmt, dataclasses.replace(config, SPLIT_K=6), torch.bfloat16
            )


def test_split_count_reads_a_symbolic_row_count_without_guards():
    """Past ``SPLIT_MAX_ROWS`` rows a split config runs one split; under dynamic shapes that choice is an expression
    of the row count (traced at one token, it stays right at a prefill's size) and adds no guard."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    # a hint of 2: a symbol of hint 1 would be specialised to the constant (0/1 specialisation)
    rows = env.create_symintnode(env.create_symbol(2, ConstantSource("rows"), DimDynamic.DYNAMIC), hint=2)
    splits = gemm_kernels.splits_run(3, rows)
    assert not env.guards and isinstance(splits, torch.SymInt)
    symbol = rows.node.expr
    cap = gemm_kernels.SPLIT_MAX_ROWS
    assert [int(splits.node.expr.subs(symbol, n)) for n in (2, cap, cap + 1, 8192)] == [3, 3, 1, 1]
    assert [gemm_kernels.splits_run(3, n) for n in (0, 1, cap, cap + 1)] == [3, 3, 3, 1]


def two_gemms(target, T, seeds):
    """GEMM1 and GEMM2 weights of the tiny widths, T bf16 tokens and their top-K_TOP routes and weights."""
    v1, s1 = weights(target, (E, 2 * I, H), seeds[0])
    v2, s2 = weights(target, (E, H, I), seeds[1])
    x, ids, w = torch.randn(T, H).to(torch.bfloat16), routes(T, seeds[2]), torch.rand(T, K_TOP)
    return v1, s1, v2, s2, x, ids, w


@pytest.mark.parametrize("target", TARGETS)
def test_swapped_operand_order_matches_float64(target):
    """``SWAP_AB`` (out^T = W @ x^T, the weight as the dot's left operand) computes the same GEMMs. Its fp32 sums
    run in another order, so a near-tie may round to the other bf16 neighbour: within one bf16 ulp (``2^-7``
    relative; measured 3.95e-3 on one of 2432 GEMM1 outputs, the rest within half an ulp)."""
    v1, s1, v2, s2, x, ids, w = two_gemms(target, 19, (16, 17, 30))
    T = 19
    with platform.emulate(target):
        fmt = platform.fp8_format(platform.mxfp8_value_dtype(x.device))
        config = dataclasses.replace(schedule(T * K_TOP, 2 * I, H, E, True), BLOCK_M=BLOCK_M, SWAP_AB=True)
        pairs, blocks = torch.ops.mm3.moe_align(ids, E, BLOCK_M)
        g = gemm_kernels.mxfp8_gemm(x, None, v1, s1, fmt, config, torch.bfloat16, pairs, blocks, K_TOP)
        act, act_s = torch.ops.mm3.swiglu_oai_mxfp8_quant(g, 1.702, 1.0, 7.0)
        y = gemm_kernels.mxfp8_gemm(
            act, act_s.view(torch.uint8), v2, s2, fmt, config, torch.float32, pairs, blocks, 1, w.reshape(-1)
        )
    ulp = dict(rtol=2.0**-7, atol=1e-6)
    torch.testing.assert_close(g.double(), grouped_gemm_ref(x.double(), v1, s1, ids), **ulp)
    y_ref = grouped_gemm_ref(mx_dequantize_f64(act, act_s), v2, s2, ids)
    torch.testing.assert_close(y.double(), y_ref.to(torch.bfloat16).double() * w.reshape(-1, 1).double(), **ulp)


@pytest.mark.parametrize("target", TARGETS)
def test_scales_loaded_ahead_give_the_same_bits(target):
    """``PREFETCH_SCALES`` changes when the scale tiles are loaded, not what is computed: GEMM1, GEMM2 (MXFP8 x)
    (both with the weight as the left operand, like the prefill tiles) and the split-k linear are bit-identical
    with and without it, over several k steps, a partial last step (K = 5 x 32 with 64-wide steps) and an expert
    with no rows."""
    Kw = 5 * 32
    v1, s1 = weights(target, (E, 64, Kw), 21)
    T = 13
    x, ids, w = torch.randn(T, Kw).to(torch.bfloat16), routes(T, 22), torch.rand(T, K_TOP)
    ids[ids == 3] = 4  # expert 3 gets no rows
    with platform.emulate(target):
        fmt = platform.fp8_format(platform.mxfp8_value_dtype(x.device))
        pairs, blocks = torch.ops.mm3.moe_align(ids, E, BLOCK_M)
        a, a_s = torch.ops.mm3.mxfp8_quantize(torch.randn(T * K_TOP, Kw))
        outs = []
        for prefetch in (False, True):
            config = dataclasses.replace(
                schedule(T * K_TOP, 64, Kw, E, True),
                BLOCK_M=BLOCK_M,
                BLOCK_K=64,
                PREFETCH_SCALES=prefetch,
                SWAP_AB=True,  # as the prefill tiles run it
            )
            g1 = gemm_kernels.mxfp8_gemm(x, None, v1, s1, fmt, config, torch.bfloat16, pairs, blocks, K_TOP)
            g2 = gemm_kernels.mxfp8_gemm(
                a, a_s.view(torch.uint8), v1, s1, fmt, config, torch.float32, pairs, blocks, 1, w.reshape(-1)
            )
            split = dataclasses.replace(config, SPLIT_K=2, SWAP_AB=False)
            lin = gemm_kernels.mxfp8_gemm(x, None, v1[:1], s1[:1], fmt, split, torch.bfloat16)
            outs.append((g1, g2, lin))
    for off, on in zip(*outs):
        as_int = torch.int16 if off.element_size() == 2 else torch.int32
        assert torch.equal(off.view(as_int), on.view(as_int))
    torch.testing.assert_close(
        outs[0][0].double(), grouped_gemm_ref(x.double(), v1, s1, ids), rtol=BF16_RTOL, atol=1e-6
    )


def gemms_over_layout(inputs, gemm_weights, fmt, config, layout, top_k, pair_weights, shared=(None, None), tail=None):
    """GEMM1 (bf16 x) and GEMM2 (the MXFP8 activation, weighted) over one align layout ``(pairs, blocks, rows)``."""
    x, a, a_s = inputs
    v1, s1, v2, s2 = gemm_weights
    pairs, blocks, layout_m = layout
    g1 = gemm_kernels.mxfp8_gemm(
        x, None, v1, s1, fmt, config, torch.bfloat16, pairs, blocks, top_k, None, shared[0], layout_m, tail
    )
    g2 = gemm_kernels.mxfp8_gemm(
        a,
        a_s.view(torch.uint8),
        v2,
        s2,
        fmt,
        config,
        torch.float32,
        pairs,
        blocks,
        1,
        pair_weights,
        shared[1],
        layout_m,
        tail,
    )
    return g1, g2


@pytest.mark.parametrize("target", TARGETS)
def test_row_tile_narrower_than_the_layout_blocks(target):
    """A grouped GEMM over a layout aligned to 4x its row tile (each block as 4 tiles, the pad-only ones exiting)
    gives the same bits as tiles as wide as the blocks, for GEMM1 and GEMM2; a layout that is no multiple of the
    tile is refused."""
    T = 21
    v1, s1, v2, s2, x, ids, w = two_gemms(target, T, (23, 24, 25))
    with platform.emulate(target):
        fmt = platform.fp8_format(platform.mxfp8_value_dtype(x.device))
        pairs, blocks = torch.ops.mm3.moe_align(ids, E, 4 * BLOCK_M)
        a, a_s = torch.ops.mm3.mxfp8_quantize(torch.randn(T * K_TOP, I))
        outs = []
        for tile in (4 * BLOCK_M, BLOCK_M):
            config = dataclasses.replace(schedule(T * K_TOP, 2 * I, H, E, True), BLOCK_M=tile, SWAP_AB=True)
            outs.append(
                gemms_over_layout(
                    (x, a, a_s), (v1, s1, v2, s2), fmt, config, (pairs, blocks, 4 * BLOCK_M), K_TOP, w.reshape(-1)
                )
            )
        with pytest.raises(ValueError, match="layout_m"):
            gemm_kernels.mxfp8_gemm(x, None, v1, s1, fmt, config, torch.bfloat16, pairs, blocks, K_TOP, layout_m=24)
    assert all(torch.equal(wide, narrow) for wide, narrow in zip(*outs))
    assert_bf16_close(outs[1][0], grouped_gemm_ref(x.double(), v1, s1, ids))


@triton.jit
def _grouped_tiles_kernel(out_ptr, row_blocks, n_tiles, ROW_GROUP: tl.constexpr):
    pid = tl.program_id(0)
    b, n = gemm_kernels.grouped_tile(pid, row_blocks, n_tiles, ROW_GROUP)
    tl.store(out_ptr + 2 * pid, b)
    tl.store(out_ptr + 2 * pid + 1, n)


@pytest.mark.parametrize(("row_blocks", "n_tiles", "group"), [(7, 3, 1), (7, 3, 2), (7, 3, 3), (5, 4, 8), (6, 2, 3)])
def test_grouped_launch_order_covers_every_tile_once(row_blocks, n_tiles, group):
    """``ROW_GROUP``'s flat order: every (row block, column tile) exactly once; each group of ``group`` row blocks
    (the last one smaller when they do not divide) runs its tiles side by side, column tile after column tile."""
    out = torch.full((row_blocks * n_tiles, 2), -1, dtype=torch.int32)
    _grouped_tiles_kernel[(row_blocks * n_tiles,)](out, row_blocks, n_tiles, ROW_GROUP=group)
    expected = []
    for first in range(0, row_blocks, group):
        size = min(group, row_blocks - first)
        expected += [(first + i, n) for n in range(n_tiles) for i in range(size)]
    assert [tuple(p) for p in out.tolist()] == expected
    assert sorted(expected) == [(b, n) for b in range(row_blocks) for n in range(n_tiles)]


def test_pair_tiles_list_each_experts_blocks_in_pairs():
    """Random layouts (groups in expert order, unused blocks last): every used block is in exactly one listed tile,
    a double's two blocks belong to one expert, and the lists follow the blocks' order; compiled by Inductor with a
    symbolic block count (the prefill graphs trace it), the same lists from one graph."""
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        groups = int(torch.randint(1, 9, (1,), generator=g))
        counts = torch.randint(0, 5, (groups,), generator=g)
        unused = int(torch.randint(0, 4, (1,), generator=g))
        be = torch.cat([torch.arange(groups).repeat_interleave(counts), torch.full((unused,), -1)]).to(torch.int32)
        if be.numel() == 0:
            continue
        doubles, singles = gemm_kernels.pair_tiles(be, groups)
        assert doubles.shape == (be.numel() // 2,) and singles.shape == (min(be.numel(), groups),)
        expected_d, expected_s, b = [], [], 0
        for c in counts.tolist():
            expected_d += [b + 2 * j for j in range(c // 2)]
            expected_s += [b + c - 1] if c % 2 else []
            b += c
        assert doubles.tolist() == expected_d + [-1] * (doubles.numel() - len(expected_d))
        assert singles.tolist() == expected_s + [-1] * (singles.numel() - len(expected_s))
    # traced with a symbolic block count (a prefill graph of any token count): the same lists, one graph
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    traced = torch.compile(gemm_kernels.pair_tiles, backend=counter, dynamic=True, fullgraph=True)
    for nb in (7, 12, 30):
        be = torch.cat([torch.arange(5).repeat_interleave(nb // 5), torch.full((nb % 5,), -1)]).to(torch.int32)
        for got, want in zip(traced(be, 5), gemm_kernels.pair_tiles(be, 5)):
            assert torch.equal(got, want)
    assert counter.frame_count == 1


@pytest.mark.parametrize("target", TARGETS)
def test_paired_tiles_give_the_bits_of_block_wide_tiles(target):
    """Row tiles of two layout blocks (GEMM1's 256-row tile over the 128-row layout), with each expert's odd last
    block in a second launch, give the bits of tiles as wide as the blocks: experts of 3 blocks (and the shared
    expert's 3), 2 blocks, 1 block and none; GEMM2 too; launched in groups of row blocks (``ROW_GROUP``) too;
    through the op (block_m half the schedule's tile) as well."""
    T = 40
    v1, s1, v2, s2, x, _, w = two_gemms(target, T, (31, 32, 33))
    ids = torch.full((T, K_TOP), 5)
    ids[:, 0] = 0  # 40 pairs: 3 blocks of 16
    ids[:20, 1] = 1  # 20 pairs: 2 blocks
    ids[20, 1] = 2  # one pair
    sh1, sh1_s = weights(target, (1, 2 * I, H), 34)
    sh2, sh2_s = weights(target, (1, H, I), 35)
    with platform.emulate(target):
        fmt = platform.fp8_format(platform.mxfp8_value_dtype(x.device))
        shared = (sh1[0], sh1_s[0])
        full = torch.cat([ids, torch.full((T, 1), E)], 1)
        pairs, blocks = torch.ops.mm3.moe_align(full, E + 1, BLOCK_M)
        a, a_s = torch.ops.mm3.mxfp8_quantize(torch.randn(T * (K_TOP + 1), I))
        flat_w = torch.rand(T * (K_TOP + 1))
        outs = []
        # then the paired tiles launched in groups of 1 and 2 row blocks (ROW_GROUP; odd tile counts leave a last
        # group of one) over 16-column tiles, several per block
        for tile, group in ((BLOCK_M, 0), (2 * BLOCK_M, 0), (2 * BLOCK_M, 1), (2 * BLOCK_M, 2)):
            config = dataclasses.replace(schedule(T * 3, 2 * I, H, E, True), BLOCK_M=tile, SWAP_AB=True)
            if group:
                config = dataclasses.replace(config, BLOCK_N=16, ROW_GROUP=group)
            tail = dataclasses.replace(config, BLOCK_M=BLOCK_M)
            outs.append(
                gemms_over_layout(
                    (x, a, a_s),
                    (v1, s1, v2, s2),
                    fmt,
                    config,
                    (pairs, blocks, BLOCK_M),
                    K_TOP + 1,
                    flat_w,
                    (shared, (sh2[0], sh2_s[0])),
                    tail,
                )
            )
        assert gemm_kernels.pair_tiles(blocks, E + 1)[1].ge(0).sum() == 3  # experts 0, 2 and the shared one
        with pytest.raises(ValueError, match="tail_config"):
            gemm_kernels.mxfp8_gemm(
                x, None, v1, s1, fmt, config, torch.bfloat16, pairs, blocks, K_TOP + 1, None, shared, BLOCK_M, config
            )
        # the op: the interpreter's 64-row schedule over a 32-row layout runs paired
        pairs32, blocks32 = torch.ops.mm3.moe_align(ids, E, 2 * BLOCK_M)
        assert schedule(T * K_TOP, 2 * I, H, E, True).BLOCK_M == 4 * BLOCK_M
        op = torch.ops.mm3.mxfp8_grouped_gemm(x, v1, s1, pairs32, blocks32, 2 * BLOCK_M, K_TOP)
        plain = dataclasses.replace(schedule(T * K_TOP, 2 * I, H, E, True), BLOCK_M=2 * BLOCK_M)
        ref_op = gemm_kernels.mxfp8_gemm(x, None, v1, s1, fmt, plain, torch.bfloat16, pairs32, blocks32, K_TOP)
    assert all(torch.equal(a_, b_) for out in outs[1:] for a_, b_ in zip(outs[0], out))
    assert torch.equal(op, ref_op)
    assert_bf16_close(op, grouped_gemm_ref(x.double(), v1, s1, ids))


def test_nan_and_inf_rows_propagate_like_the_reference():
    v1, s1 = weights("sm_90", (E, 2 * I, H), 4)
    x = torch.randn(5, H).to(torch.bfloat16)
    x[1, 7] = float("nan")
    x[3, 0] = float("inf")
    ids = routes(5, 4)
    pairs, blocks = torch.ops.mm3.moe_align(ids, E, BLOCK_M)
    g = torch.ops.mm3.mxfp8_grouped_gemm(x, v1, s1, pairs, blocks, BLOCK_M, K_TOP)
    ref = grouped_gemm_ref(x.double(), v1, s1, ids)
    assert bool(g[2:4].isnan().all()) and bool(ref[2:4].isnan().all())  # token 1's pairs
    assert torch.equal(g.isnan(), ref.isnan()) and torch.equal(g.isinf(), ref.isinf())
    assert_bf16_close(g, ref)


def moe_reference(x, ids, w, v1, s1, v2, s2, fmt):
    """The routed MoE in float64 at the model's rounding points (bf16 GEMM outputs), reference quantizer."""
    gate_up = grouped_gemm_ref(x.double(), v1, s1, ids).to(torch.bfloat16)
    act_v, act_s = mxfp8_quantize_ref(swiglu_oai_ref(gate_up, 1.702, 1.0, 7.0), fmt)
    y = grouped_gemm_ref(mx_dequantize_f64(act_v, act_s), v2, s2, ids).to(torch.bfloat16).double()
    return (y.view(*ids.shape, -1) * w.double().unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("target", TARGETS)
def test_moe_experts_matches_float64_chain(target):
    v1, s1 = weights(target, (E, 2 * I, H), 5)
    v2, s2 = weights(target, (E, H, I), 6)
    T = 9
    x, ids, w = torch.randn(T, H).to(torch.bfloat16), routes(T, 9), torch.rand(T, K_TOP)
    with platform.emulate(target):
        out = torch.ops.mm3.moe_experts(x, ids, w, v1, s1, v2, s2, 1.702, 1.0, 7.0)
        fmt = platform.fp8_format(platform.mxfp8_value_dtype(x.device))
    ref = moe_reference(x, ids, w, v1, s1, v2, s2, fmt)
    assert out.shape == (T, H) and out.dtype == torch.float32
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err <= MOE_TOL, err


def with_shared(ids, w, v, s, sv, ss):
    """The shared expert as routed expert E with weight 1: the independent form of the folded launch."""
    T = ids.shape[0]
    ids = torch.cat([ids, torch.full((T, 1), v.shape[0], dtype=ids.dtype)], 1)
    w = torch.cat([w, torch.ones(T, 1)], 1)
    return ids, w, torch.cat([v, sv[None]]), torch.cat([s, ss[None]])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("T", [1, 19])
def test_shared_expert_in_the_routed_launch_matches_float64(target, T):
    v1, s1 = weights(target, (E, 2 * I, H), 12)
    v2, s2 = weights(target, (E, H, I), 13)
    sv1, ss1 = weights(target, (2 * I, H), 14)
    sv2, ss2 = weights(target, (H, I), 15)
    x, ids, w = torch.randn(T, H).to(torch.bfloat16), routes(T, 20 + T), torch.rand(T, K_TOP)
    all_ids, all_w, all_v1, all_s1 = with_shared(ids, w, v1, s1, sv1, ss1)
    _, _, all_v2, all_s2 = with_shared(ids, w, v2, s2, sv2, ss2)
    with platform.emulate(target):
        pairs, blocks = torch.ops.mm3.moe_align(all_ids, E + 1, BLOCK_M)
        g = torch.ops.mm3.mxfp8_grouped_gemm(x, v1, s1, pairs, blocks, BLOCK_M, K_TOP + 1, None, None, sv1, ss1)
        out = torch.ops.mm3.moe_experts(x, ids, w, v1, s1, v2, s2, 1.702, 1.0, 7.0, sv1, ss1, sv2, ss2)
        fmt = platform.fp8_format(platform.mxfp8_value_dtype(x.device))
    assert_bf16_close(g, grouped_gemm_ref(x.double(), all_v1, all_s1, all_ids))
    ref = moe_reference(x, all_ids, all_w, all_v1, all_s1, all_v2, all_s2, fmt)
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert out.shape == (T, H) and err <= MOE_TOL, err


def moe_caller(x, ids, w, v1, s1, v2, s2):
    return torch.ops.mm3.moe_experts(x * 1.5, ids, w, v1, s1, v2, s2, 1.702, 1.0, 7.0).sum(-1)


@mm3_compile.dynamic_shapes()
def test_compiled_fullgraph_matches_eager_without_recompiles():
    v1, s1 = weights("sm_90", (E, 2 * I, H), 7)
    v2, s2 = weights("sm_90", (E, H, I), 8)

    def inputs(T):
        return torch.randn(T, H).to(torch.bfloat16), routes(T, T), torch.rand(T, K_TOP), v1, s1, v2, s2

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(moe_caller)(*inputs(3))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(moe_caller, backend=counter, fullgraph=True, dynamic=True)
    compiled(*inputs(3))
    frames = counter.frame_count
    with torch.compiler.set_stance("fail_on_recompile"):
        for T in (1, 17):
            args = inputs(T)
            torch.testing.assert_close(compiled(*args), moe_caller(*args), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == frames == 1


def test_opcheck():
    v1, s1 = weights("sm_90", (E, 2 * I, H), 9)
    v2, s2 = weights("sm_90", (E, H, I), 10)
    x, ids = torch.randn(3, H).to(torch.bfloat16), routes(3, 3)
    pairs, blocks = torch.ops.mm3.moe_align(ids, E, BLOCK_M)
    torch.library.opcheck(torch.ops.mm3.moe_align.default, (ids, E, BLOCK_M))
    torch.library.opcheck(torch.ops.mm3.moe_route.default, (torch.randn(3, E), torch.randn(E), K_TOP, 2.0))
    torch.library.opcheck(torch.ops.mm3.router_logits.default, (x, torch.randn(E, H)))
    # typed FP8 weights: opcheck's schema check cannot compare FP8 tensors on the CPU (no mul kernel), the rest runs
    tests = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(
        torch.ops.mm3.mxfp8_grouped_gemm.default, (x, v1, s1, pairs, blocks, BLOCK_M, K_TOP), test_utils=tests
    )
    torch.library.opcheck(torch.ops.mm3.mxfp8_linear.default, (x, v2[0], s2[0]), test_utils=tests)
    torch.library.opcheck(
        torch.ops.mm3.moe_experts.default,
        (x, ids, torch.rand(3, K_TOP), v1, s1, v2, s2, 1.702, 1.0, 7.0),
        test_utils=tests,
    )


@pytest.mark.parametrize("fake", [False, True])
def test_bad_inputs_name_the_argument(fake):
    v1, s1 = weights("sm_90", (E, 2 * I, H), 11)
    x, ids = torch.randn(3, H).to(torch.bfloat16), routes(3, 3)
    pairs, blocks = torch.ops.mm3.moe_align(ids, E, BLOCK_M)
    cases = [
        (lambda: torch.ops.mm3.moe_align(ids.float(), E, BLOCK_M), TypeError, "ids"),
        (lambda: torch.ops.mm3.moe_align(ids, E, 24), ValueError, "block_m"),
        (
            lambda: torch.ops.mm3.mxfp8_grouped_gemm(x, v1.float(), s1, pairs, blocks, BLOCK_M, K_TOP),
            TypeError,
            "w_values",
        ),
        (
            lambda: torch.ops.mm3.mxfp8_grouped_gemm(x, v1, s1[..., :1], pairs, blocks, BLOCK_M, K_TOP),
            ValueError,
            "w_scales",
        ),
        (lambda: torch.ops.mm3.mxfp8_grouped_gemm(x[:, :32], v1, s1, pairs, blocks, BLOCK_M, K_TOP), ValueError, "x"),
        (
            lambda: torch.ops.mm3.mxfp8_grouped_gemm(x, v1, s1, pairs[:-1], blocks, BLOCK_M, K_TOP),
            ValueError,
            "sorted_pairs",
        ),
        (
            lambda: torch.ops.mm3.mxfp8_grouped_gemm(x, v1, s1, pairs, blocks, BLOCK_M, K_TOP, None, None, v1[0, :16]),
            ValueError,
            "shared_values / shared_scales",
        ),
        (
            lambda: torch.ops.mm3.mxfp8_grouped_gemm(
                x, v1, s1, pairs, blocks, BLOCK_M, K_TOP, None, None, v1[0, :16], s1[0, :16]
            ),
            ValueError,
            "shared_values",
        ),
        (
            lambda: torch.ops.mm3.moe_experts(x, ids, ids.float(), v1, s1, v1, s1, 1.702, 1.0, 7.0, v1[0], s1[0]),
            ValueError,
            "shared_gate_up_values / shared_down_values",
        ),
        (lambda: torch.ops.mm3.mxfp8_linear(x, v1[0], s1[0].T), ValueError, "scales"),
        (lambda: torch.ops.mm3.mxfp8_linear(x.int(), v1[0], s1[0]), TypeError, "x"),
        (lambda: torch.ops.mm3.moe_route(x, torch.zeros(H), 2, 1.0), TypeError, "logits"),
        (lambda: torch.ops.mm3.router_logits(x, torch.zeros(E, H, dtype=torch.bfloat16)), TypeError, "weight"),
        (lambda: torch.ops.mm3.router_logits(x[:, :32], torch.zeros(E, H)), ValueError, "x"),
        (lambda: torch.ops.mm3.moe_route(x.float(), torch.zeros(H + 1), 2, 1.0), ValueError, "correction_bias"),
        (lambda: torch.ops.mm3.moe_route(x.float(), torch.zeros(H), H + 1, 1.0), ValueError, "top_k"),
        (lambda: torch.ops.mm3.moe_route(x.float(), torch.zeros(H), 2, math.inf), ValueError, "scaling"),
    ]
    for call, error, name in cases:
        if fake:
            with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(error, match=rf"^{name}:"):
                call()
        else:
            with pytest.raises(error, match=rf"^{name}:"):
                call()
    if not fake:  # index values are checked on CPU tensors
        with pytest.raises(ValueError, match=r"^ids: expected expert ids in \[0, 8\)"):
            torch.ops.mm3.moe_align(ids + E, E, BLOCK_M)


@pytest.mark.gpu
def test_gpu_router_logits_at_the_m3_width_match_float64(device):
    """The split-bf16 kernel at a prefill's size (4096 tokens, H 6144, 128 experts; the decode sizes take the fp32
    linear) within ``2^-22`` (2.4e-7) of ``sum |x w|``: tensor cores add products without rounding to nearest, so
    each k step's dot is summed by the CUDA cores (H200: measured 3.2-3.9e-8 at 2048 and 8192 tokens; 8.1e-7 with
    one accumulating dot; cuBLAS's fp32 GEMM 7.2e-8)."""
    g = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(4096, 6144, generator=g, device=device).to(torch.bfloat16)
    w = torch.randn(128, 6144, generator=g, device=device) / math.sqrt(6144)
    got = torch.ops.mm3.router_logits(x, w)
    ref = x.double() @ w.double().T
    bound = x.double().abs() @ w.double().abs().T
    err = float(((got.double() - ref).abs() / bound).max())
    assert err <= 2.0**-22, err


@pytest.mark.gpu
def test_gpu_real_width_moe_matches_float64(device):
    """E 128, top-4, H 6144, I 3072 (the M3 config): the op vs the float64 chain on all pairs of 6 experts."""
    torch.manual_seed(0)
    E_, k_, H_, I_, T = 128, 4, 6144, 3072, 64
    v1, s1 = torch.ops.mm3.mxfp8_quantize(torch.randn(E_, 2 * I_, H_, device=device, dtype=torch.bfloat16) / H_**0.5)
    v2, s2 = torch.ops.mm3.mxfp8_quantize(torch.randn(E_, H_, I_, device=device, dtype=torch.bfloat16) / I_**0.5)
    s1, s2 = s1.view(torch.uint8), s2.view(torch.uint8)
    x = torch.randn(T, H_, device=device).to(torch.bfloat16)
    ids = torch.rand(T, E_, device=device).topk(k_, dim=-1).indices
    w = torch.rand(T, k_, device=device)
    out = torch.ops.mm3.moe_experts(x, ids, w, v1, s1, v2, s2, 1.702, 1.0, 7.0)
    fmt = platform.fp8_format(v1.dtype)
    keep = torch.isin(ids, ids.flatten().unique()[:6]).all(-1)  # tokens whose experts are all in the sample
    keep[0] = True
    sub = keep.nonzero().squeeze(1)
    ref = moe_reference(x[sub], ids[sub], w[sub], v1, s1, v2, s2, fmt)
    err = float((out[sub].double() - ref).abs().max() / ref.abs().max())
    assert err <= MOE_TOL, err
    ys = torch.ops.mm3.mxfp8_linear(x, v1[0], s1[0])
    # K = 6144 summed in fp32 in another order (tensor-core partial sums) moves outputs near 0 by more than the
    # CPU test's atol 1e-6: measured on the H200, 15 of 393216 outputs past it, the largest difference 1.9e-5;
    # allowed here: 2^-14 of max |ref| (ref ~ N(0, 1) per output)
    ref = mxfp8_linear_ref(x, v1[0], s1[0])
    torch.testing.assert_close(ys.double(), ref, rtol=BF16_RTOL, atol=2.0**-14 * float(ref.abs().max()))


SM90_COMPILE = """
import re, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mm3_compile import platform
from mm3_compile.kernels.fp8 import NATIVE_E4M3FN, FP8Launch
from mm3_compile.kernels.moe.gemm import _mxfp8_gemm_kernel as kernel
from mm3_compile.kernels.moe.schedule import schedule

fp8 = FP8Launch(platform.fp8_format(platform.FP8_E4M3_OCP), native_load=True, native_store=NATIVE_E4M3FN)  # sm_90
SM90_SHARED = 232448  # bytes of shared memory one program may use
for variant in sys.argv[1:]:  # one process for every variant: an interpreter start per variant cost ~8 s
    # the decode tile in both operand orders; GEMM2's prefill schedule (MXFP8 x, two tiles per layout block);
    # GEMM1's prefill schedules (256- and 128-row tiles) with fp32 x, the widest x tile; the split-k linear
    config = {
        "prefill": schedule(32768, 6144, 3072, 128, False, x_mx=True),
        "prefill_fp32": schedule(32768, 6144, 6144, 128, False, x_bytes=4),
        "mid_fp32": schedule(16384, 6144, 6144, 128, False, x_bytes=4),
        "paired": schedule(32768, 6144, 6144, 128, False),
    }.get(variant)
    SWAP = variant not in ("plain", "split")
    SPLIT = variant == "split"  # the one-token linear: bf16 x, plain rows, fp32 partials over 4 k splits
    FP32 = variant.endswith("fp32")
    PAIRED = variant == "paired"  # GEMM1's 256-row tile over two 128-row layout blocks, bf16 x
    X_MX = not SPLIT and not FP32 and not PAIRED
    consts = dict(
        GROUPED=not SPLIT, BLOCK_SPLIT=2 if variant == "prefill" else 1,
        TILE_BLOCKS=2 if PAIRED else 0, TOP_K=1, X_MX=X_MX, HAS_WEIGHTS=X_MX,
        HAS_SHARED=not SPLIT, ROUND_BF16=not FP32, INT_ROUND=False, BLOCK_M=config.BLOCK_M if config else 16,
        BLOCK_N=config.BLOCK_N if config else 32, SWAP_AB=SWAP, BLOCK_K=config.BLOCK_K if config else 128,
        SPLIT_K=4 if SPLIT else 1, K_ALIGN=16, PREFETCH_SCALES=config.PREFETCH_SCALES if config else False,
        ROW_GROUP=config.ROW_GROUP if config else 0,
        DOT_DTYPE=tl.float32 if FP32 else tl.bfloat16, MAXNREG=(config.maxnreg or 0) if config else 0,
        **fp8.constexprs(),
    )
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages) if config else dict(num_warps=4, num_stages=3)
    if config and config.maxnreg:
        options["maxnreg"] = config.maxnreg
    x_ptr = "*bf16" if SPLIT or PAIRED else "*fp32" if FP32 else "*fp8e4nv"
    pointers = (x_ptr, "*u8", "*fp8e4nv", "*u8", "*fp8e4nv", "*u8", "*fp32", "*i32", "*i32", "*i32", "*fp32")
    signature = dict(zip(kernel.arg_names, pointers + ("i32",) * 5))
    signature.update(dict.fromkeys(consts, "constexpr"))
    constexprs = {(kernel.arg_names.index(k),): v for k, v in consts.items()}
    # pointers 16-byte aligned, as the launcher specialises them: without it nothing is pipelined (a fraction of
    # the shared memory the launch needs)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    fits = "FITS" if compiled.metadata.shared <= SM90_SHARED else f"SHARED-{compiled.metadata.shared}"
    cap = re.search(r"\\.maxnreg (\\d+)", compiled.asm["ptx"])
    print(variant, "MMA" if "mma" in compiled.asm["ptx"] else "NO-MMA", fits, cap.group(1) if cap else "uncapped")
"""


def test_grouped_kernel_compiles_for_sm90_native_fp8():
    """The interpreter runs what the GPU compiler refuses (a module global read in a jit function, an int fill of
    a typed FP8 load, a pointer chosen at run time): compile the sm_90 typed-FP8 variant with the shared expert
    ahead of time, without a GPU, in a process with the interpreter off (Triton's CUDA backend and its ptxas
    only): the decode tile in both operand orders, GEMM2's prefill schedule, GEMM1's two prefill schedules with
    fp32 x (their stages cut to fit), GEMM1's 256-row tile over paired layout blocks and the split-k linear, each within sm_90's shared memory per program; GEMM2's
    prefill tile with its register cap in the PTX."""
    variants = ["plain", "swap", "prefill", "prefill_fp32", "mid_fp32", "paired", "split"]
    proc = run_python(SM90_COMPILE, *variants, env_drop=("TRITON_INTERPRET",))
    if proc.returncode != 0 and ("ptxas" in proc.stderr.lower() or "GPUTarget" in proc.stderr):
        pytest.skip("no Triton CUDA backend to compile with: " + proc.stderr[-200:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a tensor-core dot on the dequantized tiles of every variant but fp32 x (exact fp32 dots, no tensor cores)
    dots = ["NO-MMA" if v.endswith("fp32") else "MMA" for v in variants]
    caps = ["128" if v == "prefill" else "uncapped" for v in variants]
    expected = [word for v, dot, cap in zip(variants, dots, caps) for word in (v, dot, "FITS", cap)]
    assert proc.stdout.split() == expected, proc.stdout
