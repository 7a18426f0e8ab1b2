"""Lightning-indexer top-k (``mm3::index_topk``): block scores over every visible key, then top-16.

Not part of the attention rows (those use synthetic lists); here the indexer itself is timed on the
same shapes.  FLOPs = ``2*Hidx*Didx`` per (query, visible key); bytes (decode) = each request's
index-K keys read once + q.  Providers: our op eager and compiled, and a vectorised PyTorch version
(dense scores, causal mask, per-block max, forced local block, ``topk``) eager and compiled.  The
check compares the lists with the repo's naive reference (``kernels/indexer/naive.py``) on sampled
tokens: the fraction of (token, head) lists that match exactly.
"""

import dataclasses
import math

import torch

from bench.harness import Check, Context
from bench.inputs import seeded
from bench.refs import sample_tokens
from mm3_compile import platform
from mm3_compile.contract import PAGE_SIZE
from mm3_compile.kernels.indexer.naive import index_topk_ref

DIDX = 128
LOCAL_BLOCKS = 1
MATCH_NEEDED = 0.98  # float64 reference vs fp32 accumulation: near-equal block scores may swap


@dataclasses.dataclass(frozen=True)
class IndexCase:
    tp: str
    Hidx: int
    B: int
    q_len: int
    seq_len: int
    topk: int = 16
    index_dtype: str = "bf16"  # or "fp8": the dtype authority's e4m3 index-K cache (index_cache_dtype="fp8")

    @property
    def family(self) -> str:
        return "decode" if self.q_len == 1 else "prefill"

    @property
    def shape(self) -> str:
        if self.q_len == 1:
            return f"{self.tp} decode B{self.B} s{self.seq_len}" + (" fp8 index-K" if self.index_dtype == "fp8" else "")
        prefix = self.seq_len - self.q_len
        return f"{self.tp} prefill {self.B}x{self.q_len}" + (f" +{prefix // 1024}k prefix" if prefix else "")


def cases(ctx: Context) -> list[IndexCase]:
    if not ctx.cuda:
        return [
            IndexCase("tiny", 1, 2, 1, 600, topk=4),
            IndexCase("tiny", 2, 1, 160, 160, topk=2),
            IndexCase("tiny", 2, 2, 1, 300, topk=2, index_dtype="fp8"),
        ]
    out = [
        IndexCase("TP1", 4, 32, 1, 32768),
        IndexCase("TP1", 4, 1, 8192, 8192),
        IndexCase("TP8", 1, 32, 1, 32768),
        IndexCase("TP1", 4, 128, 1, 32768),
        IndexCase("TP1", 4, 1, 1, 32768),
        IndexCase("TP1", 4, 4, 2048, 18432),
        IndexCase("TP1", 4, 32, 1, 32768, index_dtype="fp8"),
    ]
    return out[:2] if ctx.quick else out


def _op(index_q, index_k_cache, block_table, cu_seqlens_q, seq_lens, topk: int):
    spec = "auto" if index_k_cache.dtype == index_q.dtype else "fp8"
    return torch.ops.mm3.index_topk(
        index_q, index_k_cache, block_table, cu_seqlens_q, seq_lens, topk, 0, LOCAL_BLOCKS, spec
    )


def _torch_chunk(q, k_cache, block_table, pos, topk: int):
    """q [B, n, H, Di] (n tokens of each uniform request), pos [B, n] -> int32 [B, H, n, topk] (-1 padded)."""
    B, n_q, H, Di = q.shape
    n_blocks = block_table.shape[1]
    keys = k_cache[block_table.long()].reshape(B, n_blocks * PAGE_SIZE, Di)  # [B, S, Di]
    scores = torch.matmul(q.float().reshape(B, n_q * H, Di), keys.float().transpose(1, 2)).view(B, n_q, H, -1)
    key_pos = torch.arange(n_blocks * PAGE_SIZE, device=q.device)
    scores = scores.masked_fill(key_pos > pos[:, :, None, None], float("-inf"))
    block = scores.view(B, n_q, H, n_blocks, PAGE_SIZE).amax(-1)  # [B, n_q, H, nblk]
    block = torch.where(torch.isnan(block), -1e30, block)
    own = (pos // PAGE_SIZE)[:, :, None, None]
    blk = torch.arange(n_blocks, device=q.device)
    block = torch.where((blk <= own) & (blk > own - LOCAL_BLOCKS), 1e29, block)
    values, ids = block.topk(min(topk, n_blocks), dim=-1)
    ids = torch.where(values == float("-inf"), -1, ids).to(torch.int32)
    if ids.shape[-1] < topk:
        ids = torch.nn.functional.pad(ids, (0, topk - ids.shape[-1]), value=-1)
    return ids.permute(0, 2, 1, 3)


def _torch_index_topk(chunk_fn, inp, s, chunk: int):
    B, L = inp.case.B, inp.case.q_len
    q = s["q"].view(B, L, inp.case.Hidx, DIDX)
    pos = inp.pos.view(B, L)
    parts = [
        chunk_fn(q[:, a : a + chunk], inp.k_cache, s["block_table"], pos[:, a : a + chunk], inp.case.topk)
        for a in range(0, L, chunk)
    ]
    ids = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]  # [B, H, L, topk]
    return ids.permute(1, 0, 2, 3).reshape(inp.case.Hidx, B * L, inp.case.topk)


@dataclasses.dataclass
class IndexInputs:
    case: IndexCase
    k_cache: torch.Tensor  # [pool, 128, Didx] bf16
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    pos: torch.Tensor  # [T] int64
    sets: list[dict]
    flops: int
    nbytes: int


def make_inputs(case: IndexCase, ctx: Context) -> IndexInputs:
    device = ctx.device
    gen = seeded("indexer|" + case.shape, device)
    n_blocks = math.ceil(case.seq_len / PAGE_SIZE)
    page_bytes = PAGE_SIZE * DIDX * 2
    pool = max(case.B * n_blocks, (1 << 30) // page_bytes if ctx.cuda else 0)
    k_cache = torch.randn((pool, PAGE_SIZE, DIDX), dtype=torch.bfloat16, device=device, generator=gen)
    if case.index_dtype == "fp8":  # N(0, 1) keys: inside the e4m3 range with scale 1 (the scalar rule's ranking)
        k_cache = k_cache.to(platform.platform_for(device).kv_e4m3_dtype)
    T = case.B * case.q_len
    seq_lens = torch.full((case.B,), case.seq_len, dtype=torch.int32, device=device)
    cu = torch.arange(case.B + 1, dtype=torch.int32, device=device) * case.q_len
    pos = (torch.arange(case.q_len, device=device) + case.seq_len - case.q_len).repeat(case.B)
    visible = case.B * sum(range(case.seq_len - case.q_len + 1, case.seq_len + 1))  # keys j <= p per token
    flops = 2 * case.Hidx * DIDX * visible
    nbytes = (
        case.B * case.seq_len * DIDX * k_cache.element_size() + 2 * T * case.Hidx * DIDX + T * case.Hidx * case.topk * 4
    )
    n_sets = 1 if not ctx.cuda else max(1, min(32, math.ceil(4 * ctx.l2_bytes / nbytes)))

    def one_set():
        pages = torch.randperm(pool, device=device, generator=gen)[: case.B * n_blocks]
        q = torch.randn((T, case.Hidx, DIDX), dtype=torch.bfloat16, device=device, generator=gen)
        return {"q": q, "block_table": pages.view(case.B, n_blocks).to(torch.int32)}

    return IndexInputs(case, k_cache, seq_lens, cu, pos, [one_set() for _ in range(n_sets)], flops, nbytes)


def naive_on_sample(inp: IndexInputs, tokens: torch.Tensor) -> torch.Tensor:
    """int32 [Hidx, n, topk] from the naive reference: each sampled token as a one-token request
    with ``seq_len = p + 1`` over a compact cache of its request's visible pages."""
    s = inp.sets[0]
    case = inp.case
    pos = inp.pos.cpu()[tokens]
    req = tokens // case.q_len
    width = int(pos.max()) // PAGE_SIZE + 1
    pages = s["block_table"].cpu()[req, :width].long()  # [n, width]; only blocks <= p // 128 are read
    compact = inp.k_cache[pages.flatten().to(inp.k_cache.device)].cpu()  # [n * width, 128, Didx]
    table = torch.arange(pages.numel(), dtype=torch.int32).view(pages.shape)
    n = tokens.shape[0]
    return index_topk_ref(
        index_q=s["q"][tokens.to(s["q"].device)].cpu(),
        index_k_cache=compact,
        block_table=table,
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=(pos + 1).to(torch.int32),
        topk=case.topk,
        init_blocks=0,
        local_blocks=LOCAL_BLOCKS,
    ).cpu()


def run(ctx: Context, passes=("ours", "baselines")) -> None:
    compiled = {"op": ctx.compile(_op, dynamic=True), "chunk": ctx.compile(_torch_chunk, dynamic=True)}
    expected = {}  # case shape -> (sampled tokens, naive lists)
    for pass_name in passes:
        for case in cases(ctx):
            base = dict(
                family="indexer", shape=case.shape, dtype="bf16", kv_dtype="fp8" if case.index_dtype == "fp8" else "-"
            )
            if ctx.budget.expired():
                ctx.record(**base, provider=f"({pass_name})", mode="-", error="skipped: time budget")
                continue
            _run_case(ctx, case, base, pass_name, compiled, expected)
            if ctx.cuda:
                torch.cuda.empty_cache()


def _run_case(ctx: Context, case: IndexCase, base: dict, pass_name: str, compiled: dict, expected: dict) -> None:
    try:
        inp = make_inputs(case, ctx)
        if case.shape not in expected:
            tokens = sample_tokens(inp.pos.shape[0], 16 if ctx.cuda else 6, gen_seed=case.B)
            expected[case.shape] = (tokens, naive_on_sample(inp, tokens))
    except Exception as e:  # inputs or the reference failed: one error row
        ctx._failed(dict(base, provider="(inputs/reference)"), ("launched",), e)
        return
    tokens, ref = expected[case.shape]

    def check(out):
        got = out[:, tokens.to(out.device)].cpu()
        match = (got == ref).all(-1).float().mean().item()
        return Check(match >= MATCH_NEEDED, 1.0 - match, f"lists equal to the naive reference: {match:.1%}")

    decode = case.q_len == 1
    kw = dict(
        modes=("launched", "graph") if decode else ("launched",),
        flops=inp.flops,
        nbytes=inp.nbytes if decode else None,
        ceiling_kind="copy" if decode else "matmul",
    )
    if pass_name == "ours":
        for name, fn in (("op", _op), ("op_compiled", compiled["op"])):
            fns = [
                lambda s=s, fn=fn: fn(s["q"], inp.k_cache, s["block_table"], inp.cu_seqlens_q, inp.seq_lens, case.topk)
                for s in inp.sets
            ]
            ctx.provider(base, name, fns, check, **kw)
    else:
        budget_bytes = (512 << 20) if ctx.cuda else (16 << 20)
        chunk = max(1, min(case.q_len, budget_bytes // (case.B * case.Hidx * case.seq_len * 4 * 2)))
        for name, fn in (("torch_ref", _torch_chunk), ("torch_ref_compiled", compiled["chunk"])):
            fns = [lambda s=s, fn=fn: _torch_index_topk(fn, inp, s, chunk) for s in inp.sets]
            ctx.provider(base, name, fns, check, slow=ctx.cuda and not decode, **kw)
