"""Edge cases of the attention kernels: extreme scales and logits, long lists, concurrency, PDL, bf16 subnormals."""

import dataclasses

import pytest
import torch
import triton

from mm3_compile import platform
from mm3_compile.kernels.sparse_attn import decode as decode_kernels
from mm3_compile.kernels.sparse_attn import prefill, union
from mm3_compile.kernels.sparse_attn.naive import sparse_attn_decode_ref
from mm3_compile.ops._kv import resolve_cache_view
from tests.sparse_attn.helpers import OP_SCHEDULES, SCHEDULES, assert_close, build, fill_cache


def _run_path(path, case, monkeypatch):
    """Prefill (forced schedule), decode through the op, or decode forced to 3 splits."""
    if path == "split_decode":
        return case.split_decode(3)
    if path == "decode":
        return torch.ops.mm3.sparse_attn_decode(*case.decode_args())
    monkeypatch.setattr(prefill, "prefill_schedule", lambda *args: path)
    return torch.ops.mm3.sparse_attn_prefill(*case.prefill_args())


ALL_PATHS = ["kv_centric", "union", "decode", "split_decode"]


def test_decode_lists_longer_than_the_repeat_matrix(device):
    """Dense layers decode with every block of the table as their list: past 1024 slots the [T, T]
    repeat matrix would exceed Triton's tensor limit, and the kernel reads the list slot by slot."""
    case = build(device, [(300, 1), (0, 1), (700, 1)], D=64, Hkv=2, G=2, T=4, seed=5)
    dense = torch.arange(1025, dtype=torch.int32, device=device)  # ids past the table or p // 128 are skipped
    case = dataclasses.replace(case, topk_idx=dense.expand(2, 3, 1025))
    out = torch.ops.mm3.sparse_attn_decode(*case.decode_args())
    ref = sparse_attn_decode_ref(*case.decode_args()[:6], case.storage_dtype)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.interpreter  # a compiled kernel keeps the constexpr it was built with
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_long_list_path(num_splits, device, monkeypatch):
    """The slot-by-slot path for long lists, forced on short ones: invalid ids, repeats (the first
    occurrence counts), a row with no valid slot, any split count, as the reference."""
    monkeypatch.setenv("MM3_VALIDATE", "0")
    monkeypatch.setattr(union, "MATRIX_DEDUP_SLOTS", triton.language.constexpr(2))
    case = build(device, [(300, 1), (260, 1), (390, 1)], D=64, Hkv=2, G=2, corrupt=True, seed=3)
    out = case.split_decode(num_splits)
    assert (out[0, :2] == 0).all()  # token 0, KV head 0: every slot invalid
    assert_close(out, sparse_attn_decode_ref(*case.decode_args()[:6], case.storage_dtype), torch.bfloat16)


@pytest.mark.interpreter  # a compiled kernel keeps the constexpr it was built with
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_table_row_and_gathered_pages_agree(num_splits, device, monkeypatch):
    """One-token decode picks its pages from the request's whole table row (``TABLE_ROW``); wider or symbolic
    tables gather the listed entries.  On a truncated table whose hidden columns hold real pages, pages outside
    the cache, -1 entries and junk ids, both give the same bits, and the reference's output."""
    monkeypatch.setenv("MM3_VALIDATE", "0")
    case = build(device, [(650, 1), (260, 1), (390, 1)], D=64, Hkv=2, G=2, corrupt=True, seed=3)
    assert union.table_row(case.block_table.shape[1], True) == 8  # 5 columns: entries 5-7 (real pages) masked
    row = case.split_decode(num_splits)
    monkeypatch.setattr(union, "table_row", lambda max_blocks, one_token_decode: 0)
    gathered = case.split_decode(num_splits)
    assert torch.equal(row, gathered)
    assert_close(row, sparse_attn_decode_ref(*case.decode_args()[:6], case.storage_dtype), torch.bfloat16)


@pytest.mark.parametrize(
    "spec, scale, num_splits",
    [("auto", "none", 2), ("auto", "none", 4), ("fp8", "scalar", 3), ("fp8", "per_token_head", 4), ("fp8", "none", 4)],
)
def test_dependent_merge_gives_the_last_arrivals_bits(spec, scale, num_splits, device, monkeypatch):
    """Split decode merged by ``split_merge_kernel`` after the attention grid (small grids under PDL, and in the
    interpreter) gives the bits of the last arrival's merge, with NaN rows (huge logits), a request with no key
    and FP8 scales (the scalar v_scale on the merged row); both are the reference's on the other rows."""
    with platform.emulate("sm_90"):
        case = build(device, [(700, 1), (0, 1)], D=64, Hkv=2, G=4, T=4, spec=spec, scale=scale, seed=23)
        q = case.q.clone()
        q[0, 1] *= 1e9  # logits ~ 1e9: a NaN row
        case = dataclasses.replace(case, q=q)
        launched = []
        launch = union.launch
        monkeypatch.setattr(
            union, "launch", lambda kernel, *a, **kw: launched.append(kernel) or launch(kernel, *a, **kw)
        )
        scale_mode = 0 if scale == "none" else 1 if scale == "scalar" else 2
        dependent = case.split_decode(num_splits, scale_mode=scale_mode, dependent_merge=True)
        assert launched == [union.sparse_attn_fwd_kernel, union.split_merge_kernel]  # B2 x 2 KV heads: 4 tiles
        last = case.split_decode(num_splits, scale_mode=scale_mode, dependent_merge=False)
        assert launched[2:] == [union.sparse_attn_fwd_kernel]
    assert torch.equal(dependent.view(torch.uint8), last.view(torch.uint8))
    assert dependent[0, 1].isnan().all() and not dependent[0, 2:].isnan().any()
    assert (dependent[1] == 0).all()  # no key: zeros
    ref = sparse_attn_decode_ref(*case.decode_args()[:6], case.storage_dtype, case.k_scale, case.v_scale)
    assert_close(dependent[0, 2:], ref[0, 2:], torch.bfloat16)  # the reference decodes the FP8 cache itself


@pytest.mark.parametrize("tiles, merges_last", [(1, 0), (4, 0), (5, 1), (32, 1)])
def test_dependent_merge_plan_is_a_value_of_the_grid(tiles, merges_last):
    """``last_merges`` comes from the grid's tile count (a symbolic count gives a symbolic value, no guard): the
    dependent merge up to ``DEPENDENT_MERGE_MAX_TILES`` tiles, whose merge grid is then nonzero, else zero."""
    from mm3_compile.kernels.sparse_attn import schedule

    assert schedule.merge_plan(tiles) == merges_last
    shape_env = torch.fx.experimental.symbolic_shapes.ShapeEnv()
    symbolic = shape_env.create_unbacked_symint()
    assert isinstance(schedule.merge_plan(symbolic * 2), torch.SymInt)
    assert not shape_env.guards


@pytest.mark.interpreter
def test_concurrent_decode_calls_from_threads(device):
    """Split decode calls issued from several Python threads at once (the interpreter runs each call's
    programs on its thread, interleaved) each merge their own partials: every output is its reference."""
    import threading

    case = build(device, [(300, 1), (200, 1)], D=64, Hkv=1, G=2, T=4, seed=21)
    assert decode_kernels.split_plan(2, 1, 4, device)[0] > 1  # the merge (and its counters) is exercised
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    queries = [torch.randn(case.q.shape, generator=g).to(case.q.dtype) for g in gens]
    outs = [None] * len(queries)
    start = threading.Barrier(len(queries))

    def worker(i):
        start.wait()
        outs[i] = torch.ops.mm3.sparse_attn_decode(queries[i], *case.decode_args()[1:])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(queries))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for q, out in zip(queries, outs):
        ref = sparse_attn_decode_ref(q, *case.decode_args()[1:6], case.storage_dtype)
        assert_close(out, ref, torch.bfloat16, "thread")


@OP_SCHEDULES
@pytest.mark.parametrize("sm_scale", [0.0, -(128**-0.5)])
def test_zero_and_negative_softmax_scales(op, schedule, sm_scale, device):
    """Any finite sm_scale is the contract: 0 weights every visible key equally (the causal mask must
    still hold), a negative one favours the smallest logits (the KV-centric tile takes its max from
    the raw logits, so it flips K's sign instead)."""
    reqs = [(300, 6), (70, 3)] if op == "prefill" else [(260, 1), (129, 1), (700, 1)]
    case = dataclasses.replace(build(device, reqs, Hkv=2, G=2, seed=11), sm_scale=sm_scale)
    if op == "prefill":
        out, ref = torch.ops.mm3.sparse_attn_prefill(*case.prefill_args()), case.reference()
    else:
        out = torch.ops.mm3.sparse_attn_decode(*case.decode_args())
        ref = sparse_attn_decode_ref(*case.decode_args()[:6], case.storage_dtype, case.k_scale, case.v_scale)
    assert_close(out, ref, torch.bfloat16, f"{op}, sm_scale {sm_scale}")


@OP_SCHEDULES
@pytest.mark.parametrize("q_factor", [2.0**20, 2.0**-66, 2.0**115, 2.0**-120])
def test_fp8_queries_outside_fp16_range(op, schedule, q_factor, device):
    """FP8 attention runs its dots on fp16 operands: queries far beyond fp16's range (which would overflow)
    or below its normal range (which would flush) are rescaled by a power of two per row, so with
    ``sm_scale`` compensating, the logits and the output match the reference."""
    reqs = [(300, 6), (70, 3)] if op == "prefill" else [(260, 1), (129, 1), (700, 1)]
    with platform.emulate("sm_90"):
        case = build(device, reqs, spec="fp8", scale="scalar", Hkv=2, G=2)
        case = dataclasses.replace(case, q=case.q * q_factor, sm_scale=case.sm_scale / q_factor)
        if op == "prefill":
            out = torch.ops.mm3.sparse_attn_prefill(*case.prefill_args())
            ref = case.reference()
        else:
            out = torch.ops.mm3.sparse_attn_decode(*case.decode_args())
            ref = sparse_attn_decode_ref(*case.decode_args()[:6], case.storage_dtype, case.k_scale, case.v_scale)
    assert_close(out, ref, torch.bfloat16, f"{op}, q x {q_factor}")


@OP_SCHEDULES
def test_logits_beyond_float32_are_nan_never_dropped(op, schedule, device):
    """Logits are fp32 (the contract): rows whose sm_scale * q.k passes fp32 come out NaN in every
    schedule, never as a finite answer without the overflowing block (the KV-centric tile turns rows
    NaN from |logit| * log2(e) >= 2^28 on, see ``_attend_tile``); rows with q = 0 (logits 0) stay exact.
    A row whose every logit overflows to -inf cannot be told from a masked one and would come out 0."""
    reqs = [(300, 6), (70, 3)] if op == "prefill" else [(260, 1), (129, 1), (700, 1)]
    case = build(device, reqs, Hkv=2, G=2, seed=2)
    q = case.q * 0.05
    q[:, 1::2] = 0  # odd heads: logits 0, uniform weights
    case = dataclasses.replace(case, q=q, sm_scale=2.0e38)  # even heads: logits up to ~1.5 x 2e38
    if op == "prefill":
        out, ref = torch.ops.mm3.sparse_attn_prefill(*case.prefill_args()), case.reference()
    else:
        out = torch.ops.mm3.sparse_attn_decode(*case.decode_args())
        ref = sparse_attn_decode_ref(*case.decode_args()[:6], case.storage_dtype, case.k_scale, case.v_scale)
    nan_rows = out.isnan().any(-1)  # [total_q, Hq]
    exact = ~nan_rows & ref.isfinite().all(-1)
    assert nan_rows.any() and exact.any(), "the case should mix overflowing and fitting rows"
    assert_close(out[exact], ref[exact], torch.bfloat16, f"{op}: rows without overflow")
    assert (nan_rows | exact).all(), f"{op}: a row is neither NaN nor the reference"


@SCHEDULES
@pytest.mark.parametrize("k_scale, v_scale", [(8192.0, 1.0), (1.0, 4096.0)])
def test_prefill_fp8_large_scales_with_an_fp16_model(schedule, k_scale, v_scale, device):
    """An fp16 model over an FP8 cache with scalar scales: scaled K/V beyond fp16's range (the values
    are never dequantised to fp16 with their scales) give the reference's logits and output."""
    with platform.emulate("sm_90"):
        case = build(
            device, [(300, 6), (70, 3)], Hkv=2, G=2, spec="fp8", scale="scalar", model_dtype=torch.float16, seed=4
        )
        case = dataclasses.replace(
            case,
            k_scale=torch.tensor([k_scale], device=device),
            v_scale=torch.tensor([v_scale], device=device),
            sm_scale=case.sm_scale / k_scale,
        )
        out = torch.ops.mm3.sparse_attn_prefill(*case.prefill_args())
        ref = case.reference()
    assert out.isfinite().all() and ref.to(torch.float16).isfinite().all()
    unit = 0.25 / v_scale  # build() quantised V for v_scale 0.25: back to unit-sized outputs
    assert_close(out * unit, ref * unit, torch.float16, f"k_scale {k_scale}, v_scale {v_scale}")


@OP_SCHEDULES
def test_fp8_logit_factor_beyond_fp32_on_the_way(op, schedule, device):
    """sm_scale * k_scale may pass fp32 when the per-row power of two of a tiny q brings it back: the
    fp16-dot paths form the logit factor sm_scale * k_scale / 2^shift in fp64 (the logits are huge
    but finite, so the attention is one-hot and the reference's)."""
    reqs = [(300, 6), (70, 3)] if op == "prefill" else [(260, 1), (129, 1), (700, 1)]
    with platform.emulate("sm_90"):
        case = build(device, reqs, spec="fp8", scale="scalar", Hkv=2, G=2)
        case = dataclasses.replace(
            case, q=case.q * 2.0**-110, sm_scale=2.0**100, k_scale=torch.tensor([2.0**30], device=device)
        )
        if op == "prefill":
            out, ref = torch.ops.mm3.sparse_attn_prefill(*case.prefill_args()), case.reference()
        else:
            out = torch.ops.mm3.sparse_attn_decode(*case.decode_args())
            ref = sparse_attn_decode_ref(*case.decode_args()[:6], case.storage_dtype, case.k_scale, case.v_scale)
    assert_close(out, ref, torch.bfloat16, op)


@pytest.mark.parametrize("v_scale", [0.0, 2.0**-100, -0.75, 1.5 * 2.0**127])
def test_decode_fp8_v_scale_values(v_scale, device):
    """FP8 decode applies a scalar v_scale to its output instead of to V: zero, tiny, negative and
    near-maximal scales give the reference's result, overflowing only where the true output exceeds
    bf16's range."""
    with platform.emulate("sm_90"):
        case = build(device, [(260, 1), (129, 1), (700, 1)], spec="fp8", scale="scalar", Hkv=2, G=2)
        case = dataclasses.replace(case, v_scale=torch.tensor([v_scale], device=device))
        out = torch.ops.mm3.sparse_attn_decode(*case.decode_args())
    ref = sparse_attn_decode_ref(*case.decode_args()[:6], case.storage_dtype, case.k_scale, case.v_scale)
    if v_scale == 0.0:
        assert (out == 0).all()
        return
    finite = ref.to(torch.bfloat16).isfinite()
    assert torch.equal(out.isfinite(), finite), f"v_scale {v_scale}: overflow pattern differs"
    unit = lambda t: torch.where(finite, t.double() / v_scale, 0.0).to(torch.bfloat16)  # noqa: E731
    assert_close(unit(out), unit(ref), torch.bfloat16, f"v_scale {v_scale}")


@pytest.mark.gpu
@pytest.mark.parametrize("Hq, Hkv, q_per_req, block_q", [(64, 4, 1, 1), (8, 1, 1, 1), (8, 1, 2, 2)])
def test_gpu_decode_merge_across_calls_streams_and_graphs(Hq, Hkv, q_per_req, block_q, device):
    """The one-launch merge on the GPU: back-to-back calls with new queries, a side stream, a CUDA graph
    captured with the shared counters and replayed on new inputs, and a grid past the shared buffer all
    match the reference, and leave the shared counters at zero."""
    reqs = [(int(s), q_per_req) for s in torch.randint(q_per_req, 5000, (32 // q_per_req,)).tolist()]
    case = build(device, reqs, D=128, Hkv=Hkv, G=Hq // Hkv, T=16, seed=3)
    view, fmt = resolve_cache_view(case.kv_cache, case.kv_cache_dtype, case.q.dtype)

    def run(q, num_splits=None):
        return decode_kernels.sparse_attn_decode(
            q,
            view,
            fmt,
            case.topk_idx,
            case.block_table,
            case.seq_lens,
            case.sm_scale,
            None,
            None,
            0,
            num_splits=num_splits,
            block_q=block_q,
        )

    def check(out, q, what):
        ref = sparse_attn_decode_ref(q, *case.decode_args()[1:6], case.storage_dtype)
        assert_close(out, ref, torch.bfloat16, what)

    queries = [torch.randn_like(case.q) for _ in range(6)]
    outs = [run(q, 8) for q in queries]  # back to back, no sync in between
    for i, (q, out) in enumerate(zip(queries, outs)):
        check(out, q, f"call {i}")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = run(queries[0], 8)
    torch.cuda.current_stream().wait_stream(side)
    check(out, queries[0], "side stream")
    static_q = queries[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run(static_q, 8)
    for q in queries[1:4]:
        static_q.copy_(q)
        graph.replay()
        check(static_out, q, "graph replay")
    # A grid with more (token, KV head) tiles than the shared buffer has counters gets fresh ones;
    # compared with the unsplit kernel (checked against the reference by the tests above).
    big = build(
        device, [(300, 1)] * (decode_kernels.ARRIVAL_COUNTERS // Hkv + 1), D=128, Hkv=Hkv, G=Hq // Hkv, T=16, seed=4
    )
    big_view, _ = resolve_cache_view(big.kv_cache, big.kv_cache_dtype, big.q.dtype)
    split, whole = (
        decode_kernels.sparse_attn_decode(
            big.q,
            big_view,
            None,
            big.topk_idx,
            big.block_table,
            big.seq_lens,
            big.sm_scale,
            None,
            None,
            0,
            num_splits=n,
        )
        for n in (2, 1)
    )
    assert_close(split, whole, torch.bfloat16, "grid past the shared counters")
    torch.cuda.synchronize()
    assert not decode_kernels._arrival_counters(1, case.q).any()


def test_huge_logits_give_the_same_rows_in_every_schedule(device, monkeypatch):
    """A row with a block whose max |sm_scale * log2(e) * q.k| is >= 2^28 (bf16 q ~ 1e9
    against N(0, 1) keys) is NaN in every schedule (``jit.HUGE_LOGIT``); rows with logits up to ~1e6
    are the reference's, in every schedule."""
    case = build(device, [(300, 1), (200, 1), (390, 1)], D=64, Hkv=1, G=4, T=4, seed=17)
    q = case.q.clone()
    q[:, 0] *= 1e9  # logits ~ 1e9: NaN
    q[:, 1] *= -1e9  # every logit hugely negative except by chance: its block maxima too
    q[:, 2] *= 1e6  # ~ 1e6: computed (one-hot-like)
    case = dataclasses.replace(case, q=q)
    ref = case.reference()
    patterns = {}
    for path in ALL_PATHS:
        out = _run_path(path, case, monkeypatch)
        nan_rows = out.isnan().any(-1)
        assert nan_rows[:, :2].all() and not nan_rows[:, 2:].any(), f"{path}: NaN rows {nan_rows.tolist()}"
        assert_close(out[:, 2:], ref[:, 2:], torch.bfloat16, path)
        patterns[path] = nan_rows
    assert all(torch.equal(p, patterns["union"]) for p in patterns.values())


@pytest.mark.parametrize("tiny", ["q", "k", "v"])
def test_bf16_subnormal_inputs(tiny, device, monkeypatch):
    """bf16 subnormal q, K or V (|x| ~ 2^-128; the interpreter's own widening turns
    3 * 2^-133 into 2^-127) are read exactly in every schedule: with sm_scale (q, K) or the output
    (V) scaled back by the same power of two, the reference's result."""
    case = build(device, [(300, 3), (140, 2)], D=64, Hkv=1, G=2, T=4, seed=19)
    factor = 2.0**-128
    if tiny == "q":
        tiny_q = (case.q.double() * factor).to(torch.bfloat16)
        case = dataclasses.replace(case, q=tiny_q, sm_scale=case.sm_scale / factor)
    else:
        values = case.values.clone()
        half = slice(0, 64) if tiny == "k" else slice(64, 128)
        values[..., half] *= factor
        case = dataclasses.replace(case, kv_cache=fill_cache(values, torch.bfloat16, float("nan"), "HND"))
        if tiny == "k":
            case = dataclasses.replace(case, sm_scale=case.sm_scale / factor)
    sub = case.q if tiny == "q" else case.kv_cache[..., half]
    assert (sub.abs() < torch.finfo(torch.bfloat16).tiny).float().mean() > 0.5  # mostly subnormal
    unit = 1 / factor if tiny == "v" else 1.0
    ref = case.reference().double() * unit
    for path in ALL_PATHS:
        if path.endswith("decode"):
            reqs = [(300, 1), (140, 1)]
            last = [2, 4]  # each request's last token, as a one-token decode step
            dcase = dataclasses.replace(
                case,
                q=case.q[last],
                topk_idx=case.topk_idx[:, last],
                cu_seqlens_q=case.cu_seqlens_q.new_tensor([0, 1, 2]),
            )
            dcase.seq_lens = torch.tensor([s for s, _ in reqs], dtype=torch.int32, device=device)
            dref = dcase.reference().double() * unit
            out = _run_path(path, dcase, monkeypatch)
            got, expected = out.double() * unit, dref
        else:
            got, expected = _run_path(path, case, monkeypatch).double() * unit, ref
        # V tiny: the output's bf16 subnormals keep only a few bits (quantum 2^-133 = 2^-5 after scaling)
        if tiny == "v":
            err = (got - expected).abs()
            assert err.max() <= 2.0**-5 and err.mean() < 2.0**-6, f"{path}: max {err.max():.3g} mean {err.mean():.3g}"
        else:
            assert_close(got.to(torch.bfloat16), expected, torch.bfloat16, f"{path}, tiny {tiny}")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["auto", "fp8"])
def test_gpu_decode_with_and_without_pdl(spec, device, monkeypatch):
    """Decode launched with programmatic dependent launch (sm_90) gives the bits of the plain launch,
    eagerly back to back (each call's inputs written by the kernel just before it) and replayed in a
    CUDA graph, and matches the reference."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    case = build(
        device,
        [(4000, 1), (300, 1), (2000, 1)],
        D=128,
        Hkv=1,
        G=8,
        T=16,
        spec=spec,
        scale="scalar" if spec == "fp8" else "none",
        seed=23,
    )
    outs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("MM3_PDL", pdl)
        q = torch.empty_like(case.q)
        results = []
        for i in range(4):
            q.copy_(case.q * (1 + i))  # a copy kernel right before: the wait must order it
            results.append(torch.ops.mm3.sparse_attn_decode(q, *case.decode_args()[1:]))
        static_q = case.q.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_q.mul_(2)
            graph_out = torch.ops.mm3.sparse_attn_decode(static_q, *case.decode_args()[1:])
        static_q.copy_(case.q)
        graph.replay()
        torch.cuda.synchronize()
        outs[pdl] = results + [graph_out.clone()]
    for a, b in zip(outs["0"], outs["1"]):
        assert torch.equal(a, b)
    ref = sparse_attn_decode_ref(case.q * 2, *case.decode_args()[1:6], case.storage_dtype, case.k_scale, case.v_scale)
    assert_close(outs["1"][-1], ref, torch.bfloat16, f"PDL graph {spec}")
