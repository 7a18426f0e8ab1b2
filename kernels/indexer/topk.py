"""Lightning indexer: block scores of every query over its visible 128-token blocks, then top-k.

Two kernels, both with shape-derived grids (nothing depends on the longest query or sequence):

1. ``_index_score_kernel``, grid ``(cdiv(total_q, BLOCK_Q) + num_reqs, max_blocks)``: a program
   owns one query tile -- rows ``[i0, i0 + BLOCK_Q)`` of one request, found by a binary search
   over the per-request tile counts -- and logical block ``b``.  Surplus tiles, and blocks lying
   wholly after the tile's last query position, do nothing -- so the block table is only read
   for blocks some query can see.  The index-K page ``[128, Didx]`` is loaded once and scored
   against every index head:
   ``S[h, t, b] = max_{j in b, j <= p(t)} <q_h(t), k(j)>`` (fp32 accumulation, no softmax scale).
   A block with a NaN token score scores NaN (NaN-propagating max, like ``torch.amax``).  The
   block-0 program of each tile also records the query's absolute position ``p`` for kernel 2.
2. ``_index_topk_kernel``, grid ``(cdiv(total_q, BLOCK_T), Hidx)``: for each (token, head) row of
   the ``nb(p) = p // 128 + 1`` visible scores it applies NaN -> -1e30, init blocks -> 1e30, local
   blocks -> 1e29 (local wins), then selects by ``topk`` rounds of "largest key below the previous
   one".  The key packs the order-preserving integer image of the fp32 score above
   ``2^31 - 1 - block`` into an int64, so keys are distinct and equal scores rank the lower block
   first: a total order, hence deterministic output.  Slots past ``min(topk, nb)`` get -1.

The score buffer ``[Hidx, total_q, max_blocks]`` fp32 (rows padded to 16) is only written (and read) for visible
blocks.  Positions use ``p = seq_len - q_len + i``; rows with ``p < 0`` (padding requests with
``seq_len = 0``) see no block and return all -1.
"""

import torch
import triton
import triton.language as tl

from mm3_compile.kernels._launch import empty_row_major, launch
from mm3_compile.contract import PAGE_SIZE
from mm3_compile.platform import interpreting

PAGE = tl.constexpr(PAGE_SIZE)  # a Triton global must be a constexpr instance
INIT_SCORE = tl.constexpr(1e30)
LOCAL_SCORE = tl.constexpr(1e29)
NAN_SCORE = tl.constexpr(-1e30)


@triton.jit
def _find_request(tile_cu_ptr, num_reqs, tile):
    """Largest r < num_reqs with tile_cu[r] <= tile (requests without query tiles are passed over)."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_reqs  # invariant: tile_cu[lo] <= tile < tile_cu[hi] (or hi = num_reqs)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        right = tl.load(tile_cu_ptr + mid) <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _index_score_kernel(
    q_ptr,  # [total_q, Hidx, Didx]
    k_ptr,  # [num_pages, 128, Didx] index-K cache
    block_table_ptr,  # [num_reqs, max_blocks] int32
    cu_seqlens_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    tile_cu_ptr,  # [num_reqs + 1] int32: first query tile of each request (cumulative cdiv(q_len, BLOCK_Q))
    score_ptr,  # [Hidx, total_q, max_blocks rounded up to 16] fp32
    pos_ptr,  # [total_q] int32 query positions (pre-filled with -1)
    num_reqs,
    total_q,
    num_pages,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kp,
    stride_btr,
    stride_btb,
    score_row_units,  # score row length / 16 (see index_topk)
    HIDX: tl.constexpr,
    DIDX: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    FP32_DOT: tl.constexpr,  # fp32 operands, IEEE dot (fp32 inputs, or the interpreter's broken bf16 dots)
):
    stride_st = score_row_units * 16
    stride_sh = tl.cast(stride_st, tl.int64) * total_q  # can pass 2^31 at long contexts
    tile = tl.program_id(0)
    block = tl.program_id(1)
    if tile < tl.load(tile_cu_ptr + num_reqs):  # surplus programs (and num_reqs = 0) read nothing
        req = _find_request(tile_cu_ptr, num_reqs, tile)
        q_start = tl.load(cu_seqlens_ptr + req)
        q_len = tl.load(cu_seqlens_ptr + req + 1) - q_start
        i0 = (tile - tl.load(tile_cu_ptr + req)) * BLOCK_Q
        seq_len = tl.load(seq_lens_ptr + req)
        i = i0 + tl.arange(0, BLOCK_Q)  # [BLOCK_Q] query index within the request
        tokens = (q_start + i).to(tl.int64)
        row_ok = (i < q_len) & (tokens < total_q)  # a cu_seqlens_q past total_q reads and writes nothing
        pos = seq_len - q_len + i  # [BLOCK_Q] absolute query positions
        if block == 0:
            tl.store(pos_ptr + tokens, pos, mask=row_ok)
        last_pos = seq_len - q_len + tl.minimum(i0 + BLOCK_Q, q_len) - 1
        if block * PAGE <= last_pos:
            page = tl.load(block_table_ptr + req.to(tl.int64) * stride_btr + block * stride_btb)
            d = tl.arange(0, BLOCK_D)
            d_ok = d < DIDX
            key_off = tl.arange(0, PAGE)
            # A corrupt table entry reads nothing.  (Vector mask: the interpreter mishandles scalar & tensor.)
            row_page = key_off * 0 + page  # [128]
            page_ok = (row_page >= 0) & (row_page < num_pages)
            k_ptrs = k_ptr + page.to(tl.int64) * stride_kb + key_off[:, None] * stride_kp + d[None, :]
            k_mask = page_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptrs, mask=k_mask, other=0.0)  # [128, BLOCK_D]
            if FP32_DOT:
                k = k.to(tl.float32)
            visible = (block * PAGE + key_off)[None, :] <= pos[:, None]  # [BLOCK_Q, 128] causal
            q_row_ptrs = q_ptr + tokens[:, None] * stride_qt + d[None, :]
            s_ptrs = score_ptr + tokens * stride_st + block
            store_ok = row_ok & (block * PAGE <= pos)
            for h in tl.static_range(HIDX):
                q = tl.load(q_row_ptrs + h * stride_qh, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                if FP32_DOT:
                    s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))  # [BLOCK_Q, 128] fp32 accumulation
                is_nan = (s != s) & visible
                best = tl.max(tl.where(visible & (s == s), s, float("-inf")), axis=1)
                best = tl.where(tl.max(is_nan.to(tl.int32), axis=1) > 0, float("nan"), best)
                tl.store(s_ptrs + h * stride_sh, best, mask=store_ok)


@triton.jit
def _index_topk_kernel(
    score_ptr,  # [Hidx, total_q, max_blocks rounded up to 16] fp32
    pos_ptr,  # [total_q] int32
    out_ptr,  # [Hidx, total_q, TOPK] int32
    total_q,
    max_blocks,
    init_blocks,
    local_blocks,
    score_row_units,
    stride_oh,
    stride_ot,
    TOPK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    stride_st = score_row_units * 16
    stride_sh = tl.cast(stride_st, tl.int64) * total_q  # can pass 2^31 at long contexts
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    tokens = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    token_ok = tokens < total_q
    tokens = tokens.to(tl.int64)
    pos = tl.load(pos_ptr + tokens, mask=token_ok, other=-1)
    num_visible = tl.minimum(tl.where(pos >= 0, pos // PAGE + 1, 0), max_blocks)  # [BLOCK_T] nb(p)
    scan_end = tl.max(num_visible, axis=0)
    row_ptrs = score_ptr + head * stride_sh + tokens * stride_st  # [BLOCK_T]
    # Keys: (order-preserving int32 image of the score) * 2^32 + (2^31 - 1 - block).  A row's keys
    # are distinct; NO_KEY is below every real key (the image of -inf is > INT32_MIN).
    NO_KEY = tl.full([BLOCK_T], -2147483648, tl.int64) * 4294967296
    previous = tl.full([BLOCK_T], 2147483647, tl.int64) * 4294967296  # above every real key
    out_ptrs = out_ptr + head * stride_oh + tokens * stride_ot
    for slot in range(TOPK):
        best = NO_KEY
        for n0 in range(0, scan_end, BLOCK_N):
            blocks = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            valid = blocks[None, :] < num_visible[:, None]  # [BLOCK_T, BLOCK_N]
            s = tl.load(row_ptrs[:, None] + blocks[None, :], mask=valid, other=0.0)
            s = tl.where(s != s, NAN_SCORE, s)
            s = tl.where(blocks[None, :] < init_blocks, INIT_SCORE, s)
            s = tl.where(blocks[None, :] >= num_visible[:, None] - local_blocks, LOCAL_SCORE, s)
            s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties with +0.0
            bits = s.to(tl.int32, bitcast=True)
            ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            keys = ordered.to(tl.int64) * 4294967296 + (2147483647 - blocks).to(tl.int64)[None, :]
            keys = tl.where(valid & (keys < previous[:, None]), keys, NO_KEY[:, None])
            best = tl.maximum(best, tl.max(keys, axis=1))
        ids = tl.where(best > NO_KEY, 2147483647 - (best & 0xFFFFFFFF), -1)
        tl.store(out_ptrs + slot, ids.to(tl.int32), mask=token_ok)
        previous = best


def index_topk(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    init_blocks: int,
    local_blocks: int,
) -> torch.Tensor:
    """-> int32 [Hidx, total_q, topk]: logical block ids by descending score (ties: lower id), -1 padded."""
    total_q, num_heads, head_dim = index_q.shape
    num_reqs, max_blocks = block_table.shape
    device = index_q.device
    # Rows padded to 16 blocks and their length passed in units of 16: the top-k kernel's row loads stay
    # aligned (vectorised) also when Inductor launches it with a symbolic max_blocks, which gets no
    # divisibility specialisation there.
    score_row = triton.cdiv(max_blocks, 16) * 16
    scores = empty_row_major((num_heads, total_q, score_row), torch.float32, device)
    positions = torch.full((total_q,), -1, dtype=torch.int32, device=device)
    block_q = 64
    # Query tiles never straddle requests; sum_r cdiv(q_len_r, BLOCK_Q) <= cdiv(total_q, BLOCK_Q) + num_reqs
    # bounds the grid by shapes alone (surplus programs exit at once).
    # narrow by num_reqs, not [1:]/[:-1]: with size-oblivious symbolic sizes a slice's length would be a
    # fresh unbacked symbol that Inductor cannot lower inside the traced op body.
    q_lens = (cu_seqlens_q.narrow(0, 1, num_reqs) - cu_seqlens_q.narrow(0, 0, num_reqs)).clamp(min=0)  # [num_reqs]
    tile_cu = torch.nn.functional.pad(torch.cumsum((q_lens + block_q - 1) // block_q, 0), (1, 0)).to(torch.int32)
    launch(
        _index_score_kernel, (triton.cdiv(total_q, block_q) + num_reqs, max_blocks),
        index_q, index_k_cache, block_table, cu_seqlens_q, seq_lens, tile_cu, scores, positions,
        num_reqs, total_q, index_k_cache.shape[0],
        index_q.stride(0), index_q.stride(1), index_k_cache.stride(0), index_k_cache.stride(1),
        block_table.stride(0), block_table.stride(1), score_row // 16,
        HIDX=num_heads, DIDX=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_Q=block_q,
        FP32_DOT=interpreting() or index_q.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    out = torch.empty((num_heads, total_q, topk), dtype=torch.int32, device=device)
    # The interpreter runs one numpy program at a time: few, large programs are fastest there.
    block_t = 64 if interpreting() else 16
    launch(
        _index_topk_kernel, (triton.cdiv(total_q, block_t), num_heads),
        scores, positions, out, total_q, max_blocks, init_blocks, local_blocks, score_row // 16,
        out.stride(0), out.stride(1),
        TOPK=topk, BLOCK_T=block_t, BLOCK_N=128, num_warps=4,
    )  # fmt: skip
    return out
