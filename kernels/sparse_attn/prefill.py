"""Launcher of block-sparse prefill attention: one program per (tile of consecutive tokens, KV head).

Tokens of all requests are packed (``cu_seqlens_q``); each row finds its request by a binary
search over ``cu_seqlens_q`` inside the kernel, so no per-request host metadata (max query
length, batch size) becomes a Python constant, and a tile may straddle requests.
"""

import torch
import triton

from mm3_compile.kernels.sparse_attn.common import launch_sparse_attn
from mm3_compile.platform import FP8Format

# Rows (token x query head) per program: 128 fills a tensor-core tile while the tokens' top-k
# lists still overlap (neighbouring queries share their own and local blocks).
PREFILL_ROWS = 128
MAX_BLOCK_Q = 16


def prefill_block_q(G: int) -> int:
    """Consecutive query tokens per program: G=16 -> 8, G<=8 -> 16 (rows = tokens x pow2(G))."""
    return max(1, min(MAX_BLOCK_Q, PREFILL_ROWS // triton.next_power_of_2(int(G))))


def sparse_attn_prefill(
    q: torch.Tensor,  # [total_q, Hq, D] bf16/fp16
    kv_cache: torch.Tensor,  # [num_blocks, Hkv, 128, 2D] storage-dtype view (typed FP8 for FP8 caches)
    fmt: FP8Format | None,
    topk_idx: torch.Tensor,  # [Hkv, total_q, T] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    sm_scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    scale_mode: int,
) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [total_q, Hq, D], every row written
    T = topk_idx.shape[2]
    Hq, Hkv = q.shape[1], kv_cache.shape[1]
    launch_sparse_attn(
        q, kv_cache, fmt, topk_idx, block_table, cu_seqlens_q, seq_lens, sm_scale, k_scale, v_scale, scale_mode,
        out, None, q_per_req=1, num_splits=1, blocks_per_split=T, block_q=prefill_block_q(Hq // Hkv),
    )  # fmt: skip
    return out
