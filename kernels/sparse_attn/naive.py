"""Pure-PyTorch reference of block-sparse GQA attention, written from the contract (§5.2), not the kernels.

For every (query token, KV head) it gathers the pages of the selected blocks, dequantises them in
float64 (``.view(storage dtype).double() * scale``), masks explicitly and applies a natural-base
softmax.  Slots past ``min(T, p // 128 + 1)``, ids that are negative, beyond ``p // 128`` or beyond
the block table, and pages outside the cache are ignored; the selected blocks are a set (an id
listed twice counts once).  A row that
sees no key is 0.  The storage dtype is an argument so tests can also decode bytes the wrong way
(upstream #45562) as a negative control.
"""

import torch

PAGE = 128


def sparse_attn_ref(
    q: torch.Tensor,  # [total_q, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, Hkv, 128, 2D], any strides; typed, or uint8 bytes of storage_dtype
    topk_idx: torch.Tensor,  # [Hkv, total_q, T] logical block ids
    block_table: torch.Tensor,  # [num_reqs, max_blocks]
    cu_seqlens_q: torch.Tensor,  # [num_reqs + 1]
    seq_lens: torch.Tensor,  # [num_reqs]
    sm_scale: float,
    storage_dtype: torch.dtype,
    k_scale: torch.Tensor | None = None,  # 1 element, or [Hkv, num_blocks * 128] by physical slot
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 output [total_q, Hq, D]."""
    total_q, Hq, D = q.shape
    num_blocks, Hkv = kv_cache.shape[:2]
    G = Hq // Hkv
    T = topk_idx.shape[2]
    max_blocks = block_table.shape[1]
    cache = kv_cache.view(storage_dtype) if kv_cache.dtype == torch.uint8 else kv_cache
    cache = cache.cpu().double()  # [num_blocks, Hkv, 128, 2D]
    keys_all, values_all = cache[..., :D], cache[..., D:]
    if k_scale is not None:
        if k_scale.numel() == 1:
            keys_all = keys_all * k_scale.cpu().double().reshape(())
            values_all = values_all * v_scale.cpu().double().reshape(())
        else:  # scale[h, page * 128 + offset]
            keys_all = keys_all * k_scale.cpu().double().reshape(Hkv, num_blocks, PAGE).transpose(0, 1)[..., None]
            values_all = values_all * v_scale.cpu().double().reshape(Hkv, num_blocks, PAGE).transpose(0, 1)[..., None]

    out = torch.zeros(total_q, Hq, D, dtype=torch.float64)
    qd = q.double().cpu()
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    table = block_table.cpu()
    ids = topk_idx.cpu()
    offsets = torch.arange(PAGE)
    for r in range(len(lens)):
        q_len = cu[r + 1] - cu[r]
        for i in range(q_len):
            t = cu[r] + i
            p = lens[r] - q_len + i
            if p < 0:
                continue
            n = min(T, p // PAGE + 1)
            for h in range(Hkv):
                listed = dict.fromkeys(ids[h, t, :n].tolist())  # a set of blocks: a repeated id counts once
                blocks = [b for b in listed if 0 <= b <= p // PAGE and b < max_blocks]
                pages = [table[r, b].item() for b in blocks]
                kept = [(b, pg) for b, pg in zip(blocks, pages) if 0 <= pg < num_blocks]
                if not kept:
                    continue
                positions = torch.cat([b * PAGE + offsets for b, _ in kept])  # [n_keys]
                page_ids = torch.tensor([pg for _, pg in kept])
                k = keys_all[page_ids, h].reshape(-1, D)  # [n_keys, D]
                v = values_all[page_ids, h].reshape(-1, D)
                visible = (positions <= p) & (positions < lens[r])
                logits = qd[t, h * G : (h + 1) * G] @ k.T * sm_scale  # [G, n_keys]
                logits = logits.masked_fill(~visible, float("-inf"))
                out[t, h * G : (h + 1) * G] = torch.softmax(logits, dim=-1) @ v
    return out.float().to(q.device)


def sparse_attn_decode_ref(
    q, kv_cache, topk_idx, block_table, seq_lens, sm_scale, storage_dtype, k_scale=None, v_scale=None
):
    """Uniform decode: ``total_q // num_reqs`` consecutive tokens per request."""
    num_reqs = seq_lens.shape[0]
    q_per_req = q.shape[0] // num_reqs
    cu = torch.arange(num_reqs + 1, dtype=torch.int32) * q_per_req
    return sparse_attn_ref(q, kv_cache, topk_idx, block_table, cu, seq_lens, sm_scale, storage_dtype, k_scale, v_scale)
