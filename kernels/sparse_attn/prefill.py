"""Launcher of block-sparse prefill attention.

Two schedules (``prefill_schedule``):

* *KV-centric* (``kv_centric.py``, NVIDIA and the CPU interpreter, lists of at most
  ``KV_CENTRIC_MAX_SLOTS`` slots): the (token, slot) pairs are grouped by the block they name and
  each block is loaded once for all of them; every dot row is useful (about twice the union walk's
  throughput on independent random lists, bench/NOTES.md).
* *Union walk* (``union.py``, one program per tile of consecutive tokens and KV head): a tile
  attends the union of its tokens' lists.  It wastes nothing when every list names every visible
  block (the dense layers pass such lists, T = the block-table width).  Used for longer lists and
  on ROCm, whose 64 KB of LDS cannot hold a converted block and a query tile.

Tokens of all requests are packed (``cu_seqlens_q``); rows find their request by a binary search
over ``cu_seqlens_q`` inside the kernels, so no per-request host metadata (max query length, batch
size) becomes a Python constant.
"""

import torch
import triton

from mm3_compile import platform
from mm3_compile.kernels.sparse_attn.kv_centric import sparse_attn_prefill_kv_centric
from mm3_compile.kernels.sparse_attn.union import launch_sparse_attn
from mm3_compile.platform import FP8Format

# Union walk (ROCm, and lists longer than KV_CENTRIC_MAX_SLOTS).
# Rows (token x query head) per program.  A tile walks the union of its tokens' lists, so its size
# trades tensor-core tile height against wasted rows: with lists drawn from few blocks (short contexts)
# 128-row tiles share most of them; with many candidate blocks every token adds ~15 new blocks to the
# union (8 tokens: ~84 of 144 blocks, 16 useful per token) and the smallest tile a dot takes (16 rows:
# one token at TP1, two at TP8) does the least wasted work.  Measured (bench/NOTES.md): at 64 table
# blocks bf16 is best at 128 rows / 8 warps and FP8 at 64 rows / 4 warps (its per-block conversion
# favours fewer tiles); at 144 blocks 16-row tiles / 4 warps are best for both.
PREFILL_ROWS = 128
FP8_PREFILL_ROWS = 64
WIDE_TABLE_BLOCKS = 96
WIDE_TABLE_ROWS = 16
MAX_BLOCK_Q = 16
# KV-centric prefill's workspace is T x the output (a partial per slot) and its duplicate check a
# [32, pow2(T), pow2(T)] tile: up to 32 slots (MiniMax-M3 selects 16; only T = 16 was timed).  Longer
# lists, e.g. the dense layers' lists of every block (T = the block-table width), take the union
# walk, which wastes nothing on lists that name every visible block.
KV_CENTRIC_MAX_SLOTS = 32


def prefill_schedule(device: torch.device, T: int) -> str:
    """``"kv_centric"``, or ``"union"`` on ROCm and for lists longer than ``KV_CENTRIC_MAX_SLOTS`` (see
    the module docstring).  From the hardware and T only, never from sizes that vary between calls:
    T is already a compile-time constant of both launchers, so a graph traced at one size computes
    what eager computes at every size (compiled == eager bit for bit; the two schedules round
    differently)."""
    if device.type == "cuda" and platform.hardware_vendor(device) == "amd":
        return "union"
    return "kv_centric" if int(T) <= KV_CENTRIC_MAX_SLOTS else "union"


def prefill_block_q(G: int, table_blocks, fp8: bool) -> int:
    """Consecutive query tokens per program, from the head grouping, the block-table width (the most
    blocks a list can choose from) and the KV dtype."""
    if table_blocks >= WIDE_TABLE_BLOCKS:
        rows = WIDE_TABLE_ROWS
    else:
        rows = FP8_PREFILL_ROWS if fp8 else PREFILL_ROWS
    return max(1, min(MAX_BLOCK_Q, rows // triton.next_power_of_2(int(G))))


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
    if prefill_schedule(q.device, topk_idx.shape[2]) == "kv_centric":
        return sparse_attn_prefill_kv_centric(
            q, kv_cache, fmt, topk_idx, block_table, cu_seqlens_q, seq_lens, sm_scale, k_scale, v_scale, scale_mode
        )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [total_q, Hq, D], every row written
    T = topk_idx.shape[2]
    Hq, Hkv = q.shape[1], kv_cache.shape[1]
    launch_sparse_attn(
        q,
        kv_cache,
        fmt,
        topk_idx,
        block_table,
        cu_seqlens_q,
        seq_lens,
        sm_scale,
        k_scale,
        v_scale,
        scale_mode,
        out,
        None,
        q_per_req=1,
        num_splits=1,
        blocks_per_split=T,
        block_q=prefill_block_q(Hq // Hkv, block_table.shape[1], fmt is not None),
    )
    return out
