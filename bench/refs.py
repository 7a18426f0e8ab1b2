"""References the benchmark checks every provider against, and the vectorised PyTorch provider.

* ``naive_attention_on_sample``: the repo's pure-PyTorch reference (``kernels/sparse_attn/naive.py``'s
  ``sparse_attn_ref``, imported by name: a renamed reference fails the bench's import).  It loops over
  (token, KV head) in float64 on the CPU, so it is run on a sample of query tokens: each sampled
  token becomes a one-token request with ``seq_len = p + 1`` (the same visible keys) over a compact
  cache holding only the pages its top-k list selects.
* ``sparse_attn_torch``: a vectorised pure-PyTorch implementation of the same contract (gather the
  selected pages, masked softmax), the "PyTorch reference" provider that is timed eager and under
  torch.compile (the naive loop cannot be timed at these sizes).  bf16 matmuls with fp32 softmax,
  chunked over tokens to bound memory.
"""

import torch

from mm3_compile.contract import PAGE_SIZE
from mm3_compile.kernels.sparse_attn.naive import sparse_attn_ref

ATOL, RTOL = 1.5e-2, 2e-2  # bf16 output vs a float64 reference


def sample_tokens(T: int, n: int, gen_seed: int = 0) -> torch.Tensor:
    """Up to ``n`` sorted token indices: the first and last token plus random ones."""
    if T <= n:
        return torch.arange(T)
    g = torch.Generator().manual_seed(gen_seed)
    middle = torch.randperm(T - 2, generator=g)[: n - 2] + 1
    return torch.cat([torch.tensor([0, T - 1]), middle]).sort().values


def naive_attention_on_sample(inp, s: dict, tokens: torch.Tensor) -> torch.Tensor:
    """float32 [n, Hq, D] (CPU) from the repo's naive reference for the sampled tokens of set ``s``."""
    ids = s["topk_idx"][:, tokens.to(s["topk_idx"].device)].long().cpu()  # [Hkv, n, T]
    pos = inp.pos.cpu()[tokens]
    req = inp.req.cpu()[tokens]
    table = s["block_table"].cpu()
    n = tokens.shape[0]
    own = pos // PAGE_SIZE
    used = torch.arange(ids.shape[-1]) < torch.clamp(own + 1, max=ids.shape[-1])[:, None]
    valid = used & (ids >= 0) & (ids <= own[:, None])
    # Compact cache: only the pages the sampled lists select.
    rows = req[None, :, None].expand_as(ids)
    pages = torch.where(valid, table[rows, ids.clamp(min=0)].long(), -1)
    wanted = torch.unique(pages[pages >= 0])
    compact = inp.cache[wanted.to(inp.cache.device)].cpu()  # [n_pages, Hkv, 128, 2D]
    remap = torch.full((int(table.max()) + 1,), -1, dtype=torch.int64)
    remap[wanted] = torch.arange(wanted.shape[0])
    width = int(own.max()) + 1
    sub_table = torch.full((n, width), -1, dtype=torch.int32)
    for h in range(ids.shape[0]):  # unused entries stay -1: never read
        r_idx, slot_idx = valid[h].nonzero(as_tuple=True)
        blk = ids[h, r_idx, slot_idx]
        sub_table[r_idx, blk] = remap[pages[h, r_idx, slot_idx]].to(torch.int32)
    cu = torch.arange(n + 1, dtype=torch.int32)
    seq = (pos + 1).to(torch.int32)
    k_scale = None if inp.k_scale is None else inp.k_scale.cpu()
    v_scale = None if inp.v_scale is None else inp.v_scale.cpu()
    return (
        sparse_attn_ref(
            q=s["q"][tokens.to(s["q"].device)].cpu(),
            kv_cache=compact,
            topk_idx=ids.to(torch.int32),
            block_table=sub_table,
            cu_seqlens_q=cu,
            seq_lens=seq,
            sm_scale=inp.sm_scale,
            storage_dtype=inp.storage_dtype,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        .float()
        .cpu()
    )


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    out = out.float().cpu()
    ok = bool(torch.isfinite(out).all()) and torch.allclose(out, ref, atol=ATOL, rtol=RTOL)
    return ok, float((out - ref).abs().max())


def _attend_chunk(q, cache, k_scale, v_scale, topk_idx, block_table, req, pos, tok_seq, sm_scale: float, storage_dtype):
    """q [t, Hq, D] bf16, cache [nb, Hkv, 128, 2D] (bf16, or uint8 bytes of ``storage_dtype``),
    topk_idx [Hkv, t, T] -> [t, Hq, D]."""
    t, Hq, D = q.shape
    nb, Hkv = cache.shape[:2]
    G = Hq // Hkv
    slots = topk_idx.shape[-1]
    own = pos // PAGE_SIZE  # [t]
    ids = topk_idx.long()
    used = torch.arange(slots, device=q.device) < torch.clamp(own + 1, max=slots)[:, None]  # [t, slots]
    valid = used & (ids >= 0) & (ids <= own[:, None]) & (ids < block_table.shape[1])  # [Hkv, t, slots]
    ids = torch.where(valid, ids, 0)
    pages = block_table[req[None, :, None].expand_as(ids), ids].long()
    valid = valid & (pages >= 0) & (pages < nb)
    pages = torch.where(valid, pages, 0)
    heads = torch.arange(Hkv, device=q.device)[:, None, None]
    kv = cache[pages, heads]  # [Hkv, t, slots, 128, 2D]; gathered as bytes: FP8 indexing is not universal
    if kv.dtype == torch.uint8:
        kv = kv.view(storage_dtype)
    k = kv[..., :D].to(q.dtype)
    v = kv[..., D:].to(q.dtype)
    if k_scale is not None:
        k = k * k_scale.to(q.dtype)
        v = v * v_scale.to(q.dtype)
    key_pos = ids[..., None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=q.device)  # [Hkv, t, slots, 128]
    visible = valid[..., None] & (key_pos <= pos[:, None, None]) & (key_pos < tok_seq[:, None, None])
    k = k.reshape(Hkv, t, slots * PAGE_SIZE, D)
    v = v.reshape(Hkv, t, slots * PAGE_SIZE, D)
    qh = q.view(t, Hkv, G, D).transpose(0, 1)  # [Hkv, t, G, D]
    logits = torch.matmul(qh, k.transpose(-1, -2)).float() * sm_scale  # [Hkv, t, G, keys]
    logits = logits.masked_fill(~visible.reshape(Hkv, t, 1, slots * PAGE_SIZE), float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)  # a row with no key is 0
    out = torch.matmul(probs.to(q.dtype), v)  # [Hkv, t, G, D]
    return out.transpose(0, 1).reshape(t, Hq, D)


def chunk_tokens(case, device) -> int:
    """Tokens per chunk so the gathered pages stay around 1 GiB (bf16) on the GPU."""
    per_token = case.Hkv * case.topk * PAGE_SIZE * 2 * case.D * 2 * 3  # gather + dequantised K/V copies
    budget = (1 << 30) if device.type == "cuda" else (64 << 20)
    chunk = 1
    while chunk * 2 * per_token <= budget:
        chunk *= 2
    return chunk


def sparse_attn_torch(attend, inp, s: dict, chunk: int) -> torch.Tensor:
    """Vectorised PyTorch block-sparse attention; ``attend`` is ``_attend_chunk`` eager or compiled."""
    cache = inp.cache
    q, ids, table, k_scale, v_scale = s["q"], s["topk_idx"], s["block_table"], s["k_scale"], s["v_scale"]
    tok_seq = inp.seq_lens.long()[inp.req]
    T = q.shape[0]
    if T <= chunk:
        return attend(
            q, cache, k_scale, v_scale, ids, table, inp.req, inp.pos, tok_seq, inp.sm_scale, inp.storage_dtype
        )
    outs = [
        attend(
            q[a : a + chunk],
            cache,
            k_scale,
            v_scale,
            ids[:, a : a + chunk],
            table,
            inp.req[a : a + chunk],
            inp.pos[a : a + chunk],
            tok_seq[a : a + chunk],
            inp.sm_scale,
            inp.storage_dtype,
        )
        for a in range(0, T, chunk)
    ]
    return torch.cat(outs)


def dense_causal_on_sample(q, k, v, tokens, q_lens, seq_lens, sm_scale) -> torch.Tensor:
    """float32 [n, Hq, D]: dense causal attention of sampled packed tokens over their request's
    whole context; q [T, Hq, D], k/v [B, Hkv, S, D] (the dense copies SDPA/Flex read)."""
    Hq, D = q.shape[1:]
    Hkv = k.shape[1]
    G = Hq // Hkv
    starts = torch.cumsum(torch.tensor((0,) + tuple(q_lens)), 0)
    outs = []
    for t in tokens.tolist():
        r = int(torch.searchsorted(starts, torch.tensor(t), right=True)) - 1
        p = seq_lens[r] - q_lens[r] + (t - int(starts[r]))
        keys = k[r, :, : p + 1].double().cpu()  # [Hkv, p+1, D]
        vals = v[r, :, : p + 1].double().cpu()
        logits = torch.einsum("hgd,hkd->hgk", q[t].double().cpu().view(Hkv, G, D), keys) * sm_scale
        outs.append(torch.einsum("hgk,hkd->hgd", torch.softmax(logits, -1), vals).reshape(Hq, D))
    return torch.stack(outs).float()
