"""mm3::index_topk against the float64 sort-based reference.

Most inputs are small integers: every dot product is then exact in fp32 whatever the summation
order, so block scores tie exactly and often, and the index lists must match the reference
exactly -- order included, ties toward the lower block id.  Random-float inputs are compared
through the reference's scores (near-ties may legitimately swap).
"""

import dataclasses

import pytest
import torch

from mm3_compile.kernels.indexer.naive import index_block_scores_ref, index_topk_ref
from tests.python_process import run_python

PAGE = 128


def make_inputs(requests, num_heads, head_dim, device, dtype=torch.bfloat16, seed=0, integer=True):
    """requests: [(q_len, seq_len)] -> index_q, index_k_cache, block_table, cu_seqlens_q, seq_lens.

    Pages are shuffled over the cache; block-table entries past a request's blocks hold garbage
    (out-of-range page ids) that must never matter.
    """
    g = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in requests]
    seq_lens = [s for _, s in requests]
    blocks = [-(-s // PAGE) for s in seq_lens]
    max_blocks = max(blocks + [1]) + 1
    num_pages = sum(blocks) + 2
    pages = torch.randperm(num_pages, generator=g).to(torch.int32)
    block_table = torch.full((len(requests), max_blocks), 1 << 30, dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        block_table[r, :n] = pages[start : start + n]
        start += n
    total_q = sum(q_lens)
    if integer:
        index_q = torch.randint(-3, 4, (total_q, num_heads, head_dim), generator=g).to(dtype)
        index_k = torch.randint(-3, 4, (num_pages, PAGE, head_dim), generator=g).to(dtype)
    else:
        index_q = torch.randn(total_q, num_heads, head_dim, generator=g).to(dtype)
        index_k = torch.randn(num_pages, PAGE, head_dim, generator=g).to(dtype)
    cu_seqlens_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    tensors = (index_q, index_k, block_table, cu_seqlens_q, torch.tensor(seq_lens, dtype=torch.int32))
    return tuple(t.to(device) for t in tensors)


def check_exact(args, topk, init_blocks, local_blocks):
    out = torch.ops.mm3.index_topk(*args, topk, init_blocks, local_blocks)
    cpu_args = [t.cpu() for t in args]
    expected = index_topk_ref(*cpu_args, topk, init_blocks, local_blocks)
    assert out.dtype == torch.int32 and out.shape == expected.shape
    mismatch = (out.cpu() != expected).any(-1).nonzero()
    if mismatch.numel():
        h, t = mismatch[0].tolist()
        pytest.fail(
            f"{mismatch.shape[0]} rows differ; head {h} token {t}: {out[h, t].tolist()} vs {expected[h, t].tolist()}"
        )
    return out.cpu()


SCENARIOS = {
    # prefill: a long cached prefix with a few new tokens, a chunk straddling block boundaries, a short one
    "prefill_ragged": [(5, 1000), (73, 200), (2, 129)],
    "prefill_from_zero": [(130, 130), (40, 40)],
    "decode_q1": [(1, 700), (1, 0), (1, 128), (1, 129), (1, 1)],  # seq_len 0: CUDA-graph padding
    "decode_q4": [(4, 900), (4, 0), (4, 131), (4, 4)],
}
SETTINGS = [(16, 0, 1), (2, 0, 1), (3, 1, 2), (4, 2, 0)]  # (topk, init_blocks, local_blocks)


@pytest.mark.parametrize("topk, init_blocks, local_blocks", SETTINGS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_reference_exactly(scenario, topk, init_blocks, local_blocks, device):
    args = make_inputs(SCENARIOS[scenario], 2, 64, device, seed=len(scenario) + topk)
    out = check_exact(args, topk, init_blocks, local_blocks)
    # Independent of the reference: every row holds min(topk, nb) distinct visible ids, then -1.
    positions = torch.cat([p for p, _ in index_block_scores_ref(*[t.cpu() for t in args])])
    nb = torch.clamp(positions // PAGE + 1, min=0)
    for t, n in enumerate(nb.tolist()):
        keep = min(topk, n)
        for h in range(out.shape[0]):
            row = out[h, t].tolist()
            assert all(x == -1 for x in row[keep:]) and len(set(row[:keep])) == keep
            assert all(0 <= x < n for x in row[:keep])
            if local_blocks and not init_blocks and keep:
                assert row[0] == n - 1  # the own block is forced


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype, device):
    check_exact(make_inputs(SCENARIOS["prefill_ragged"], 2, 64, device, dtype=dtype, seed=3), 4, 0, 1)


@pytest.mark.parametrize("num_heads, head_dim", [(1, 16), (4, 128), (2, 48)])
def test_head_shapes(num_heads, head_dim, device):
    check_exact(make_inputs([(3, 600), (1, 300), (20, 20)], num_heads, head_dim, device, seed=head_dim), 3, 0, 1)


def test_identical_blocks_tie_toward_lower_id(device):
    """Identical pages: all full blocks score the same, so the order is own block, then 0, 1, 2, ..."""
    index_q, index_k, block_table, cu, seq_lens = make_inputs([(2, 1100), (1, 700)], 2, 64, device, seed=1)
    index_k = index_k[:1].expand_as(index_k).contiguous()
    out = check_exact((index_q, index_k, block_table, cu, seq_lens), 5, 0, 1)
    for t, own in enumerate([8, 8, 5]):
        assert out[:, t].tolist() == [[own, 0, 1, 2, 3]] * 2
    out = check_exact((index_q, index_k, block_table, cu, seq_lens), 4, 2, 1)
    assert out[:, 2].tolist() == [[0, 1, 5, 2]] * 2  # init blocks (1e30) above the local one (1e29)


def test_zero_scores_tie_across_signs(device):
    """A -0.0 block score ties with +0.0 ones: the lower id wins, whatever sign the dot produced."""
    index_q, index_k, block_table, cu, seq_lens = make_inputs([(1, 640)], 1, 16, device, seed=2)
    index_q = torch.full_like(index_q, -0.0)
    index_q[..., 0] = 1.0
    index_k = torch.zeros_like(index_k)
    index_k[block_table[0, 1].long(), :, 0] = -1.0  # block 1 scores -1
    index_k[block_table[0, 2].long(), :, 0] = -0.0  # block 2: every product -0.0; blocks 0 and 3: +0.0
    out = check_exact((index_q, index_k, block_table, cu, seq_lens), 5, 0, 1)
    assert out[0, 0].tolist() == [4, 0, 2, 3, 1]


def test_nan_scores_rank_last(device):
    """NaN block scores (a NaN key, or a NaN query) count as -1e30; ties among them go to the lower id."""
    index_q, index_k, block_table, cu, seq_lens = make_inputs([(3, 1000), (2, 300)], 2, 32, device, seed=4)
    index_k[block_table[0, 2].long(), 7, 3] = float("nan")  # block 2 of request 0 (visible to all its queries)
    index_k[block_table[0, 5].long(), 0, 0] = float("nan")
    index_q[3, 1, 0] = float("nan")  # token 3 (request 1), head 1: every block NaN
    out = check_exact((index_q, index_k, block_table, cu, seq_lens), 8, 0, 1)
    assert out[0, 0, -2:].tolist() == [2, 5] and out[1, 0, -2:].tolist() == [2, 5]
    assert out[1, 3].tolist() == [2, 0, 1, -1, -1, -1, -1, -1]
    check_exact((index_q, index_k, block_table, cu, seq_lens), 3, 1, 1)


def test_random_floats_select_top_scores(device):
    """Non-integer inputs: the kernel's picks must carry the reference's top scores (near-ties may swap)."""
    requests = [(6, 1200), (50, 180), (1, 900)]
    args = make_inputs(requests, 2, 128, device, seed=7, integer=False)
    topk = 6
    out = torch.ops.mm3.index_topk(*args, topk, 0, 1).cpu()
    cpu_args = [t.cpu() for t in args]
    expected = index_topk_ref(*cpu_args, topk, 0, 1)
    token = 0
    for positions, block_scores in index_block_scores_ref(*cpu_args):
        for i in range(positions.shape[0]):
            for h in range(out.shape[0]):
                got, want = out[h, token + i], expected[h, token + i]
                assert torch.equal(got < 0, want < 0) and got[0] == want[0]  # forced own block first
                picked = block_scores[h, i, got[1:][got[1:] >= 0].long()]
                best = block_scores[h, i, want[1:][want[1:] >= 0].long()]
                torch.testing.assert_close(picked, best, rtol=0, atol=1e-3)
        token += positions.shape[0]


def test_corrupt_metadata_stays_in_bounds(device, monkeypatch):
    """Page ids outside the cache and a cu_seqlens_q past total_q are masked: valid ids, no crash.

    With value checks off (the GPU default): the kernels alone must stay in bounds.  With them on
    (the CPU default) the same metadata is refused, naming the argument.
    """
    index_q, index_k, block_table, cu, seq_lens = make_inputs([(3, 700), (2, 300)], 2, 32, device, seed=9)
    block_table[0, 1], block_table[0, 3], block_table[1, 0] = -5, 1 << 30, index_k.shape[0]
    cu[-1] = cu[-1] + 50
    monkeypatch.setenv("MM3_VALIDATE", "1")
    with pytest.raises(ValueError, match="cu_seqlens_q: expected offsets from 0 to total_q=5"):
        torch.ops.mm3.index_topk(index_q, index_k, block_table, cu, seq_lens, 4, 0, 1)
    good_cu = cu.clone()
    good_cu[-1] -= 50
    with pytest.raises(ValueError, match="block_table: request 0, block 1 maps to page -5"):
        torch.ops.mm3.index_topk(index_q, index_k, block_table, good_cu, seq_lens, 4, 0, 1)
    monkeypatch.setenv("MM3_VALIDATE", "0")
    out = torch.ops.mm3.index_topk(index_q, index_k, block_table, cu, seq_lens, 4, 0, 1).cpu()
    assert out.shape == (2, 5, 4)
    # request 0 (tokens 0-2) sees 6 blocks, request 1 (tokens 3-4) 3: ids stay inside each request's blocks
    assert ((out >= -1) & (out < 6)).all() and (out[:, 3:] < 3).all()


def test_empty_batch(device):
    index_q = torch.zeros(0, 2, 64, dtype=torch.bfloat16, device=device)
    index_k = torch.zeros(2, 128, 64, dtype=torch.bfloat16, device=device)
    meta = [torch.zeros(shape, dtype=torch.int32, device=device) for shape in ((0, 3), (1,), (0,))]
    assert torch.ops.mm3.index_topk(index_q, index_k, *meta).shape == (2, 0, 16)


def test_opcheck(device):
    op = torch.ops.mm3.index_topk.default
    torch.library.opcheck(op, (*make_inputs(SCENARIOS["prefill_ragged"], 2, 64, device), 4, 0, 1))
    torch.library.opcheck(op, (*make_inputs(SCENARIOS["decode_q4"], 1, 32, device), 16, 1, 1))


def _bad(**overrides):
    def make(device):
        names = ("index_q", "index_k_cache", "block_table", "cu_seqlens_q", "seq_lens")
        args = dict(zip(names, make_inputs([(2, 200), (1, 50)], 2, 64, device)), topk=4, init_blocks=0, local_blocks=1)
        for name, f in overrides.items():
            args[name] = f(args[name]) if callable(f) else f
        return args

    return make


BAD_INPUTS = [
    (_bad(index_q=lambda t: t[:, 0]), ValueError, "index_q: expected a 3-D"),
    (_bad(index_q=lambda t: t.to(torch.int32)), TypeError, "index_q: expected dtype"),
    (_bad(index_q=lambda t: t[..., :8]), ValueError, "index head dim must be in"),
    (_bad(index_k_cache=lambda t: t.half()), TypeError, "index_k_cache: expected the dtype of index_q"),
    (_bad(index_k_cache=lambda t: t[:, :64]), ValueError, r"index_k_cache: expected shape \[num_blocks, 128"),
    (_bad(index_k_cache=lambda t: t[..., :32]), ValueError, r"index_k_cache: expected shape"),
    (_bad(index_k_cache=lambda t: t[0]), ValueError, "index_k_cache: expected a 3-D"),
    (_bad(block_table=lambda t: t.long()), TypeError, "block_table: expected dtype"),
    (_bad(block_table=lambda t: t[0]), ValueError, "block_table: expected a 2-D"),
    (_bad(cu_seqlens_q=lambda t: t.long()), TypeError, "cu_seqlens_q: expected dtype"),
    (_bad(cu_seqlens_q=lambda t: t[:-1]), ValueError, "cu_seqlens_q: expected num_reqs"),
    (_bad(seq_lens=lambda t: t.long()), TypeError, "seq_lens: expected dtype"),
    (_bad(seq_lens=lambda t: t[:1]), ValueError, "seq_lens: expected num_reqs"),
    (_bad(topk=0), ValueError, "topk: expected >= 1"),
    (_bad(local_blocks=-1), ValueError, "init_blocks/local_blocks"),
]


@pytest.mark.parametrize("make, error, match", BAD_INPUTS)
def test_bad_input(make, error, match, device):
    args = make(device)
    with pytest.raises(error, match=match):
        torch.ops.mm3.index_topk(**args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(error, match=match):  # the fake validates too
        torch.ops.mm3.index_topk(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("integer", [True, False])
def test_gpu_large(integer, device):
    """Hidx 4, 8 requests (prefill chunks with long prefixes and decode rows), up to 8k context, D 128."""
    requests = [(512, 8192), (1, 8000), (300, 300), (4, 4096), (1, 0), (129, 5000), (64, 2048), (2, 7777)]
    args = make_inputs(requests, 4, 128, device, seed=11, integer=integer)
    if integer:
        check_exact(args, 16, 0, 1)
        check_exact(args, 16, 1, 2)
        return
    out = torch.ops.mm3.index_topk(*args, 16, 0, 1).cpu()
    cpu_args = [t.cpu() for t in args]
    expected = index_topk_ref(*cpu_args, 16, 0, 1)
    assert torch.equal(out < 0, expected < 0) and torch.equal(out[..., 0], expected[..., 0])
    token = 0
    for positions, block_scores in index_block_scores_ref(*cpu_args):
        q_len = positions.shape[0]
        if block_scores.shape[-1] == 0:  # a padding request (seq_len 0): all -1, checked above
            token += q_len
            continue
        got = out[:, token : token + q_len, 1:].clamp(min=0).long()  # [Hidx, q_len, 15]
        want = expected[:, token : token + q_len, 1:].clamp(min=0).long()
        valid = expected[:, token : token + q_len, 1:] >= 0
        picked = torch.gather(block_scores, 2, got)[valid]
        best = torch.gather(block_scores, 2, want)[valid]
        torch.testing.assert_close(picked, best, rtol=0, atol=1e-2)
        token += q_len


@pytest.mark.gpu
@pytest.mark.parametrize("requests", [[(1, 4000), (1, 300), (1, 2000)], [(40, 2000), (1, 700)]])
def test_gpu_with_and_without_pdl(requests, device, monkeypatch):
    """Both kernels launched as programmatic dependent launches (sm_90) give the lists of plain launches:
    eagerly, each call's q written by the kernel right before it, and replayed in a CUDA graph."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    index_q, *rest = make_inputs(requests, 4, 128, device, seed=5)
    outs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("MM3_PDL", pdl)
        q = torch.empty_like(index_q)
        results = []
        for sign in (1, -1):
            q.copy_(index_q * sign)  # a copy kernel right before: the score kernel's wait must order it
            results.append(torch.ops.mm3.index_topk(q, *rest, 16, 0, 1))
        static_q = index_q.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_q.neg_()
            graph_out = torch.ops.mm3.index_topk(static_q, *rest, 16, 0, 1)
        static_q.copy_(index_q)
        graph.replay()
        torch.cuda.synchronize()
        outs[pdl] = results + [graph_out.clone()]
    for a, b in zip(outs["0"], outs["1"]):
        assert torch.equal(a, b)
    cpu_rest = [t.cpu() for t in rest]
    assert torch.equal(outs["1"][-1].cpu(), index_topk_ref(-index_q.cpu(), *cpu_rest, 16, 0, 1))


@pytest.mark.gpu
def test_gpu_launcher_traces_symbolically(device):
    """The launcher is make_fx-traceable with symbolic shapes (no host syncs, no data-dependent Python)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mm3_compile.kernels.indexer import topk as kernels

    args = make_inputs(SCENARIOS["prefill_ragged"], 2, 64, device)
    graph = make_fx(lambda *a: kernels.index_topk(*a, 4, 0, 1), tracing_mode="symbolic")(*args)
    code = graph.code
    assert (
        code.count("torch.ops.higher_order.triton_kernel_wrapper_mutation(") == 2
        and "item" not in code
        and "tolist" not in code
    )
    torch.testing.assert_close(graph(*args), torch.ops.mm3.index_topk(*args, 4, 0, 1), rtol=0, atol=0)


def test_compiled_caller_no_recompiles(device):
    """Batch size, token count and query lengths are data/symbolic sizes: varying them must not recompile."""
    import torch._dynamo.testing

    def select(index_q, index_k, block_table, cu_seqlens_q, seq_lens):
        return torch.ops.mm3.index_topk(index_q * 2, index_k, block_table, cu_seqlens_q, seq_lens, 4, 0, 1)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(select, backend=counter, fullgraph=True, dynamic=True)
    # The first batch has pairwise-distinct sizes (no duck-sizing equalities); none is 1 (0/1 specialisation).
    batches = [[(5, 300), (4, 200), (2, 650)], [(1, 700), (1, 0), (1, 129)], [(20, 400), (7, 7), (1, 900), (2, 260)]]
    compiled(*make_inputs(batches[0], 2, 32, device, seed=0))
    frames = counter.frame_count
    with torch.compiler.set_stance("fail_on_recompile"):
        for seed, requests in enumerate(batches[1:]):
            args = make_inputs(requests, 2, 32, device, seed=seed)
            assert torch.equal(compiled(*args), select(*args))
    assert counter.frame_count == frames


def test_forced_blocks_outrank_any_score(device):
    """Forced blocks come first whatever the scores: a key of 2^100 (or +inf) elsewhere does not outrank them."""
    index_q, index_k, block_table, cu, seq_lens = make_inputs([(1, 300), (1, 700)], 1, 16, device, seed=5)
    index_k = torch.zeros_like(index_k)
    index_q = torch.zeros_like(index_q)
    index_q[..., 0] = 1.0
    index_k[block_table[0, 0].long(), 3, 0] = 2.0**100  # request 0: block 0 scores 2^100, own block 2 scores 0
    index_k[block_table[1, 1].long(), 0, 0] = float("inf")  # request 1: block 1 scores +inf, own block 5
    index_k[block_table[1, 3].long(), 0, 0] = 2.0**100
    args = (index_q, index_k, block_table, cu, seq_lens)
    assert check_exact(args, 1, 0, 1)[0, :, 0].tolist() == [2, 5]
    assert check_exact(args, 3, 0, 1)[0].tolist() == [[2, 0, 1], [5, 1, 3]]
    # init block 0 first, then the two local blocks in ascending order, then by score
    assert check_exact(args, 4, 1, 2)[0].tolist() == [[0, 1, 2, -1], [0, 4, 5, 1]]


def test_bf16_subnormals_widen_exactly(device):
    """bf16 subnormal keys and queries rank by their exact values (the interpreter's own bf16 -> fp32
    conversion maps 2^-133 to 0 and 3*2^-133 to 2^-127)."""
    index_q, index_k, block_table, cu, seq_lens = make_inputs([(1, 640), (1, 512)], 1, 16, device, seed=6)
    tiny = 2.0**-133
    index_k = torch.zeros_like(index_k)
    index_q = torch.zeros_like(index_q)
    index_q[0, 0, 0] = 1.0
    for block, value in ((1, tiny), (2, 3 * tiny), (3, 2.0**-127)):  # request 0: 3 > 2 > 1 > 0 (block 0)
        index_k[block_table[0, block].long(), 5, 0] = value
    index_q[1, 0, 1] = tiny  # request 1: the query is subnormal
    for block, value in ((0, 1.0), (1, 3.0), (2, 2.0)):
        index_k[block_table[1, block].long(), 0, 1] = value
    assert index_k.dtype == torch.bfloat16 and float(index_k[block_table[0, 1].long(), 5, 0]) == tiny
    out = check_exact((index_q, index_k, block_table, cu, seq_lens), 5, 0, 1)
    assert out[0].tolist() == [[4, 3, 2, 1, 0], [3, 1, 2, 0, -1]]


SCHEDULES = [  # (block_t, chunks, keys_major, topk_rows, topk_block_n, topk_short_n): every path of both kernels
    (1, 3, False, 1, 16, 16),
    (2, 2, True, 4, 128, 16),  # the 2200-token request's 18 blocks take the wide register tile, the rest the short
    (4, 1, False, 16, 32, 64),  # short_n past block_n: the launcher clamps it
    (64, 5, True, 64, 16, 16),
]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_same_lists(schedule, device):
    """Split keys, query tiles of every size, both dot orientations, both register tiles and rescanning top-k."""
    from mm3_compile.kernels.indexer import topk as kernels

    block_t, chunks, keys_major, topk_rows, block_n, short_n = schedule
    sched = kernels.IndexSchedule(block_t, chunks, 4, 1, keys_major, topk_rows, block_n, 4, short_n)
    args = make_inputs([(3, 1000), (1, 0), (20, 200), (1, 2200)], 2, 32, device, seed=block_t)
    cpu_args = [t.cpu() for t in args]
    for topk, init_blocks, local_blocks in ((16, 0, 1), (3, 1, 2)):
        out = kernels.index_topk(*args, topk, init_blocks, local_blocks, schedule=sched)
        assert torch.equal(out.cpu(), index_topk_ref(*cpu_args, topk, init_blocks, local_blocks))


@pytest.mark.parametrize(
    "requests",
    [
        [(1, 1000), (1, 1), (1, 2200), (1, 300)],  # decode: token t is request t (the score kernel's guess)
        [(1, 1000), (0, 0), (1, 2200), (0, 5), (1, 300)],  # empty requests: the guess misses, the search finds it
    ],
)
@pytest.mark.parametrize("block_n", [16, 32])  # 18 blocks: past the preloaded tile (rescans) or within it
@pytest.mark.parametrize("chunks", [2, 19])  # 19: the table is 19 blocks wide, one block per chunk, its page read ahead
def test_decode_rows_same_lists(requests, block_n, chunks, device):
    """One-token tiles and one-row top-k programs (the decode schedule: guessed requests, preloaded scores, and
    with a grid as wide as the table each chunk's page loaded with the guessed request's metadata)."""
    from mm3_compile.kernels.indexer import topk as kernels

    sched = kernels.IndexSchedule(1, chunks, 4, 1, False, 1, block_n, 1, 16)
    args = make_inputs(requests, 4, 32, device, seed=block_n)
    cpu_args = [t.cpu() for t in args]
    for topk, init_blocks, local_blocks in ((16, 0, 1), (3, 1, 2)):
        out = kernels.index_topk(*args, topk, init_blocks, local_blocks, schedule=sched)
        assert torch.equal(out.cpu(), index_topk_ref(*cpu_args, topk, init_blocks, local_blocks))


def test_query_tiles_found_past_64_requests(device):
    """Tiles of ``block_t`` tokens over 70 requests (empty ones among them): each program sums the tile counts
    of the requests in 64-request steps to find its own, so the second step must count the first's."""
    from mm3_compile.kernels.indexer import topk as kernels

    requests = [((3, 1, 0, 2)[r % 4], 130 + 37 * (r % 5)) for r in range(70)]
    args = make_inputs(requests, 1, 16, device, seed=13)
    sched = kernels.IndexSchedule(2, 1, 4, 1, False, 16, 16, 4, 16)
    out = kernels.index_topk(*args, 2, 0, 1, schedule=sched)
    assert torch.equal(out.cpu(), index_topk_ref(*[t.cpu() for t in args], 2, 0, 1))


@pytest.mark.parametrize("target", [None, "gfx942"])
def test_fp8_index_cache(target, device):
    """An FP8 index cache (the authority's e4m3 flavour; gfx942: fnuz) ranks as its decoded values do.

    Small integers are exact in e4m3, so the lists also equal the bf16 cache's; per-slot scales are
    powers of two (exact products) and enter the reference as multiplied keys.
    """
    import contextlib

    from mm3_compile import platform

    with platform.emulate(target) if target else contextlib.nullcontext():
        fp8 = platform.platform_for(device).kv_e4m3_dtype
        index_q, index_k, block_table, cu, seq_lens = make_inputs([(3, 700), (1, 300), (1, 0)], 2, 32, device, seed=12)
        k8 = index_k.to(fp8)
        cpu = [t.cpu() for t in (index_q, k8, block_table, cu, seq_lens)]
        out = torch.ops.mm3.index_topk(index_q, k8.view(torch.uint8), block_table, cu, seq_lens, 5, 0, 1, "fp8")
        assert torch.equal(out.cpu(), index_topk_ref(*cpu, 5, 0, 1))
        assert torch.equal(out, torch.ops.mm3.index_topk(index_q, index_k, block_table, cu, seq_lens, 5, 0, 1))
        g = torch.Generator().manual_seed(3)
        scale = 2.0 ** torch.randint(-3, 4, (index_k.shape[0] * PAGE,), generator=g).float()
        out = torch.ops.mm3.index_topk(index_q, k8, block_table, cu, seq_lens, 5, 1, 1, "fp8", scale.to(device))
        assert torch.equal(out.cpu(), index_topk_ref(*cpu, 5, 1, 1, index_k_scale=scale))
        with pytest.raises(ValueError, match="index_k_scale: expected one scale per slot"):
            torch.ops.mm3.index_topk(index_q, k8, block_table, cu, seq_lens, 5, 0, 1, "fp8", scale[:-1].to(device))
        # read as ptr + slot: a strided or expanded scale vector is refused, never read past its storage
        for strided in (scale.repeat(2)[::2], scale[:1].expand(scale.shape[0])):
            with pytest.raises(ValueError, match="index_k_scale: expected a contiguous 1-D tensor"):
                torch.ops.mm3.index_topk(index_q, k8, block_table, cu, seq_lens, 5, 0, 1, "fp8", strided.to(device))
        with pytest.raises(TypeError, match="index_k_cache: expected the dtype of index_q"):
            torch.ops.mm3.index_topk(index_q, k8, block_table, cu, seq_lens, 5, 0, 1)
        other = platform.FP8_E4M3_OCP if fp8 == platform.FP8_E4M3_FNUZ else platform.FP8_E4M3_FNUZ
        with pytest.raises(TypeError, match="index_k_cache: index_cache_dtype='fp8' on platform"):
            torch.ops.mm3.index_topk(index_q, index_k.to(other), block_table, cu, seq_lens, 5, 0, 1, "fp8")


@pytest.mark.parametrize("fp16_q", [True, False])
def test_fp8_index_cache_q_of_any_magnitude(fp16_q, device):
    """With an FP8 cache the dot may run on fp16 operands, q scaled per row by a power of two: rows of
    magnitude 2^-100 and 2^60 (far outside fp16), a zero row and a bf16 subnormal row rank as the reference."""
    from mm3_compile import platform
    from mm3_compile.kernels.indexer import topk as kernels

    fp8 = platform.platform_for(device).kv_e4m3_dtype
    index_q, index_k, block_table, cu, seq_lens = make_inputs([(1, 700), (1, 900), (1, 500), (1, 600)], 2, 32, device)
    index_q = index_q.float()
    index_q[0] *= 2.0**-100
    index_q[1] *= 2.0**60
    index_q[2] = 0.0
    index_q[3] = index_q[3].sign() * 2.0**-133  # bf16 subnormal
    index_q = index_q.to(torch.bfloat16)
    k8 = index_k.to(fp8)
    sched = dataclasses.replace(kernels.index_schedule(4, 4, 2, block_table.shape[1], device), fp16_q=fp16_q)
    out = kernels.index_topk(index_q, k8, block_table, cu, seq_lens, 5, 0, 1, platform.fp8_format(fp8), schedule=sched)
    cpu = [t.cpu() for t in (index_q, k8, block_table, cu, seq_lens)]
    assert torch.equal(out.cpu(), index_topk_ref(*cpu, 5, 0, 1))


def test_fp8_index_cache_huge_scores_rank_below_nan(device):
    """NaN ranks as -1e30: a block scoring -1.6e31 (q of magnitude 2^95) must come after a NaN block, which
    needs the fp16 dot's row scale undone on the scores (the ranking of finite scores alone would not)."""
    from mm3_compile import platform

    fp8 = platform.platform_for(device).kv_e4m3_dtype
    index_q, index_k, block_table, cu, seq_lens = make_inputs([(1, 900)], 1, 16, device, seed=21)
    index_q = index_q.float() * 2.0**95
    page = lambda b: block_table[0, b].long()  # noqa: E731
    index_k[page(2)] = -index_q[0, 0].sign().to(index_k.dtype)  # every key against q: a score of -|q|_1
    index_k[page(4), 3, 5] = float("nan")
    index_q = index_q.to(torch.bfloat16)
    k8 = index_k.to(fp8)
    out = torch.ops.mm3.index_topk(index_q, k8, block_table, cu, seq_lens, 8, 0, 1, "fp8")
    ref = index_topk_ref(*[t.cpu() for t in (index_q, k8, block_table, cu, seq_lens)], 8, 0, 1)
    assert torch.equal(out.cpu(), ref)
    order = ref[0, 0].tolist()
    assert order.index(4) < order.index(2) == 7  # the NaN block above the most negative one, which is last


def test_fp8_index_cache_write_and_scale_rule(device):
    """write_index_cache stores index_k / s in e4m3 (one scalar s per layer: sqrt(Didx) * max|1 + w| / FP8_MAX)."""
    from mm3_compile import platform
    from mm3_compile.models.attention import M3Attention, write_index_cache
    from mm3_compile.models.config import MiniMaxM3Config
    from mm3_compile.models.tp import TPInfo

    cfg = MiniMaxM3Config.tiny()
    attn = M3Attention(cfg, True, TPInfo(), torch.bfloat16, device)
    attn.index_k_norm.weight.fill_(0.5)
    fp8 = platform.platform_for(device).kv_e4m3_dtype
    scale = attn.index_k_scale()
    expected_scale = 1.5 * cfg.index_head_dim**0.5 / platform.fp8_format(fp8).max
    assert scale.shape == (1,) and scale.dtype == torch.float32 and abs(scale.item() - expected_scale) < 1e-6
    cache = torch.zeros(2, 1, PAGE, cfg.index_head_dim, dtype=fp8, device=device)
    index_k = torch.randn(3, 1, cfg.index_head_dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    slots = torch.tensor([5, -1, 130], dtype=torch.int64)
    write_index_cache(cache, index_k.to(device), slots.to(device), scale)
    flat = cache.view(-1, cfg.index_head_dim).cpu()
    want = (index_k.float() / scale.cpu()).to(fp8)[:, 0]
    assert torch.equal(flat[5].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(flat[130].view(torch.uint8), want[2].view(torch.uint8))
    assert int((flat.view(torch.uint8) != 0).any(-1).sum()) == 2  # the padding token wrote nothing


SM90_SCORE_COMPILE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mm3_compile import platform
from mm3_compile.kernels.fp8 import FP8Launch
from mm3_compile.kernels.indexer.topk import _index_score_kernel as kernel

launch = FP8Launch(platform.fp8_format(platform.FP8_E4M3_OCP), native_load=True)  # typed e4m3fn index-K, sm_90
consts = dict(
    HIDX=4, DIDX=128, BLOCK_D=128, BLOCK_T=1, ROWS=16, Q_MODE=0, K_MODE=0, HAS_K_SCALE=False, FP32_DOT=False,
    KEYS_MAJOR=False, SPLIT_NAN_MAX=False, Q_FP16=True, **launch.constexprs(),
)
pointers = ("*bf16", "*fp8e4nv", "*fp32", "*i32", "*i32", "*i32", "*fp32")
ints = [n for n in kernel.arg_names[len(pointers):] if n not in consts]
signature = dict(zip(kernel.arg_names, pointers), **dict.fromkeys(ints, "i32"), **dict.fromkeys(consts, "constexpr"))
constexprs = {(kernel.arg_names.index(k),): v for k, v in consts.items()}
src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
print("F16-MMA" if "mma" in ptx and "f16.f16" in ptx else "NO-F16-MMA")
"""


def test_fp8_score_kernel_compiles_for_sm90_with_fp16_dots():
    """The FP8 index-K score kernel with the fp16 q dot compiled for sm_90 ahead of time, without a GPU (the
    interpreter runs that path with fp32 dots): a tensor-core dot on fp16 operands."""
    proc = run_python(SM90_SCORE_COMPILE, env_drop=("TRITON_INTERPRET",))
    if proc.returncode != 0 and ("ptxas" in proc.stderr.lower() or "GPUTarget" in proc.stderr):
        pytest.skip("no Triton CUDA backend to compile with: " + proc.stderr[-200:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("F16-MMA")
