"""``mm3::index_topk``: lightning-indexer block selection for prefill and decode alike.

Per query token (position ``p = seq_len - q_len + i`` in its request) and index head: the
``min(topk, p // 128 + 1)`` best visible 128-token blocks by max raw dot product, forced init /
local blocks first, ties toward the lower block id, -1 padded.  Token -> request mapping and
positions are computed on the device, so the output shape and the graph depend only on tensor
shapes (no host syncs, no recompiles when query lengths vary).
"""

import torch

from mm3_compile.kernels._launch import eager_launches, require_kernel_device
from mm3_compile.kernels.indexer import topk as kernels
from mm3_compile.ops._checks import (
    FLOAT_DTYPES,
    check_cu_seqlens_values,
    check_index_vector,
    check_last_dim_contiguous,
    check_request_values,
    check_same_device,
    check_tensor,
    values_checked,
)
from mm3_compile.contract import PAGE_SIZE

MIN_INDEX_DIM, MAX_INDEX_DIM = 16, 256  # tl.dot needs K >= 16; one page tile stays in registers up to 256


def _check_index_topk(index_q, index_k_cache, block_table, cu_seqlens_q, seq_lens, topk, init_blocks, local_blocks):
    check_tensor("index_q", index_q, dtypes=FLOAT_DTYPES, ndim=3)
    head_dim = index_q.shape[2]
    if not MIN_INDEX_DIM <= head_dim <= MAX_INDEX_DIM:
        raise ValueError(f"index_q: index head dim must be in [{MIN_INDEX_DIM}, {MAX_INDEX_DIM}], got {head_dim}")
    check_last_dim_contiguous("index_q", index_q)
    check_tensor("index_k_cache", index_k_cache, ndim=3)
    if index_k_cache.dtype != index_q.dtype:
        raise TypeError(f"index_k_cache: expected the dtype of index_q ({index_q.dtype}), got {index_k_cache.dtype}")
    if index_k_cache.shape[1] != PAGE_SIZE or index_k_cache.shape[2] != head_dim:
        raise ValueError(
            f"index_k_cache: expected shape [num_blocks, {PAGE_SIZE}, Didx={head_dim}], got {list(index_k_cache.shape)}"
        )
    check_last_dim_contiguous("index_k_cache", index_k_cache)
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1)
    check_index_vector("cu_seqlens_q", cu_seqlens_q)
    check_index_vector("seq_lens", seq_lens)
    num_reqs = block_table.shape[0]
    if cu_seqlens_q.shape[0] != num_reqs + 1:
        raise ValueError(
            f"cu_seqlens_q: expected num_reqs + 1 = {num_reqs + 1} entries (block_table has {num_reqs} rows), "
            f"got {cu_seqlens_q.shape[0]}"
        )
    if seq_lens.shape[0] != num_reqs:
        raise ValueError(
            f"seq_lens: expected num_reqs = {num_reqs} entries (one per block_table row), got {seq_lens.shape[0]}"
        )
    check_same_device(
        "index_q",
        index_q,
        index_k_cache=index_k_cache,
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
    )
    if topk < 1:
        raise ValueError(f"topk: expected >= 1, got {topk}")
    if init_blocks < 0 or local_blocks < 0:
        raise ValueError(f"init_blocks/local_blocks: expected >= 0, got {init_blocks}/{local_blocks}")
    if values_checked(block_table, cu_seqlens_q, seq_lens):
        q_lens = check_cu_seqlens_values(cu_seqlens_q, index_q.shape[0])
        check_request_values(block_table, seq_lens, q_lens, index_k_cache.shape[0])


@torch.library.custom_op("mm3::index_topk", mutates_args=())
def index_topk(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int = 16,
    init_blocks: int = 0,
    local_blocks: int = 1,
) -> torch.Tensor:
    """index_q [total_q, Hidx, Didx], index_k_cache [num_blocks, 128, Didx] -> int32 [Hidx, total_q, topk].

    block_table [num_reqs, max_blocks], cu_seqlens_q [num_reqs + 1], seq_lens [num_reqs] (KV length
    including this chunk), all int32.  Returned ids are logical block indices of the request
    (map them through block_table); only the first ``p // 128 + 1`` table entries are read.
    """
    _check_index_topk(index_q, index_k_cache, block_table, cu_seqlens_q, seq_lens, topk, init_blocks, local_blocks)
    require_kernel_device("index_q", index_q)
    with eager_launches():
        return kernels.index_topk(
            index_q, index_k_cache, block_table, cu_seqlens_q, seq_lens, topk, init_blocks, local_blocks
        )


@index_topk.register_fake
def _(index_q, index_k_cache, block_table, cu_seqlens_q, seq_lens, topk=16, init_blocks=0, local_blocks=1):
    _check_index_topk(index_q, index_k_cache, block_table, cu_seqlens_q, seq_lens, topk, init_blocks, local_blocks)
    return index_q.new_empty((index_q.shape[1], index_q.shape[0], topk), dtype=torch.int32)
