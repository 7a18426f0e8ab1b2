"""``mm3::sparse_attn_prefill`` and ``mm3::sparse_attn_decode``: block-sparse GQA attention over the paged cache.

``mm3::sparse_attn_decode_with_workspace`` is the decode op for callers that keep a zeroed int32
workspace (:func:`decode_workspace`; the attention layer's buffer): its split merge counts arrivals there
instead of in counters the call zeroes (a memset in every compiled step) or shares (eager calls).

The cache's storage flavour comes from the dtype authority for the cache's device (uint8 bytes are
viewed as it, a typed FP8 cache of another flavour is refused), asked in the real implementation
and in the fake alike.  K/V scales apply to FP8 caches only (bf16/fp16 caches are read as is).
"""

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from mm3_compile.contract import LOG2E, PAGE_SIZE
from mm3_compile.kernels._launch import eager_launches, require_kernel_device
from mm3_compile.kernels.sparse_attn import decode as decode_kernels
from mm3_compile.kernels.sparse_attn import prefill as prefill_kernels
from mm3_compile.ops._checks import (
    check_cu_seqlens_values,
    check_finite,
    check_index_vector,
    check_last_dim_contiguous,
    check_request_values,
    check_same_device,
    check_tensor,
    check_topk_values,
    values_checked,
)
from mm3_compile.ops._kv import kv_scale_mode, resolve_cache_view

MODEL_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
# The kernels scale logits by sm_scale * log2(e) in fp32: a larger |sm_scale| would be inf there.
MAX_SM_SCALE = torch.finfo(torch.float32).max / LOG2E


def _check_common(q, kv_cache, topk_idx, block_table, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale):
    """Validation shared by both ops; returns (typed cache view, FP8 format or None, scale mode)."""
    check_finite("sm_scale", sm_scale)
    if abs(sm_scale) > MAX_SM_SCALE:
        raise ValueError(f"sm_scale: expected |sm_scale| <= {MAX_SM_SCALE:.6g} (fp32 logits), got {sm_scale}")
    check_tensor("q", q, dtypes=MODEL_DTYPES, ndim=3)
    check_tensor("kv_cache", kv_cache, ndim=4)
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int32,), ndim=3)
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1)
    check_index_vector("seq_lens", seq_lens)
    check_same_device("q", q, kv_cache=kv_cache, topk_idx=topk_idx, block_table=block_table, seq_lens=seq_lens)
    total_q, Hq, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head dim must be one of {HEAD_DIMS}, got {D}")
    check_last_dim_contiguous("q", q)
    num_blocks, Hkv, page, width = kv_cache.shape
    if page != PAGE_SIZE or width != 2 * D:
        raise ValueError(
            f"kv_cache: expected logical shape [num_blocks, Hkv, {PAGE_SIZE}, 2*D={2 * D}] (K then V), "
            f"got {list(kv_cache.shape)}"
        )
    check_last_dim_contiguous("kv_cache", kv_cache)
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q: the number of query heads ({Hq}) must be a multiple of the KV heads ({Hkv})")
    if not 1 <= Hq // Hkv <= 16:
        raise ValueError(f"q: query heads per KV head must be in [1, 16], got {Hq // Hkv}")
    if topk_idx.shape[0] != Hkv or topk_idx.shape[1] != total_q or topk_idx.shape[2] < 1:
        raise ValueError(f"topk_idx: expected shape [Hkv={Hkv}, total_q={total_q}, T>=1], got {list(topk_idx.shape)}")
    num_reqs = seq_lens.shape[0]
    if block_table.shape[0] != num_reqs:
        raise ValueError(
            f"block_table: expected {num_reqs} rows (one per request in seq_lens), got {block_table.shape[0]}"
        )
    view, fmt = resolve_cache_view(kv_cache, kv_cache_dtype, q.dtype)
    if fmt is None and view.dtype != q.dtype:
        # an explicit half spec of the other half type: the kernels would dot q with K of another dtype
        raise TypeError(
            f"q: a {view.dtype} cache (kv_cache_dtype={kv_cache_dtype!r}) is read by {view.dtype} queries, got {q.dtype}"
        )
    scale_mode = kv_scale_mode(k_scale, v_scale, Hkv, num_blocks * PAGE_SIZE, q.device)
    if k_scale is not None:
        if fmt is None:
            raise ValueError(
                f"k_scale/v_scale: scales are only read from an FP8 cache (kv_cache_dtype 'fp8'), got a "
                f"{view.dtype} cache"
            )
    return view, fmt, scale_mode


def _check_prefill(
    q, kv_cache, topk_idx, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale
):
    checked = _check_common(q, kv_cache, topk_idx, block_table, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1)
    check_index_vector("cu_seqlens_q", cu_seqlens_q)
    check_same_device("q", q, cu_seqlens_q=cu_seqlens_q)
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q: expected num_reqs + 1 = {seq_lens.shape[0] + 1} entries, got {cu_seqlens_q.shape[0]}"
        )
    if guard_or_false(seq_lens.shape[0] == 0) and guard_or_false(q.shape[0] != 0):
        raise ValueError(f"seq_lens: a prefill of total_q={q.shape[0]} tokens needs at least one request, got 0")
    if values_checked(block_table, cu_seqlens_q, seq_lens, topk_idx):
        q_lens = check_cu_seqlens_values(cu_seqlens_q, q.shape[0])
        check_request_values(block_table, seq_lens, q_lens, kv_cache.shape[0])
        check_topk_values(topk_idx)
    return checked


def _check_decode(q, kv_cache, topk_idx, block_table, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale):
    checked = _check_common(q, kv_cache, topk_idx, block_table, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale)
    num_reqs, total_q = seq_lens.shape[0], q.shape[0]
    if num_reqs == 0 or total_q == 0 or total_q % num_reqs != 0:  # every request decodes >= 1 token
        raise ValueError(
            f"q: uniform decode needs total_q ({total_q}) to be a positive multiple of num_reqs ({num_reqs}, "
            "the length of seq_lens)"
        )
    if values_checked(block_table, seq_lens, topk_idx):
        q_lens = torch.full_like(seq_lens, total_q // num_reqs)
        check_request_values(block_table, seq_lens, q_lens, kv_cache.shape[0])
        check_topk_values(topk_idx)
    return checked


def decode_workspace(device: torch.device | str) -> torch.Tensor:
    """The zeroed int32 workspace ``sparse_attn_decode_with_workspace`` takes (16 KiB); every call leaves it zero.

    Args:
        device: where the decode calls run.

    Returns:
        ``[ARRIVAL_COUNTERS]`` (4096) int32 zeros.

    Examples:
        >>> self.register_buffer("decode_workspace", decode_workspace(device), persistent=False)  # doctest: +SKIP
    """
    return torch.zeros((decode_kernels.ARRIVAL_COUNTERS,), dtype=torch.int32, device=device)


def _check_workspace(workspace, q) -> None:
    check_tensor("workspace", workspace, dtypes=(torch.int32,), ndim=1)
    check_same_device("q", q, workspace=workspace)
    if workspace.shape[0] < decode_kernels.ARRIVAL_COUNTERS:
        raise ValueError(
            f"workspace: expected at least {decode_kernels.ARRIVAL_COUNTERS} int32 counters (decode_workspace), "
            f"got {workspace.shape[0]}"
        )
    check_index_vector("workspace", workspace)
    if values_checked(workspace) and workspace.any():
        i = int(workspace.nonzero()[0])
        raise ValueError(
            f"workspace: expected zeros (every decode call leaves its workspace zero), got {int(workspace[i])} at "
            f"index {i}: a call was interrupted, or the buffer is shared with a call running on another stream"
        )


@torch.library.custom_op("mm3::sparse_attn_prefill", mutates_args=())
def sparse_attn_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_idx: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [total_q, Hq, D] packed by cu_seqlens_q -> [total_q, Hq, D]; query i of request r sits at
    p = seq_lens[r] - q_len_r + i and attends to keys j <= p of its first min(T, p // 128 + 1) top-k blocks.

    Args:
        q: ``[total_q, Hq, D]`` bf16/fp16, ``Hq`` a multiple of ``Hkv``, D 64 or 128.
        kv_cache: ``[num_blocks, Hkv, 128, 2D]`` as written by ``kv_cache_write`` (same ``kv_cache_dtype``).
        topk_idx: ``[Hkv, total_q, T]`` int32 logical block ids per token and KV head (``index_topk``'s output);
            ``-1``, repeats and ids past the token's block are ignored.
        block_table: ``[num_reqs, max_blocks]`` int32; cu_seqlens_q: ``[num_reqs + 1]`` int32;
            seq_lens: ``[num_reqs]`` int32 KV lengths including this chunk.
        sm_scale: the softmax scale (usually ``D ** -0.5``).
        kv_cache_dtype, k_scale, v_scale: as given to ``kv_cache_write``.

    Returns:
        ``[total_q, Hq, D]`` in q's dtype.

    Examples:
        >>> topk = torch.ops.mm3.index_topk(index_q, index_cache, table, cu, seq_lens, 16, 0, 1)
        >>> out = torch.ops.mm3.sparse_attn_prefill(q, kv_cache, topk, table, cu, seq_lens, 128**-0.5, "fp8")
    """
    view, fmt, scale_mode = _check_prefill(
        q, kv_cache, topk_idx, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale
    )
    require_kernel_device("q", q)
    with eager_launches():
        return prefill_kernels.sparse_attn_prefill(
            q, view, fmt, topk_idx, block_table, cu_seqlens_q, seq_lens, sm_scale, k_scale, v_scale, scale_mode
        )


@sparse_attn_prefill.register_fake
def _(
    q,
    kv_cache,
    topk_idx,
    block_table,
    cu_seqlens_q,
    seq_lens,
    sm_scale,
    kv_cache_dtype="auto",
    k_scale=None,
    v_scale=None,
):
    _check_prefill(
        q, kv_cache, topk_idx, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale
    )
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _decode(q, kv_cache, topk_idx, block_table, seq_lens, workspace, sm_scale, kv_cache_dtype, k_scale, v_scale):
    view, fmt, scale_mode = _check_decode(
        q, kv_cache, topk_idx, block_table, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale
    )
    if workspace is not None:
        _check_workspace(workspace, q)
    require_kernel_device("q", q)
    with eager_launches():
        return decode_kernels.sparse_attn_decode(
            q, view, fmt, topk_idx, block_table, seq_lens, sm_scale, k_scale, v_scale, scale_mode, counters=workspace
        )


@torch.library.custom_op("mm3::sparse_attn_decode", mutates_args=())
def sparse_attn_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_idx: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Uniform decode: q [num_reqs * q_per_req, Hq, D] -> [total_q, Hq, D]; token b is offset b % q_per_req
    of request b // q_per_req at p = seq_len - q_per_req + offset; seq_len 0 (padding) gives zeros.

    Args:
        q: ``[num_reqs * q_per_req, Hq, D]``, the same number of new tokens for every request.
        kv_cache, topk_idx, block_table, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale: as for
            ``sparse_attn_prefill`` (no ``cu_seqlens_q``: the batch is uniform).

    Returns:
        ``[num_reqs * q_per_req, Hq, D]`` in q's dtype.

    Examples:
        >>> out = torch.ops.mm3.sparse_attn_decode(q, kv_cache, topk, table, seq_lens, 128**-0.5)  # q [B, Hq, D]
    """
    return _decode(q, kv_cache, topk_idx, block_table, seq_lens, None, sm_scale, kv_cache_dtype, k_scale, v_scale)


@sparse_attn_decode.register_fake
def _(q, kv_cache, topk_idx, block_table, seq_lens, sm_scale, kv_cache_dtype="auto", k_scale=None, v_scale=None):
    _check_decode(q, kv_cache, topk_idx, block_table, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


# A separate op, not an optional argument of sparse_attn_decode: Inductor (torch 2.13) fails on an optional
# mutated argument passed as None (bench/NOTES.md, session 29).
@torch.library.custom_op("mm3::sparse_attn_decode_with_workspace", mutates_args=("workspace",))
def sparse_attn_decode_with_workspace(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_idx: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    workspace: torch.Tensor,
    sm_scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sparse_attn_decode`` whose split merge counts arrivals in ``workspace`` (zero on entry, zero on return).

    The outputs are bit-identical to ``sparse_attn_decode``'s.  Calls that may run at the same time (other
    streams, other threads) need workspaces of their own.

    Args:
        q, kv_cache, topk_idx, block_table, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale: as for
            ``sparse_attn_decode``.
        workspace: ``[>= 4096]`` int32 zeros on q's device (:func:`decode_workspace`), e.g. a module buffer.

    Returns:
        ``[num_reqs * q_per_req, Hq, D]`` in q's dtype.

    Examples:
        >>> ws = mm3_compile.ops.decode_workspace(q.device)
        >>> out = torch.ops.mm3.sparse_attn_decode_with_workspace(q, kv_cache, topk, table, seq_lens, ws, 128**-0.5)
    """
    return _decode(q, kv_cache, topk_idx, block_table, seq_lens, workspace, sm_scale, kv_cache_dtype, k_scale, v_scale)


@sparse_attn_decode_with_workspace.register_fake
def _(
    q, kv_cache, topk_idx, block_table, seq_lens, workspace, sm_scale, kv_cache_dtype="auto", k_scale=None, v_scale=None
):
    _check_decode(q, kv_cache, topk_idx, block_table, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale)
    _check_workspace(workspace, q)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
