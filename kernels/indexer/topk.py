"""Lightning indexer: block scores of every query over its visible 128-token blocks, then top-k.

Two kernels, both with shape-derived grids (nothing depends on the longest query or sequence); the
launch choices are :func:`index_schedule`, a pure function of shapes (their hints under tracing) and
the device, shared by the launcher and the tests.

1. ``_index_score_kernel``, grid ``(query tiles, chunks)``.  A query tile is ``BLOCK_T`` tokens of one
   request with *all* their index heads: ``ROWS = next_pow2(max(16, BLOCK_T * Hidx))`` dot rows, row
   ``r`` = (token ``r // Hidx``, head ``r % Hidx``).  Every index-K page is thus read once per tile for
   all heads and tokens (a decode step reads each request's index-K exactly once).  ``BLOCK_T == 1``
   maps tile = token (request by binary search over ``cu_seqlens_q``); otherwise tiles never straddle
   requests, and each program sums ``cdiv(q_len, BLOCK_T)`` over the requests to find its own
   (:func:`_find_tile`); surplus tiles exit.  The tile's visible blocks ``[0, nb_tile)`` are split evenly over the ``chunks`` programs of
   the second grid axis (split-K for decode: a B1 step spreads its pages over many SMs).  Blocks fully
   visible to every row skip the causal mask.  ``S[h, t, b] = max_{j in b, j <= p(t)} <q_h(t), k(j)>``
   (fp32 accumulation, no softmax scale; NaN-propagating max, like ``torch.amax``), times the
   per-slot key scale when one is given (FP8 caches).
2. ``_index_topk_kernel``, grid ``cdiv(Hidx * total_q, ROWS_T)``: each (head, token) row finds its
   request by binary search, takes its ``nb(p) = p // 128 + 1`` visible scores and selects ``topk``
   by rounds of "largest remaining (rank, -block)".  The rank is the order-preserving int32 image of the
   score (NaN -> -1e30, -0 -> +0), or, for forced blocks, a value above the image of +inf (init blocks
   above local ones; a block that is both counts as local).  The order is total and the output
   deterministic: forced blocks first whatever the scores, then descending score, ties to the lower
   block id.  Rows of up to ``BLOCK_N`` visible blocks hold their ranks in registers (a round: the
   highest rank, then the lowest block holding it); longer rows rescan their scores once per slot as
   int64 keys ``rank * 2^32 + 2^31 - 1 - block``.  Slots past ``min(topk, nb)`` get -1.

The score buffer ``[Hidx, total_q, max_blocks]`` fp32 (rows padded to 16) is only written (and read)
for visible blocks.  Positions use ``p = seq_len - q_len + i``; rows with ``p < 0`` (padding requests
with ``seq_len = 0``) see no block and return all -1.

Index-K may be bf16/fp16/fp32 (the dtype of ``index_q``) or FP8 (typed where Triton converts it in
hardware, else raw bytes decoded exactly with integer arithmetic).  Under the interpreter bf16 is
loaded as its 16 bits and widened exactly (Triton 3.9's interpreter mis-converts bf16 subnormals).
"""

import dataclasses

import torch
import triton
import triton.language as tl

from mm3_compile.contract import PAGE_SIZE
from mm3_compile.kernels._launch import empty_row_major, launch, size_hint, sm_count, use_pdl
from mm3_compile.kernels.fp8 import fp8_decode, fp8_launch
from mm3_compile.kernels.packed import find_request, find_requests
from mm3_compile.platform import FP8Format, interpreting

PAGE = tl.constexpr(PAGE_SIZE)  # a Triton global must be a constexpr instance
NAN_SCORE = tl.constexpr(-1e30)
# Ranks of forced blocks: above the order-preserving image of +inf (0x7F800000), init above local.
INIT_RANK = tl.constexpr(0x7FFFFFFE)
LOCAL_RANK = tl.constexpr(0x7FFFFFFD)
NO_RANK = tl.constexpr(-2147483648)  # below the image of -inf (0x807FFFFF as int32): a block not visible
# How a kernel reads a tensor: as typed, as bf16 bits widened exactly, or as FP8 bytes decoded exactly.
READ_TYPED, READ_BF16_BITS, READ_FP8_BYTES = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class IndexSchedule:
    """Launch choices of :func:`index_topk`; any value gives the same lists (only speed differs).

    block_t: query tokens per score tile (all their index heads share each page load).
    chunks: programs sharing one tile's visible blocks.
    score_warps / score_stages: launch options of the score kernel.
    keys_major: compute ``K @ Q^T`` ([128, ROWS], keys as the MMA's M side) instead of ``Q @ K^T``.
    topk_rows / topk_block_n / topk_warps: (head, token) rows per top-k program, blocks held in registers.
    topk_short_n: the narrower register tile of top-k programs whose rows all see at most that many blocks.
    fp16_q: with an FP8 index-K cache and a bf16/fp16 q, the dot runs on fp16 operands (q scaled per row by a
        power of two, undone on the fp32 scores).
    """

    block_t: int
    chunks: int
    score_warps: int
    score_stages: int
    keys_major: bool
    topk_rows: int
    topk_block_n: int
    topk_warps: int
    topk_short_n: int = 64
    fp16_q: bool = True

    def rows(self, num_heads: int) -> int:
        return max(16, triton.next_power_of_2(self.block_t * num_heads))


def index_schedule(total_q, num_reqs, num_heads: int, max_blocks, device: torch.device) -> IndexSchedule:
    """The schedule for these shapes on ``device`` (symbolic sizes are read through their hints).

    Tiles take every token of a short request (decode, MTP) and up to 128 dot rows otherwise (a
    page then feeds a 128-row MMA: prefill is compute-bound).  Chunks split the keys into at most one
    wave of four programs per SM in decode, about four per SM in prefill.  The interpreter gets few, large programs (it runs one at a time).
    """
    tokens = max(size_hint(total_q) or 1, 1)
    reqs = max(size_hint(num_reqs) or 1, 1)
    blocks = max(size_hint(max_blocks) or 1, 1)
    full_tile = max(1, 128 // num_heads)
    block_t = min(triton.next_power_of_2(triton.cdiv(tokens, reqs)), full_tile)
    if interpreting() or device.type != "cuda":
        return IndexSchedule(block_t, 1, 4, 1, False, 64, 128, 4)
    sms = sm_count(device.index if device.index is not None else torch.cuda.current_device())
    tiles = tokens if block_t == 1 else triton.cdiv(tokens, block_t) + reqs
    if block_t == 1:
        # decode: at most one wave of 4 programs per SM, a partly filled second wave costs (B128 bf16: 5 chunks
        # 300 us, 9 chunks 274 us, 4 chunks 257 us; FP8 9 -> 4 chunks 167 -> 147 us; B32 33 -> 16 chunks FP8
        # 46.8 -> 44.2 us; bench/NOTES.md, session 15). B1 takes one page per program either way.
        chunks = max(1, min(blocks, 4 * sms // tiles))
    else:  # prefill tiles: about 4 programs per SM
        chunks = max(1, min(blocks, triton.cdiv(4 * sms, tiles)))
    rows = max(16, triton.next_power_of_2(block_t * num_heads))
    prefill = rows >= 64
    # top-k: enough (head, token) rows per program to fill about two programs per SM, at most 16
    per_program = max(1, min(16, tokens * num_heads // (2 * sms)))
    topk_rows = 1 << (per_program.bit_length() - 1)
    return IndexSchedule(
        block_t=block_t,
        chunks=chunks,
        score_warps=8 if prefill else 4,
        score_stages=3,  # prefill too (bench/NOTES.md, indexer prefill top-k tile)
        keys_major=False,
        topk_rows=topk_rows,
        topk_block_n=256,
        # one warp per single-row program: a selection round is warp shuffles, no CTA barrier (decode B1 11.3 ->
        # 10.7 us, B128 FP8 147.8 -> 141.6 us; within 1% elsewhere: bench/NOTES.md, session 16)
        topk_warps=1 if topk_rows == 1 else 4,
    )


@triton.jit
def _widen(x, MODE: tl.constexpr, FP8: tl.constexpr):
    """A loaded tile as fp32 (exact): bf16 bits shifted into place, FP8 bytes decoded, else a cast."""
    if MODE == 1:
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif MODE == 2:
        return fp8_decode(x, FP8)
    else:
        return x.to(tl.float32)


@triton.jit
def _fp16_rows(q, FP32_DOT: tl.constexpr):
    """q [ROWS, D] (bf16/fp16, or fp32 holding them) times 2^shift per row -> fp16 (fp32 under FP32_DOT), and
    2^-shift [ROWS]. The shift brings the row's max |q| into [2^14, 2^15): bf16 and fp16 values stay exact
    unless below 2^-28 of that max (fp16 subnormals), and no product of a typed FP8 key overflows. The hardware
    conversion of a typed FP8 tile (sm_89+) is to fp16: the key tile then needs no conversion to bf16."""
    qf = q.to(tl.float32)
    q_max = tl.max(tl.abs(qf), axis=1)  # [ROWS]
    exponent = ((q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # -127 for 0 and fp32 subnormals
    shift = tl.minimum(tl.maximum(14 - exponent, -120), 120)  # both factors stay normal fp32
    scale = ((shift + 127) << 23).to(tl.float32, bitcast=True)
    q16 = (qf * scale[:, None]).to(tl.float16)
    if FP32_DOT:
        q16 = q16.to(tl.float32)
    return q16, ((127 - shift) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _page_scores(
    q,  # [ROWS, BLOCK_D] in the dot dtype
    k_ptr,
    k_scale_ptr,
    page,
    num_pages,
    key0,  # first key position of the block
    pos,  # [ROWS] query positions (used when MASKED)
    q_unscale,  # [ROWS] fp32 2^-shift of a power-of-two scaled fp16 q (Q_FP16)
    stride_kb,
    stride_kp,
    MASKED: tl.constexpr,
    DIDX: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_MODE: tl.constexpr,
    HAS_K_SCALE: tl.constexpr,
    FP32_DOT: tl.constexpr,
    KEYS_MAJOR: tl.constexpr,
    FP8: tl.constexpr,  # FP8 format code of the index-K bytes (kernels/fp8.py)
    SPLIT_NAN_MAX: tl.constexpr,  # the interpreter: NaN test and max as two builtin reductions
    Q_FP16: tl.constexpr,
):
    """[ROWS] max over the page's (visible) keys of the row's dot product (NaN-propagating)."""
    key_off = tl.arange(0, PAGE)
    d = tl.arange(0, BLOCK_D)
    # A corrupt table entry reads nothing.  (Vector mask: the interpreter mishandles scalar & tensor.)
    row_page = key_off * 0 + page  # [128]
    page_ok = (row_page >= 0) & (row_page < num_pages)
    k_ptrs = k_ptr + page.to(tl.int64) * stride_kb + key_off[:, None] * stride_kp + d[None, :]
    k_mask = page_ok[:, None] & (d < DIDX)[None, :]
    if K_MODE == 0:
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)  # [128, BLOCK_D] typed (an int fill does not cast to FP8)
    else:
        k = tl.load(k_ptrs, mask=k_mask, other=0)  # [128, BLOCK_D] bits or bytes
    if FP32_DOT:
        k = _widen(k, K_MODE, FP8)
    elif K_MODE == 2:
        k = fp8_decode(k, FP8).to(q.dtype)  # exact in bf16/fp16
    else:
        k = k.to(q.dtype)  # typed FP8 -> bf16/fp16 is exact; a no-op otherwise
    if KEYS_MAJOR:
        if FP32_DOT:
            s = tl.trans(tl.dot(k, tl.trans(q), input_precision="ieee"))
        else:
            s = tl.trans(tl.dot(k, tl.trans(q)))
    else:
        if FP32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [ROWS, 128]
        else:
            s = tl.dot(q, tl.trans(k))  # [ROWS, 128] fp32 accumulation
    if HAS_K_SCALE:
        scale = tl.load(k_scale_ptr + page.to(tl.int64) * PAGE + key_off, mask=page_ok, other=0.0)
        s = s * scale[None, :]
    if MASKED:
        key_pos = key_off + key0  # [128]
        s = tl.where(key_pos[None, :] <= pos[:, None], s, float("-inf"))
    if SPLIT_NAN_MAX:
        # the interpreter runs a custom combine function once per element pair in Python (~100x slower)
        has_nan = tl.max((s != s).to(tl.int32), 1)  # noqa: PLR0124 (NaN test)
        best = tl.where(has_nan > 0, float("nan"), tl.max(s, 1))
    else:
        best = tl.reduce(s, 1, _nan_max)
    if Q_FP16:
        # the scores of the unscaled q: a positive power of two commutes with the max (rounding is monotonic)
        best = best * q_unscale
    return best


@triton.jit
def _table_page(bt_ptr, b, stride_btb, spec_block, spec_page):
    """Block ``b``'s page: ``spec_page`` when ``b`` is the block loaded ahead, else read from the table."""
    ahead = b == spec_block
    page = tl.load(bt_ptr + b * stride_btb, mask=ahead == 0, other=0)
    return tl.where(ahead, spec_page, page)


@triton.jit
def _find_tile(cu_ptr, num_reqs, tile, BLOCK_T: tl.constexpr, RB: tl.constexpr):
    """The request of query tile ``tile`` (``BLOCK_T``-token tiles that never straddle requests) and that
    request's first tile; request -1 past the last tile.  Tile counts are summed in ``RB``-request steps in
    registers: no tile table is built before the launch (that took ~6 small torch kernels per call)."""
    req = tile * 0 - 1
    first = tile * 0
    base = tile * 0  # tiles of the requests before this step
    for r0 in range(0, num_reqs, RB):
        r = r0 + tl.arange(0, RB)
        ok = r < num_reqs
        start = tl.load(cu_ptr + r, mask=ok, other=0)
        end = tl.load(cu_ptr + r + 1, mask=ok, other=0)
        n = tl.where(ok, (tl.maximum(end - start, 0) + BLOCK_T - 1) // BLOCK_T, 0)  # [RB] tiles per request
        upto = base + tl.cumsum(n, 0)  # tiles up to and including r
        hit = ok & (upto - n <= tile) & (tile < upto)  # at most one request (its range is non-empty)
        req = tl.maximum(req, tl.max(tl.where(hit, r, -1), 0))
        first = tl.maximum(first, tl.max(tl.where(hit, upto - n, 0), 0))
        base = base + tl.sum(n, 0)
    return req, first


@triton.jit
def _index_score_kernel(
    q_ptr,  # [total_q, Hidx, Didx]
    k_ptr,  # [num_pages, 128, Didx] index-K cache
    k_scale_ptr,  # [num_pages * 128] fp32 per-slot key scales (read when HAS_K_SCALE)
    block_table_ptr,  # [num_reqs, max_blocks] int32
    cu_seqlens_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    score_ptr,  # [Hidx, total_q, max_blocks rounded up to 16] fp32
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
    max_blocks,  # block-table width
    HIDX: tl.constexpr,
    DIDX: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROWS: tl.constexpr,
    Q_MODE: tl.constexpr,  # READ_TYPED or READ_BF16_BITS
    K_MODE: tl.constexpr,  # READ_TYPED, READ_BF16_BITS or READ_FP8_BYTES
    HAS_K_SCALE: tl.constexpr,
    FP32_DOT: tl.constexpr,  # fp32 operands, IEEE dot (fp32 inputs, or the interpreter's broken bf16 dots)
    KEYS_MAJOR: tl.constexpr,
    SPLIT_NAN_MAX: tl.constexpr,  # see _page_scores
    Q_FP16: tl.constexpr,  # FP8 index-K: q scaled per row by a power of two into fp16, the dot on fp16 operands
    FP8: tl.constexpr,  # the FP8 launch constants of the index-K cache (kernels/fp8.py)
    FP8_MAX: tl.constexpr,
    FP8_NATIVE_LOAD: tl.constexpr,
    FP8_NATIVE_STORE: tl.constexpr,
    PDL: tl.constexpr,  # the top-k kernel is a programmatic dependent launch of this one (sm_90+)
):
    if PDL:
        # Launched as a dependent itself: every input may come from the previous grid, nothing is read before
        # the wait. Triggering right after it lets the top-k grid start and read its metadata meanwhile.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    stride_st = score_row_units * 16
    stride_sh = tl.cast(stride_st, tl.int64) * total_q  # can pass 2^31 at long contexts
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    n_chunks = tl.num_programs(1)
    spec_block = -1  # the block whose page was loaded ahead (none)
    spec_page = 0
    if BLOCK_T == 1:
        # One token per request (decode) puts token t in request t: guess it, and load that request's metadata
        # in the same round as the check, so the block table and page loads follow after one dependent round
        # (a miss falls back to the binary search).
        guess = tl.maximum(tl.minimum(tile, num_reqs - 1), 0)
        total = tl.load(cu_seqlens_ptr + num_reqs)
        q_start = tl.load(cu_seqlens_ptr + guess)
        q_end = tl.load(cu_seqlens_ptr + guess + 1, mask=guess < num_reqs, other=0)
        seq_len = tl.load(seq_lens_ptr + guess, mask=guess < num_reqs, other=0)
        # A grid as wide as the table gives every chunk at most one block, its own index (B1): the guessed
        # request's page for it loads in the same round too, and the page itself right after.
        one_block = (n_chunks >= max_blocks) & (chunk < max_blocks) & (guess < num_reqs)
        page_ahead = tl.load(
            block_table_ptr + guess.to(tl.int64) * stride_btr + chunk * stride_btb, mask=one_block, other=0
        )
        tile_ok = tile < total
        req = guess
        if (tile < q_start) | (tile >= q_end):
            req = find_request(cu_seqlens_ptr, num_reqs, tile)
            q_start = tl.load(cu_seqlens_ptr + req)
            q_end = tl.load(cu_seqlens_ptr + req + 1, mask=req < num_reqs, other=0)
            seq_len = tl.load(seq_lens_ptr + req, mask=req < num_reqs, other=0)
        elif one_block:
            spec_block = chunk
            spec_page = page_ahead
        i0 = tile - q_start
    else:
        req, first_tile = _find_tile(cu_seqlens_ptr, num_reqs, tile, BLOCK_T, 64)
        tile_ok = req >= 0
        req = tl.maximum(req, 0)
        i0 = (tile - first_tile) * BLOCK_T
        q_start = tl.load(cu_seqlens_ptr + req)
        q_end = tl.load(cu_seqlens_ptr + req + 1, mask=req < num_reqs, other=0)
        seq_len = tl.load(seq_lens_ptr + req, mask=req < num_reqs, other=0)
    if tile_ok:  # surplus programs (and num_reqs = 0) read nothing
        q_len = q_end - q_start
        r = tl.arange(0, ROWS)
        head = r % HIDX
        i = i0 + r // HIDX  # [ROWS] query index within the request
        tokens = (q_start + i).to(tl.int64)
        # a cu_seqlens_q past total_q reads and writes nothing
        row_ok = (r < BLOCK_T * HIDX) & (i < q_len) & (tokens < total_q) & (tokens >= 0)
        pos = seq_len - q_len + i  # [ROWS] absolute query positions
        first_pos = seq_len - q_len + i0
        last_pos = seq_len - q_len + tl.minimum(i0 + BLOCK_T, q_len) - 1
        nb_tile = tl.minimum(tl.where(last_pos >= 0, last_pos // PAGE + 1, 0), max_blocks)  # never past the table
        per_chunk = tl.cdiv(nb_tile, n_chunks)
        lo = chunk * per_chunk
        hi = tl.minimum(lo + per_chunk, nb_tile)
        full_end = tl.where(first_pos >= 0, (first_pos + 1) // PAGE, 0)  # blocks every row sees whole
        d = tl.arange(0, BLOCK_D)
        q_ptrs = q_ptr + tokens[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q_mask = row_ok[:, None] & (d < DIDX)[None, :]
        if Q_MODE == 0:
            q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # [ROWS, BLOCK_D]
        else:
            q = tl.load(q_ptrs, mask=q_mask, other=0)
        if FP32_DOT:
            q = _widen(q, Q_MODE, FP8)
        q_unscale = pos.to(tl.float32) * 0.0  # [ROWS] (unused without Q_FP16)
        if Q_FP16:
            q, q_unscale = _fp16_rows(q, FP32_DOT)
        s_ptrs = score_ptr + head.to(tl.int64) * stride_sh + tokens * stride_st  # [ROWS]
        bt_ptr = block_table_ptr + req.to(tl.int64) * stride_btr
        for b in range(lo, tl.minimum(hi, full_end)):
            page = _table_page(bt_ptr, b, stride_btb, spec_block, spec_page)
            best = _page_scores(
                q,
                k_ptr,
                k_scale_ptr,
                page,
                num_pages,
                b * PAGE,
                pos,
                q_unscale,
                stride_kb,
                stride_kp,
                False,
                DIDX,
                BLOCK_D,
                K_MODE,
                HAS_K_SCALE,
                FP32_DOT,
                KEYS_MAJOR,
                FP8,
                SPLIT_NAN_MAX,
                Q_FP16,
            )
            tl.store(s_ptrs + b, best, mask=row_ok)
        for b in range(tl.maximum(lo, full_end), hi):
            page = _table_page(bt_ptr, b, stride_btb, spec_block, spec_page)
            best = _page_scores(
                q,
                k_ptr,
                k_scale_ptr,
                page,
                num_pages,
                b * PAGE,
                pos,
                q_unscale,
                stride_kb,
                stride_kp,
                True,
                DIDX,
                BLOCK_D,
                K_MODE,
                HAS_K_SCALE,
                FP32_DOT,
                KEYS_MAJOR,
                FP8,
                SPLIT_NAN_MAX,
                Q_FP16,
            )
            tl.store(s_ptrs + b, best, mask=row_ok & (b * PAGE <= pos))


@triton.jit
def _score_ranks(s, blocks, nb, init_blocks, local_blocks):
    """[ROWS, BLOCK_N] int32 ranks of the scores ``s`` of ``blocks`` ([BLOCK_N]): the order-preserving integer
    image of the score, forced blocks above every score; ``NO_RANK`` (below every real rank) where not visible."""
    valid = blocks[None, :] < nb[:, None]  # [ROWS, BLOCK_N]
    s = tl.where(s != s, NAN_SCORE, s)  # noqa: PLR0124 (the NaN test)
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties with +0.0
    bits = s.to(tl.int32, bitcast=True)
    rank = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    rank = tl.where(blocks[None, :] < init_blocks, INIT_RANK, rank)
    rank = tl.where(blocks[None, :] >= nb[:, None] - local_blocks, LOCAL_RANK, rank)  # local wins
    return tl.where(valid, rank, NO_RANK)


@triton.jit
def _score_keys(s, blocks, nb, init_blocks, local_blocks):
    """[ROWS, BLOCK_N] int64 keys ``rank * 2^32 + 2^31 - 1 - block`` (the lowest key where not visible)."""
    rank = _score_ranks(s, blocks, nb, init_blocks, local_blocks)
    keys = rank.to(tl.int64) * 4294967296 + (2147483647 - blocks).to(tl.int64)[None, :]
    no_key = tl.full(blocks[None, :].shape, -2147483648, tl.int64) * 4294967296
    return tl.where(rank > NO_RANK, keys, no_key)


@triton.jit
def _block_scores(row_ptrs, n0, nb, BLOCK_N: tl.constexpr):
    """[ROWS, BLOCK_N] fp32 scores of blocks ``n0 + [0, BLOCK_N)`` (0 where not visible) and the block ids."""
    blocks = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    s = tl.load(row_ptrs[:, None] + blocks[None, :], mask=blocks[None, :] < nb[:, None], other=0.0)
    return s, blocks


@triton.jit
def _select_loaded(
    row_ptrs, nb, init_blocks, local_blocks, out_ptrs, row_ok, TOPK: tl.constexpr, BLOCK_N: tl.constexpr
):
    """:func:`_select` over the first ``BLOCK_N`` scores of each row, loaded here."""
    s, blocks = _block_scores(row_ptrs, 0, nb, BLOCK_N)
    _select(s, blocks, nb, init_blocks, local_blocks, out_ptrs, row_ok, TOPK)


@triton.jit
def _block_keys(row_ptrs, n0, nb, init_blocks, local_blocks, BLOCK_N: tl.constexpr):
    """[ROWS, BLOCK_N] int64 keys of blocks ``n0 + [0, BLOCK_N)`` (the lowest key where not visible)."""
    s, blocks = _block_scores(row_ptrs, n0, nb, BLOCK_N)
    return _score_keys(s, blocks, nb, init_blocks, local_blocks)


@triton.jit
def _select(s, blocks, nb, init_blocks, local_blocks, out_ptrs, row_ok, TOPK: tl.constexpr):
    """``TOPK`` rounds of "largest (rank, -block) left" over scores ``s`` [ROWS, BLOCK_N] held in registers.

    A round is two int32 reductions, the highest rank and then the lowest block holding it, rather than one
    int64 reduction of packed keys: a warp reduces 32-bit integers in one ``redux.sync`` on sm_80+, 64-bit
    ones in five rounds of two shuffles (one-row decode programs are this latency chain, 16 rounds long).
    """
    ranks = _score_ranks(s, blocks, nb, init_blocks, local_blocks)
    for slot in range(TOPK):
        best = tl.max(ranks, axis=1)  # [ROWS]
        block = tl.min(tl.where(ranks == best[:, None], blocks[None, :], 2147483647), axis=1)
        tl.store(out_ptrs + slot, tl.where(best > NO_RANK, block, -1), mask=row_ok)
        ranks = tl.where(blocks[None, :] == block[:, None], NO_RANK, ranks)


@triton.jit
def _select_long(
    row_ptrs,
    nb,
    scan_end,
    init_blocks,
    local_blocks,
    out_ptrs,
    row_ok,
    TOPK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rows longer than the register tile: per slot, the largest key below the previous slot's."""
    NO_KEY = tl.full([ROWS], -2147483648, tl.int64) * 4294967296
    previous = tl.full([ROWS], 9223372036854775807, tl.int64)  # above every real key
    for slot in range(TOPK):
        best = NO_KEY
        for n0 in range(0, scan_end, BLOCK_N):
            keys = _block_keys(row_ptrs, n0, nb, init_blocks, local_blocks, BLOCK_N)
            keys = tl.where(keys < previous[:, None], keys, NO_KEY[:, None])
            best = tl.maximum(best, tl.max(keys, axis=1))
        ids = tl.where(best > NO_KEY, 2147483647 - (best & 0xFFFFFFFF), -1)
        tl.store(out_ptrs + slot, ids.to(tl.int32), mask=row_ok)
        previous = best


@triton.jit
def _index_topk_kernel(
    score_ptr,  # [Hidx, total_q, max_blocks rounded up to 16] fp32
    cu_seqlens_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    out_ptr,  # [Hidx, total_q, TOPK] int32
    num_reqs,
    total_q,
    num_rows,  # Hidx * total_q
    max_blocks,
    init_blocks,
    local_blocks,
    score_row_units,
    stride_oh,
    stride_ot,
    TOPK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SHORT_N: tl.constexpr,  # <= BLOCK_N: the register tile of programs whose rows see at most SHORT_N blocks
    PRELOAD: tl.constexpr,  # decode rows: guessed requests, the first BLOCK_N scores loaded in one go
    PDL: tl.constexpr,  # a programmatic dependent launch after the score kernel: metadata first, then the wait
):
    stride_st = score_row_units * 16
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS] row = head * total_q + token
    row_ok = rows < num_rows
    rows = tl.where(row_ok, rows, 0)
    head = rows // total_q
    token = rows % total_q
    row_ptrs = score_ptr + rows.to(tl.int64) * stride_st  # [ROWS]
    blocks = tl.arange(0, BLOCK_N)
    if PRELOAD and not PDL:
        # in the same round as the request's metadata (the scores past the row's length are in the buffer and
        # masked below): one dependent round less before the selection
        pre = tl.load(
            row_ptrs[:, None] + blocks[None, :], mask=row_ok[:, None] & (blocks < max_blocks)[None, :], other=0.0
        )
    if PRELOAD:
        # decode rows: token t is request t; its metadata loads in one round, the search runs only on a miss
        req = tl.minimum(token, num_reqs - 1)
        has_req = row_ok & (req >= 0)
        q_start = tl.load(cu_seqlens_ptr + req, mask=has_req, other=0)
        q_end = tl.load(cu_seqlens_ptr + req + 1, mask=has_req, other=0)
        seq_len = tl.load(seq_lens_ptr + req, mask=has_req, other=0)
        miss = has_req & ((token < q_start) | (token >= q_end))
        if tl.max(miss.to(tl.int32), axis=0) > 0:
            req, has_req, q_start, q_end, seq_len = _request_of(cu_seqlens_ptr, seq_lens_ptr, num_reqs, token, row_ok)
    else:
        req, has_req, q_start, q_end, seq_len = _request_of(cu_seqlens_ptr, seq_lens_ptr, num_reqs, token, row_ok)
    in_req = has_req & (token >= q_start) & (token < q_end)
    pos = seq_len - (q_end - q_start) + (token - q_start)
    nb = tl.where(in_req & (pos >= 0), pos // PAGE + 1, 0)
    nb = tl.minimum(nb, max_blocks)  # [ROWS] nb(p)
    out_ptrs = out_ptr + head.to(tl.int64) * stride_oh + token.to(tl.int64) * stride_ot
    scan_end = tl.max(nb, axis=0)
    if PDL:
        # the scores come from the previous grid (the score kernel); the metadata above did not
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        if PRELOAD:
            pre = tl.load(row_ptrs[:, None] + blocks[None, :], mask=blocks[None, :] < nb[:, None], other=0.0)
    # the row's scores stay in registers, in the narrower tile where the program's rows fit it (a selection
    # round costs in proportion to the tile: causal prefill rows see few blocks)
    if PRELOAD:
        if scan_end <= BLOCK_N:
            _select(pre, blocks, nb, init_blocks, local_blocks, out_ptrs, row_ok, TOPK)
        else:
            _select_long(row_ptrs, nb, scan_end, init_blocks, local_blocks, out_ptrs, row_ok, TOPK, ROWS, BLOCK_N)
    elif scan_end <= SHORT_N:
        _select_loaded(row_ptrs, nb, init_blocks, local_blocks, out_ptrs, row_ok, TOPK, SHORT_N)
    elif scan_end <= BLOCK_N:
        _select_loaded(row_ptrs, nb, init_blocks, local_blocks, out_ptrs, row_ok, TOPK, BLOCK_N)
    else:
        _select_long(row_ptrs, nb, scan_end, init_blocks, local_blocks, out_ptrs, row_ok, TOPK, ROWS, BLOCK_N)


@triton.jit
def _request_of(cu_seqlens_ptr, seq_lens_ptr, num_reqs, token, row_ok):
    """The request of each token by binary search, and its metadata."""
    req = find_requests(cu_seqlens_ptr, num_reqs, token)
    has_req = row_ok & (req < num_reqs)
    q_start = tl.load(cu_seqlens_ptr + req, mask=has_req, other=0)
    q_end = tl.load(cu_seqlens_ptr + req + 1, mask=has_req, other=0)
    seq_len = tl.load(seq_lens_ptr + req, mask=has_req, other=0)
    return req, has_req, q_start, q_end, seq_len


def _read_mode(t: torch.Tensor, fp32_dot: bool) -> tuple[torch.Tensor, int]:
    """The tensor as the kernel loads it: bf16 as int16 bits where the dot runs in fp32 (exact widening)."""
    if fp32_dot and t.dtype == torch.bfloat16:
        return t.view(torch.int16), READ_BF16_BITS
    return t, READ_TYPED


def index_topk(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    init_blocks: int,
    local_blocks: int,
    k_format: FP8Format | None = None,
    k_scale: torch.Tensor | None = None,
    schedule: IndexSchedule | None = None,
) -> torch.Tensor:
    """-> int32 [Hidx, total_q, topk]: logical block ids, forced blocks first, then descending score
    (ties: lower id), -1 padded.

    ``k_format``: the FP8 format of a typed FP8 ``index_k_cache`` (None: the cache has index_q's dtype);
    ``k_scale``: optional fp32 ``[num_blocks * 128]`` per-slot key scales; ``schedule``: launch choices
    (default :func:`index_schedule`).
    """
    total_q, num_heads, head_dim = index_q.shape
    num_reqs, max_blocks = block_table.shape
    device = index_q.device
    if schedule is None:
        schedule = index_schedule(total_q, num_reqs, num_heads, max_blocks, device)
    # Rows padded to 16 blocks and their length passed in units of 16: the top-k kernel's row loads stay
    # aligned (vectorised) also when Inductor launches it with a symbolic max_blocks, which gets no
    # divisibility specialisation there.
    score_row = triton.cdiv(max_blocks, 16) * 16
    scores = empty_row_major((num_heads, total_q, score_row), torch.float32, device)
    fp32_dot = interpreting() or index_q.dtype == torch.float32
    q_arg, q_mode = _read_mode(index_q, fp32_dot)
    fp8 = fp8_launch(k_format, index_k_cache)
    if k_format is not None:
        k_arg, k_mode = fp8.view(index_k_cache), READ_TYPED if fp8.native_load else READ_FP8_BYTES
    else:
        k_arg, k_mode = _read_mode(index_k_cache, fp32_dot)
    block_t = schedule.block_t
    # both kernels as programmatic dependent launches (sm_90+, eager and in Inductor graphs): each grid starts
    # while the previous one finishes, the top-k grid reading its metadata meanwhile (written before the score
    # grid started, whose programs trigger only after their own wait)
    pdl = use_pdl(device)
    # tile = token for BLOCK_T 1; otherwise tiles never straddle requests, and
    # sum_r cdiv(q_len_r, BLOCK_T) <= cdiv(total_q, BLOCK_T) + num_reqs bounds the grid by shapes alone
    # (surplus programs exit at once)
    tiles = total_q if block_t == 1 else triton.cdiv(total_q, block_t) + num_reqs
    launch(
        _index_score_kernel,
        (tiles, schedule.chunks),
        q_arg,
        k_arg,
        k_scale if k_scale is not None else scores,
        block_table,
        cu_seqlens_q,
        seq_lens,
        scores,
        num_reqs,
        total_q,
        index_k_cache.shape[0],
        index_q.stride(0),
        index_q.stride(1),
        index_k_cache.stride(0),
        index_k_cache.stride(1),
        block_table.stride(0),
        block_table.stride(1),
        score_row // 16,
        max_blocks,
        HIDX=num_heads,
        DIDX=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_T=block_t,
        ROWS=schedule.rows(num_heads),
        Q_MODE=q_mode,
        K_MODE=k_mode,
        HAS_K_SCALE=k_scale is not None,
        FP32_DOT=fp32_dot,
        KEYS_MAJOR=schedule.keys_major,
        SPLIT_NAN_MAX=interpreting(),
        Q_FP16=schedule.fp16_q and k_format is not None and index_q.dtype in (torch.bfloat16, torch.float16),
        **fp8.constexprs(),
        pdl=pdl,
        num_warps=schedule.score_warps,
        num_stages=schedule.score_stages,
    )
    out = torch.empty((num_heads, total_q, topk), dtype=torch.int32, device=device)
    launch(
        _index_topk_kernel,
        (triton.cdiv(num_heads * total_q, schedule.topk_rows),),
        scores,
        cu_seqlens_q,
        seq_lens,
        out,
        num_reqs,
        total_q,
        num_heads * total_q,
        max_blocks,
        init_blocks,
        local_blocks,
        score_row // 16,
        out.stride(0),
        out.stride(1),
        TOPK=topk,
        ROWS=schedule.topk_rows,
        BLOCK_N=schedule.topk_block_n,
        SHORT_N=min(schedule.topk_short_n, schedule.topk_block_n),
        PRELOAD=schedule.topk_rows == 1,
        pdl=pdl,
        num_warps=schedule.topk_warps,
    )
    return out
