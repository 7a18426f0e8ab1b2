"""Pure-PyTorch reference for the lightning-indexer top-k, written from the contract (spec §4.1).

Per request: gather the request's index-K pages (FP8 caches decoded by torch's own conversion,
times the optional per-slot key scale), score every query against every key in float64, mask keys
after the query's position, take the per-block max (NaN-propagating) and apply NaN -> -1e30.  The
order is then total: forced blocks first whatever their scores -- init blocks (``b < init_blocks``)
before local ones (``b >= nb(p) - local_blocks``; a block that is both counts as local), each group
in ascending block order -- then the other blocks by descending score, equal scores in ascending
block order.  The first ``min(topk, nb(p))`` ids are kept, -1 after.
"""

import torch

from mm3_compile.contract import PAGE_SIZE

NAN_SCORE = -1e30
INIT_CLASS, LOCAL_CLASS, FREE_CLASS = 2, 1, 0  # sort classes: forced init, forced local, by score


def index_block_scores_ref(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    index_k_scale: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per request: (positions [q_len] int64, raw block scores [Hidx, q_len, nblocks] float64).

    ``index_k_scale``: optional per-slot key scales ``[num_blocks * 128]`` (keys are multiplied by them).
    Entries of blocks a query cannot see are -inf.
    """
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    head_dim = index_q.shape[-1]
    result = []
    for r in range(block_table.shape[0]):
        q = index_q[cu[r] : cu[r + 1]].double()  # [q_len, Hidx, Didx]
        q_len, seq_len = q.shape[0], lens[r]
        positions = torch.arange(seq_len - q_len, seq_len)  # [q_len]
        n_blocks = -(-seq_len // PAGE_SIZE)
        pages = block_table[r, :n_blocks].long()
        keys = index_k_cache[pages].reshape(-1, head_dim).double()  # [n_blocks * 128, Didx]
        if index_k_scale is not None:
            slots = (pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten()
            keys = keys * index_k_scale[slots].double()[:, None]
        scores = torch.einsum("qhd,kd->hqk", q, keys)  # [Hidx, q_len, n_blocks * 128]
        key_pos = torch.arange(n_blocks * PAGE_SIZE)
        causal = key_pos[None, :] <= positions[:, None]  # [q_len, n_blocks * 128]
        scores = scores.masked_fill(~causal, float("-inf"))
        block_scores = scores.reshape(*scores.shape[:2], n_blocks, PAGE_SIZE).amax(dim=-1)
        result.append((positions, block_scores))
    return result


def index_topk_ref(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int = 16,
    init_blocks: int = 0,
    local_blocks: int = 1,
    index_k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """-> int32 [Hidx, total_q, topk] logical block ids: forced blocks first, then descending score,
    ties toward the lower id."""
    total_q, num_heads = index_q.shape[:2]
    out = torch.full((num_heads, total_q, topk), -1, dtype=torch.int32)
    per_request = index_block_scores_ref(index_q, index_k_cache, block_table, cu_seqlens_q, seq_lens, index_k_scale)
    for start, (positions, block_scores) in zip(cu_seqlens_q.tolist(), per_request):
        for i, p in enumerate(positions.tolist()):
            nb = max(p // PAGE_SIZE + 1, 0)
            if nb == 0:
                continue
            s = block_scores[:, i, :nb]  # [Hidx, nb]
            s = torch.where(torch.isnan(s), NAN_SCORE, s)
            blocks = torch.arange(nb)
            group = torch.full((nb,), FREE_CLASS)
            group[blocks < init_blocks] = INIT_CLASS
            group[blocks >= nb - local_blocks] = LOCAL_CLASS
            # two stable sorts: by score (ties keep ascending ids; forced blocks all tie), then by class
            s = torch.where(group > FREE_CLASS, 0.0, s)
            by_score = torch.sort(s, dim=-1, descending=True, stable=True).indices  # [Hidx, nb]
            by_class = torch.sort(group[by_score], dim=-1, descending=True, stable=True).indices
            order = torch.gather(by_score, 1, by_class)
            keep = min(topk, nb)
            out[:, start + i, :keep] = order[:, :keep].to(torch.int32)
    return out
