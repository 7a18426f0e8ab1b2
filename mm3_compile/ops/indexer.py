"""``mm3::index_topk``: lightning-indexer block selection for prefill and decode alike.

Per query token (position ``p = seq_len - q_len + i`` in its request) and index head: the
``min(topk, p // 128 + 1)`` best visible 128-token blocks by max raw dot product, forced init /
local blocks first, ties toward the lower block id, -1 padded.  Token -> request mapping and
positions are computed on the device, so the output shape and the graph depend only on tensor
shapes (no host syncs, no recompiles when query lengths vary).

The index-K cache is in index_q's dtype (``index_cache_dtype="auto"``) or FP8 (``"fp8"``: the dtype
authority's e4m3 flavour for the cache's device, typed or as uint8 bytes), optionally with per-slot key
scales.  Without scales the FP8 values are ranked as stored: a cache written with one positive scalar
scale per layer (the model's rule, see ``M3Attention``) ranks exactly as its dequantized keys would.
"""

import torch

from mm3_compile import platform
from mm3_compile.contract import PAGE_SIZE
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

MIN_INDEX_DIM, MAX_INDEX_DIM = 16, 256  # tl.dot needs K >= 16; one page tile stays in registers up to 256


def _resolve_index_cache(index_q, index_k_cache, index_cache_dtype):
    """(the cache as the kernel reads it, FP8 format or None) for ``index_cache_dtype``."""
    if not isinstance(index_cache_dtype, str) or index_cache_dtype not in platform.KV_CACHE_SPECS:
        raise ValueError(f"index_cache_dtype: expected one of {platform.KV_CACHE_SPECS}, got {index_cache_dtype!r}")
    wanted = platform.resolve_kv_cache_dtype(index_cache_dtype, index_k_cache.device, index_q.dtype)
    if not platform.is_fp8(wanted):
        if wanted != index_q.dtype or index_k_cache.dtype != wanted:
            raise TypeError(
                f"index_k_cache: expected the dtype of index_q ({index_q.dtype}) for "
                f"index_cache_dtype={index_cache_dtype!r}, got {index_k_cache.dtype}"
            )
        return index_k_cache, None
    if index_k_cache.dtype == torch.uint8:
        return index_k_cache.view(wanted), platform.fp8_format(wanted)
    if index_k_cache.dtype != wanted:
        target = platform.platform_for(index_k_cache.device).target
        raise TypeError(
            f"index_k_cache: index_cache_dtype={index_cache_dtype!r} on platform {target} stores {wanted}, got a "
            f"{index_k_cache.dtype} cache; pass uint8 bytes or a {wanted} cache"
        )
    return index_k_cache, platform.fp8_format(wanted)


def _check_index_topk(
    index_q,
    index_k_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    topk,
    init_blocks,
    local_blocks,
    index_cache_dtype="auto",
    index_k_scale=None,
):
    """Validate every argument; returns (cache as the kernel reads it, FP8 format or None)."""
    check_tensor("index_q", index_q, dtypes=FLOAT_DTYPES, ndim=3)
    head_dim = index_q.shape[2]
    if not MIN_INDEX_DIM <= head_dim <= MAX_INDEX_DIM:
        raise ValueError(f"index_q: index head dim must be in [{MIN_INDEX_DIM}, {MAX_INDEX_DIM}], got {head_dim}")
    check_last_dim_contiguous("index_q", index_q)
    check_tensor("index_k_cache", index_k_cache, ndim=3)
    cache, fmt = _resolve_index_cache(index_q, index_k_cache, index_cache_dtype)
    if index_k_scale is not None:
        check_tensor("index_k_scale", index_k_scale, dtypes=(torch.float32,), ndim=1)
        check_index_vector("index_k_scale", index_k_scale)  # read as ptr + slot
        if index_k_scale.shape[0] != index_k_cache.shape[0] * PAGE_SIZE:
            raise ValueError(
                f"index_k_scale: expected one scale per slot, [num_blocks * {PAGE_SIZE}] = "
                f"[{index_k_cache.shape[0] * PAGE_SIZE}], got {list(index_k_scale.shape)}"
            )
        if fmt is None:
            raise ValueError(
                "index_k_scale: key scales are only read from an FP8 index cache (index_cache_dtype='fp8')"
            )
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
        **({} if index_k_scale is None else {"index_k_scale": index_k_scale}),
    )
    if topk < 1:
        raise ValueError(f"topk: expected >= 1, got {topk}")
    if init_blocks < 0 or local_blocks < 0:
        raise ValueError(f"init_blocks/local_blocks: expected >= 0, got {init_blocks}/{local_blocks}")
    if values_checked(block_table, cu_seqlens_q, seq_lens):
        q_lens = check_cu_seqlens_values(cu_seqlens_q, index_q.shape[0])
        check_request_values(block_table, seq_lens, q_lens, index_k_cache.shape[0])
    return cache, fmt


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
    index_cache_dtype: str = "auto",
    index_k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """index_q [total_q, Hidx, Didx], index_k_cache [num_blocks, 128, Didx] -> int32 [Hidx, total_q, topk].

    block_table [num_reqs, max_blocks], cu_seqlens_q [num_reqs + 1], seq_lens [num_reqs] (KV length
    including this chunk), all int32.  Returned ids are logical block indices of the request
    (map them through block_table); only the first ``p // 128 + 1`` table entries are read.  Order:
    forced init blocks, forced local blocks, then descending block score (ties: lower id; NaN as -1e30).
    ``index_cache_dtype``: ``"auto"`` (index_q's dtype) or an FP8 spec (``"fp8"``); ``index_k_scale``: optional
    fp32 ``[num_blocks * 128]`` per-slot key scales of an FP8 cache.

    Args:
        index_q: ``[total_q, Hidx, Didx]`` bf16/fp16/fp32, packed by ``cu_seqlens_q``.
        index_k_cache: ``[num_blocks, 128, Didx]`` in index_q's dtype, or FP8 (typed or uint8 bytes) with
            ``index_cache_dtype="fp8"``.
        block_table, cu_seqlens_q, seq_lens: int32 request metadata, as for ``sparse_attn_prefill``.
        topk: blocks per list; init_blocks / local_blocks: forced leading / trailing blocks of each query.
        index_cache_dtype: ``"auto"`` or ``"fp8"``; index_k_scale: optional ``[num_blocks * 128]`` fp32.

    Returns:
        ``[Hidx, total_q, topk]`` int32 logical block ids, ``-1`` padded.

    Examples:
        >>> topk = torch.ops.mm3.index_topk(index_q, index_cache, block_table, cu_seqlens_q, seq_lens, 16, 0, 1)
        >>> topk.shape  # [Hidx, total_q, 16]
    """
    cache, fmt = _check_index_topk(
        index_q,
        index_k_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        topk,
        init_blocks,
        local_blocks,
        index_cache_dtype,
        index_k_scale,
    )
    require_kernel_device("index_q", index_q)
    with eager_launches():
        return kernels.index_topk(
            index_q, cache, block_table, cu_seqlens_q, seq_lens, topk, init_blocks, local_blocks, fmt, index_k_scale
        )


@index_topk.register_fake
def _(
    index_q,
    index_k_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    topk=16,
    init_blocks=0,
    local_blocks=1,
    index_cache_dtype="auto",
    index_k_scale=None,
):
    _check_index_topk(
        index_q,
        index_k_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        topk,
        init_blocks,
        local_blocks,
        index_cache_dtype,
        index_k_scale,
    )
    return index_q.new_empty((index_q.shape[1], index_q.shape[0], topk), dtype=torch.int32)
