"""Properties of mm3::index_topk against kernels/indexer/naive.py: the index lists, exactly.

Inputs are small integers times one power of two per tensor: every dot product is exact in fp32
whatever the summation order, so scores tie exactly and often and the lists (order included, ties
toward the lower block id, NaN last, forced blocks first) must equal the reference's.  Ragged
requests straddle pages, padding requests (seq_len 0) and block tables with garbage past each
request's blocks are included; every input dtype reaches its subnormals, and fp32 inputs reach 2^60
(raw block scores past 1e29, which must still rank below the forced blocks).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mm3_compile.contract import PAGE_SIZE
from mm3_compile.kernels.indexer.naive import index_topk_ref
from tests.properties.strategies import FLOAT_DTYPES, SCALE, device_mark, examples, on_device

pytestmark = device_mark()

# Exponent ranges per dtype: the integer mantissas (|m| <= 3) times 2^e stay finite, and reach the
# subnormals of fp16 (2^-24), bf16 (2^-133) and fp32; fp32 scores reach 1152 * 2^120 > 1e29.
EXPONENTS = {
    torch.float32: (-140, 60),
    torch.float16: (-24, 13),
    torch.bfloat16: (-133, 30),
}


@st.composite
def requests(draw, max_tokens=24 * SCALE):
    """[(q_len, seq_len)] with q_len <= seq_len, total q_len <= max_tokens, some padding (0, 0)."""
    reqs, budget = [], max_tokens
    for _ in range(draw(st.integers(1, 4))):
        seq_len = draw(st.sampled_from([0, 1, 127, 128, 129, 255, 256, 257, 300, 640, 700]))
        q_len = draw(st.integers(0 if seq_len == 0 else 1, max(1, min(seq_len, budget)))) if seq_len else 0
        budget -= q_len
        reqs.append((q_len, seq_len))
        if budget <= 0:
            break
    return reqs


@st.composite
def scaled_integers(draw, shape, dtype, g, partner_exp=None):
    """-> (tensor, its exponent).  With ``partner_exp`` the products stay fp32-normal (>= 2^-120): scores are
    fp32 by contract, a float64 reference would not underflow where they do."""
    lo, hi = EXPONENTS[dtype]
    if partner_exp is not None:
        lo = max(lo, -120 - partner_exp)
    e = draw(st.integers(lo, hi))
    x = torch.randint(-3, 4, shape, generator=g).double() * 2.0**e
    x = x.to(dtype)
    if draw(st.booleans()):  # a few NaN
        flat = x.view(-1)
        flat[torch.randint(0, flat.numel(), (draw(st.integers(1, 3)),), generator=g)] = float("nan")
    return x, e


@st.composite
def index_problems(draw):
    reqs = draw(requests())
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    heads, dim = draw(st.integers(1, 4)), draw(st.sampled_from((16, 48, 64, 128)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    blocks = [-(-s // PAGE_SIZE) for _, s in reqs]
    max_blocks = max(blocks + [1]) + draw(st.integers(0, 2))
    num_pages = sum(blocks) + 1
    pages = torch.randperm(num_pages, generator=g).to(torch.int32)
    table = torch.randint(-(2**31), 2**31 - 1, (len(reqs), max_blocks), generator=g, dtype=torch.int64)
    table = table.to(torch.int32)  # garbage past each request's blocks: never read
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = pages[start : start + n]
        start += n
    total_q = sum(q for q, _ in reqs)
    index_q, q_exp = draw(scaled_integers((total_q, heads, dim), dtype, g))
    index_k, _ = draw(scaled_integers((num_pages, PAGE_SIZE, dim), dtype, g, partner_exp=q_exp))
    if draw(st.booleans()):  # identical pages: every full block ties
        index_k = index_k[:1].expand_as(index_k).contiguous()
    cu = torch.tensor([0] + torch.tensor([q for q, _ in reqs]).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    topk, init_blocks, local_blocks = draw(st.integers(1, 8)), draw(st.integers(0, 2)), draw(st.integers(0, 2))
    return (index_q, index_k, table, cu, seq_lens), (topk, init_blocks, local_blocks)


@settings(max_examples=examples(12))
@given(problem=index_problems())
def test_index_topk_matches_reference(problem):
    args, (topk, init_blocks, local_blocks) = problem
    out = torch.ops.mm3.index_topk(*on_device(*args), topk, init_blocks, local_blocks).cpu()
    expected = index_topk_ref(*args, topk, init_blocks, local_blocks)
    assert out.dtype == torch.int32 and out.shape == expected.shape
    bad = (out != expected).any(-1).nonzero()
    if bad.numel():
        h, t = bad[0].tolist()
        pytest.fail(
            f"{bad.shape[0]} rows differ; head {h} token {t}: {out[h, t].tolist()} vs {expected[h, t].tolist()}"
        )


@settings(max_examples=examples(2))
@given(problem=index_problems())
def test_compiled_matches_eager(problem):
    args, settings_ = problem

    def select(*tensors):
        return torch.ops.mm3.index_topk(*tensors, *settings_)

    torch._dynamo.reset()
    args = on_device(*args)
    compiled = torch.compile(select, backend="aot_eager", fullgraph=True)(*args)
    assert torch.equal(compiled, select(*args))
