"""Benchmark shapes and synthetic inputs: paged KV caches, block tables, indexer-like top-k lists.

Every tensor is fresh random data (never zeros).  Physical pages are scattered at random over a
pool of at least ``min_pool_bytes`` so successive input sets touch different memory (no L2 reuse
between rotated sets).
"""

import dataclasses
import math
import zlib

import torch

from mm3_compile import platform
from mm3_compile.contract import PAGE_SIZE

# Rotated input sets per case: enough for 4x the L2 even for one-token decode (~1 MB per call).
MAX_SETS = 256
TOPK = 16
# Stored FP8 values are x / scale; 1/16 keeps N(0, 1) data well inside e4m3's range with fine steps.
FP8_KV_SCALE = 1.0 / 16


@dataclasses.dataclass(frozen=True)
class AttnCase:
    family: str  # "prefill" | "decode"
    tp: str  # "TP1" | "TP8" | "tiny"
    Hq: int
    Hkv: int
    D: int
    q_lens: tuple[int, ...]  # new tokens per request
    seq_lens: tuple[int, ...]  # KV length per request, this chunk included
    kv: str  # "bf16" | "fp8"
    topk: int = TOPK
    share: int = 0  # > 0: consecutive tokens sharing their random older blocks (see synth_topk); 0 = the run's default

    @property
    def shape(self) -> str:
        B = len(self.q_lens)
        shared = f" share{self.share}" if self.share else ""
        if self.family == "decode":
            return f"{self.tp} B{B} s{self.seq_lens[0]}{shared}"
        prefix = self.seq_lens[0] - self.q_lens[0]
        prefix_text = f"{prefix // 1024}k" if prefix % 1024 == 0 else str(prefix)
        return f"{self.tp} {B}x{self.q_lens[0]}" + (f" +{prefix_text} prefix" if prefix else "") + shared

    @property
    def key(self) -> str:
        return f"{self.family}|{self.shape}|{self.kv}"

    @property
    def kv_cache_dtype(self) -> str:
        return "fp8" if self.kv == "fp8" else "auto"


def seeded(key: str, device: torch.device) -> torch.Generator:
    """Same inputs for the same case in every pass (stable across processes, unlike hash())."""
    return torch.Generator(device=device).manual_seed(zlib.crc32(key.encode()))


def decode_cases(cpu: bool, quick: bool) -> list[AttnCase]:
    """Target-relevant cases first: a run that hits its time budget loses the least important rows."""
    if cpu:
        return [
            AttnCase("decode", "tiny", 4, 1, 128, (1,) * B, (600,) * B, kv, topk=4)
            for B, kv in ((2, "bf16"), (1, "fp8"))
        ]
    tps = (("TP1", 64, 4), ("TP8", 8, 1))
    shapes = [(32, 32768), (128, 32768), (1, 32768), (32, 131072)]
    if quick:
        shapes = [(32, 32768), (1, 32768)]
    cases = []
    for B, seq in shapes:
        for kv in ("bf16", "fp8"):
            for tp, Hq, Hkv in tps:
                cases.append(AttnCase("decode", tp, Hq, Hkv, 128, (1,) * B, (seq,) * B, kv))
    return cases


def prefill_cases(cpu: bool, quick: bool) -> list[AttnCase]:
    """The target shapes, then (full runs) our op on lists where runs of 64 tokens share their
    older blocks -- what a tile-grouping kernel gains on correlated lists (informational rows)."""
    if cpu:
        return [
            AttnCase("prefill", "tiny", 4, 2, 128, (160,), (160,), "bf16", topk=2),
            AttnCase("prefill", "tiny", 4, 2, 128, (32, 32), (288, 288), "fp8", topk=2),
        ]
    one, four = ((8192,), (8192,)), ((2048,) * 4, (18432,) * 4)
    order = [("TP1", one), ("TP8", one), ("TP8", four), ("TP1", four)]
    if quick:
        order = order[:2]
    heads = {"TP1": (64, 4), "TP8": (8, 1)}
    cases = [
        AttnCase("prefill", tp, *heads[tp], 128, q_lens, seq_lens, kv)
        for kv in ("bf16", "fp8")
        for tp, (q_lens, seq_lens) in order
    ]
    if not quick:
        cases += [
            AttnCase("prefill", tp, *heads[tp], 128, *one, kv, share=64)
            for tp, kv in (("TP1", "bf16"), ("TP8", "bf16"), ("TP1", "fp8"))
        ]
    return cases


def token_positions(case: AttnCase, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(request id [T], absolute position [T]) of every packed query token, int64."""
    req, pos = [], []
    for r, (q_len, seq_len) in enumerate(zip(case.q_lens, case.seq_lens)):
        req.append(torch.full((q_len,), r, dtype=torch.int64))
        pos.append(torch.arange(seq_len - q_len, seq_len, dtype=torch.int64))
    return torch.cat(req).to(device), torch.cat(pos).to(device)


def synth_topk(pos: torch.Tensor, Hkv: int, topk: int, gen: torch.Generator, share: int = 1) -> torch.Tensor:
    """int32 [Hkv, T, topk] the way the indexer lays lists out: the query's own (local) block first,
    then distinct random older blocks, -1 padded when fewer than ``topk`` blocks are visible.

    ``share`` > 1 makes runs of ``share`` consecutive tokens prefer the same older blocks (a real
    indexer's neighbouring queries often agree); 1 is the worst case, independent picks.
    """
    T = pos.shape[0]
    own = pos // PAGE_SIZE  # [T]
    n_blocks = int(own.max().item()) + 1
    groups = math.ceil(T / share)
    scores = torch.rand(Hkv, groups, n_blocks, generator=gen, device=pos.device)
    scores = scores.repeat_interleave(share, dim=1)[:, :T]  # [Hkv, T, n_blocks]
    older = torch.arange(n_blocks, device=pos.device) < own[:, None]  # [T, n_blocks]
    scores = scores.masked_fill(~older, -1.0)
    k = min(topk - 1, n_blocks)
    values, picks = scores.topk(k, dim=-1)  # [Hkv, T, k]
    picks = torch.where(values >= 0, picks, -1)
    ids = torch.full((Hkv, T, topk), -1, dtype=torch.int64, device=pos.device)
    ids[..., 0] = own
    ids[..., 1 : 1 + k] = picks
    return ids.to(torch.int32)


def attended_keys(topk_idx: torch.Tensor, pos: torch.Tensor, tok_seq: torch.Tensor) -> torch.Tensor:
    """int64 [Hkv, T]: keys each (KV head, token) attends under the contract's rule (first
    ``min(T, p//128 + 1)`` slots, ids in ``[0, p//128]``, an id listed twice counted once, keys
    ``j <= p`` and ``j < seq_len``)."""
    T_slots = topk_idx.shape[-1]
    own = pos // PAGE_SIZE
    ids = topk_idx.long()
    used = torch.arange(T_slots, device=pos.device) < torch.clamp(own + 1, max=T_slots)[:, None]  # [T, slots]
    earlier = torch.ones(T_slots, T_slots, dtype=torch.bool, device=pos.device).tril(-1)  # [slot, earlier slot]
    repeat = ((ids[..., :, None] == ids[..., None, :]) & (used[:, None, :] & earlier)).any(-1)  # [Hkv, T, slots]
    valid = used & (ids >= 0) & (ids <= own[:, None]) & ~repeat
    last = torch.minimum(pos, tok_seq - 1)  # [T] last visible key
    keys = torch.clamp(last[:, None] - ids * PAGE_SIZE + 1, 0, PAGE_SIZE)
    return (keys * valid).sum(-1)


@dataclasses.dataclass
class AttnInputs:
    case: AttnCase
    cache: torch.Tensor  # [pool, Hkv, 128, 2D]: bf16, or uint8 bytes of the platform's FP8 KV dtype
    storage_dtype: torch.dtype
    k_scale: torch.Tensor | None  # [1] float32 for FP8 (the references'; each set holds its own copy)
    v_scale: torch.Tensor | None
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    req: torch.Tensor  # [T] int64
    pos: torch.Tensor  # [T] int64
    sets: list[dict]  # per rotated set: q [T, Hq, D], topk_idx [Hkv, T, topk], block_table [B, nblk], k/v_scale
    sm_scale: float
    flops: int  # the same for every set: the own block is always first, older blocks are full pages
    kv_bytes: int
    io_bytes: int


def _fill_cache(pool: int, case: AttnCase, device, gen) -> tuple[torch.Tensor, torch.dtype]:
    shape = (pool, case.Hkv, PAGE_SIZE, 2 * case.D)
    if case.kv == "bf16":
        return torch.randn(shape, dtype=torch.bfloat16, device=device, generator=gen), torch.bfloat16
    fp8 = platform.resolve_kv_cache_dtype("fp8", device, torch.bfloat16)
    fmax = platform.fp8_format(fp8).max
    cache = torch.empty(shape, dtype=torch.uint8, device=device)
    step = max(1, (256 << 20) // (case.Hkv * PAGE_SIZE * 2 * case.D * 4))  # pages per fp32 staging chunk
    for start in range(0, pool, step):
        part = torch.randn((min(step, pool - start), *shape[1:]), device=device, generator=gen) / FP8_KV_SCALE
        cache[start : start + part.shape[0]] = part.clamp(-fmax, fmax).to(fp8).view(torch.uint8)
    return cache, fp8


def make_attn_inputs(case: AttnCase, device, l2_bytes: int, min_pool_bytes: int, share: int = 1) -> AttnInputs:
    gen = seeded(case.key, device)
    share = case.share or share
    B = len(case.q_lens)
    elem = 2 if case.kv == "bf16" else 1
    page_bytes = case.Hkv * PAGE_SIZE * 2 * case.D * elem
    n_blocks = [math.ceil(s / PAGE_SIZE) for s in case.seq_lens]
    max_blocks = max(n_blocks)
    pool = max(B * max_blocks, math.ceil(min_pool_bytes / page_bytes))
    cache, storage_dtype = _fill_cache(pool, case, device, gen)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(case.q_lens), 0)
    cu = cu.to(device)
    req, pos = token_positions(case, device)
    T = pos.shape[0]
    tok_seq = seq_lens.long()[req]

    scale = torch.tensor([FP8_KV_SCALE], dtype=torch.float32, device=device) if case.kv == "fp8" else None

    def one_set():
        q = torch.randn((T, case.Hq, case.D), dtype=torch.bfloat16, device=device, generator=gen)
        topk_idx = synth_topk(pos, case.Hkv, case.topk, gen, share)
        pages = torch.randperm(pool, device=device, generator=gen)[: B * max_blocks]
        # each set its own scale tensors (same values): a layer's scales are cold like its cache, not L2-resident
        scales = (None, None) if scale is None else (scale.clone(), scale.clone())
        return {
            "q": q,
            "topk_idx": topk_idx,
            "block_table": pages.view(B, max_blocks).to(torch.int32),
            "k_scale": scales[0],
            "v_scale": scales[1],
        }

    first = one_set()
    keys = int(attended_keys(first["topk_idx"], pos, tok_seq).sum().item())  # over (KV head, token)
    G = case.Hq // case.Hkv
    flops = 4 * G * case.D * keys
    kv_bytes = keys * 2 * case.D * elem  # K and V of every key read, per KV head
    io_bytes = 2 * T * case.Hq * case.D * 2  # q in, out back (bf16)
    touched = kv_bytes + io_bytes
    n_sets = 1 if device.type != "cuda" else max(1, min(MAX_SETS, math.ceil(4 * l2_bytes / max(touched, 1))))
    sets = [first] + [one_set() for _ in range(n_sets - 1)]
    return AttnInputs(
        case,
        cache,
        storage_dtype,
        scale,
        None if scale is None else scale.clone(),
        seq_lens,
        cu,
        req,
        pos,
        sets,
        1.0 / math.sqrt(case.D),
        flops,
        kv_bytes,
        io_bytes,
    )


def dense_causal_flops(case: AttnCase) -> int:
    """What dense causal attention over the whole context computes: every key j <= p."""
    keys = sum(sum(range(s - q + 1, s + 1)) for q, s in zip(case.q_lens, case.seq_lens))
    return 4 * case.Hq * case.D * keys
