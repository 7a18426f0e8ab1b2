"""Launcher of block-sparse prefill attention: one program per (query token, KV head), no split.

Tokens of all requests are packed (``cu_seqlens_q``); each program finds its request by a binary
search over ``cu_seqlens_q`` inside the kernel, so no per-request host metadata (max query
length, batch size) becomes a Python constant.
"""

import torch

from mm3_compile.kernels.sparse_attn.common import launch_sparse_attn
from mm3_compile.platform import FP8Format


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
    launch_sparse_attn(
        q, kv_cache, fmt, topk_idx, block_table, cu_seqlens_q, seq_lens, sm_scale, k_scale, v_scale, scale_mode,
        out, None, q_per_req=1, num_splits=1, slots_per_split=T,
    )  # fmt: skip
    return out
