"""KV-centric block-sparse prefill: a block is loaded once and attended by every (token, slot) pair naming it.

The union walk (``union.py``, BLOCK_Q > 1) hands a tile of consecutive tokens every block any of
them selected; with independent lists most of its dot rows are masked (~28% useful at TP1 1x8192)
and each block is re-read by every tile whose union holds it.  Here:

1. ``pair_keys_kernel`` gives every (KV head, token, slot) its key ``2 * group + diagonal`` if the
   slot counts, else ``uncounted`` (sorts last); ``group = (head * num_reqs + request) * max_blocks +
   block`` and ``diagonal`` says the block is the token's own (``p // 128``).  Which slots count is
   the contract's rule (see ``union.py``): slots ``< min(T, p // 128 + 1)``, ids in ``[0, p // 128]``
   and inside the block table, pages inside the cache, an id listed twice counted once.  Slots are
   padded to ``BLOCK_T`` (a power of two), so a pair's flat index unpacks with shifts.
2. ``torch.sort`` (stable: tokens stay ascending inside a key).
3. ``kv_centric_attn_kernel``: program p takes the sorted pairs ``[p * PAIRS, (p + 1) * PAIRS)``.
   For each run of one key inside them it loads and converts that block's K/V once, then walks the
   run in tiles of ``BLOCK_TOK`` tokens x ``BLOCK_H`` heads whose rows all attend the block: per tile
   one ``[BLOCK_M, D] x [D, 128]`` and one ``[BLOCK_M, 128] x [128, D]`` dot and a one-block softmax
   (``_attend_tile``), the next tile's query rows gathered while this one computes (pipelined by
   hand).  Each pair writes its normalised partial and log2-sum-exp at ``[slot, token, head]``.
4. ``merge_slots_kernel`` combines each token's counted slots (read from the keys, so uncounted
   slots' partials are never written nor read) like decode combines its splits.

Why the diagonal bit: a block older than the token's own lies wholly before it (``block * 128 + 127 <
p``), so every key of it is visible and the tile needs no mask at all; only runs of own blocks (one
slot in T) build the causal mask.  The loop is bound by the instructions it issues, and the mask
was a third of the per-element work (bench/NOTES.md, "moved from kernel sources").

Nothing synchronises with the host and every buffer's size comes from the shapes, so the launcher
traces into one graph.  Numerics per block: logits and their max in fp32, ``p = exp2(s * scale - m)``
rounded to the model dtype before P.V (as the union walk), except over a bf16 cache: there P is rounded
to fp16 and the block's V, times the power of two 2^shift of the partials below, is converted to fp16 once
per run (exact: bf16's 8 significant bits fit fp16's 11 for every value down to 2^-29 of the block's max
|V|), so P keeps 11 bits instead of 8; P's rounding was most of the error (mean |err| on the H200 at TP1
1x8192 7.0e-5 -> 4.9e-5, bench/NOTES.md).  FP8 K/V are converted once per run: for
a bf16 model dequantised with their scales (bf16 holds any fp32 magnitude); for an fp16 model with
scalar or no scales, unscaled (every FP8 value fits fp16) with k_scale folded into the logit factor
and v_scale applied to the merged rows, so large scales cannot overflow fp16 (per-token-head scales are
applied to the values, which must then fit the model dtype, as in every schedule).  Partials are
fp16 scaled per (slot, row) by a power of two 2^shift (stored beside the lse as 2^-shift): shift
brings the block's max |V| into [2^14, 2^15), and |o| <= max |V| (up to P's rounding), so every
partial fits fp16 with 11 significant bits, where bf16 partials kept 8.  That is one more rounding
per block than the union walk, 8x finer than the model dtype's, at half the traffic of fp32
partials (the measured errors and times: bench/NOTES.md).  The
scale joins the 1 / l factor of the tile and the slot's weight in the merge, so it costs no
per-element instruction; the block's max |V| is one reduction per run.
"""

import torch
import triton
import triton.language as tl

from mm3_compile.contract import LOG2E, SCALE_PER_TOKEN_HEAD
from mm3_compile.kernels._launch import empty_row_major, launch
from mm3_compile.kernels.sparse_attn import schedule
from mm3_compile.kernels.sparse_attn.jit import (
    HUGE_LOGIT,
    PAGE,
    load_block,
    packed_requests,
    scalar_scales,
    select_slots,
    slot_window,
    to_model_dtype,
    widen,
)
from mm3_compile.kernels.sparse_attn.union import kv_launch_args
from mm3_compile.platform import FP8Format

# Rows (token x query head) per tile, with 4 warps: two programs fit per SM (<= 96 KB of shared memory,
# 255 registers x 128 threads each), so one's MMAs overlap the other's softmax and stores.
PAIR_ROWS = 64
MAX_TILE_TOKENS = 16
TILES_PER_PROGRAM = 32  # a power of two; amortises each block's load and conversion over its run (bench/NOTES.md)
KEY_TOKENS = 32  # tokens per program of pair_keys_kernel
MERGE_ROWS = 32


def tile_tokens(G: int) -> int:
    """Pairs (tokens) per tile: PAIR_ROWS rows of pow2(G) heads each."""
    return max(1, min(MAX_TILE_TOKENS, PAIR_ROWS // triton.next_power_of_2(int(G))))


@triton.jit
def pair_keys_kernel(
    topk_ptr,  # [Hkv, total_q, T] int32
    block_table_ptr,  # [num_reqs, max_blocks] int32
    cu_seqlens_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    keys_ptr,  # [Hkv, total_q, BLOCK_T] int32 out
    pos_ptr,  # [total_q] int32 out: absolute positions
    total_q,
    num_reqs,
    num_blocks,
    max_blocks,
    T,
    uncounted,  # the key of a pair that does not count: 2 * groups
    stride_tkh,
    stride_tkt,
    stride_tks,
    stride_btr,
    stride_btb,
    BLOCK_TOK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    kv_head = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_TOK + tl.arange(0, BLOCK_TOK)
    token_ok = tokens < total_q
    tokens = tl.where(token_ok, tokens, 0)
    req, q_len, offset, inside = packed_requests(cu_seqlens_ptr, num_reqs, tokens)
    packed = token_ok & inside  # tokens outside every request count no slot (their rows are 0)
    pos, last_block, n_slots = slot_window(seq_lens_ptr, req, q_len, offset, packed, T)  # [BLOCK_TOK] each
    slots = tl.arange(0, BLOCK_T)
    ids, _, valid = select_slots(
        topk_ptr,
        block_table_ptr,
        kv_head,
        tokens,
        req,
        last_block,
        n_slots,
        num_blocks,
        max_blocks,
        stride_tkh,
        stride_tkt,
        stride_tks,
        stride_btr,
        stride_btb,
        T,
        BLOCK_T,
    )  # [BLOCK_TOK, BLOCK_T] each
    earlier = slots[None, None, :] < slots[None, :, None]  # [1, BLOCK_T (slot), BLOCK_T (earlier slot)]
    repeat = tl.max(((ids[:, None, :] == ids[:, :, None]) & earlier).to(tl.int32), axis=2) > 0
    group = (kv_head * num_reqs + req[:, None]) * max_blocks + ids
    diagonal = (ids == last_block[:, None]).to(tl.int32)
    key = tl.where(valid & ~repeat, group * 2 + diagonal, uncounted)
    flat = (kv_head.to(tl.int64) * total_q + tokens[:, None]) * BLOCK_T + slots[None, :]
    tl.store(keys_ptr + flat, key, mask=token_ok[:, None])
    if kv_head == 0:
        tl.store(pos_ptr + tokens, pos, mask=token_ok)


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, D] dot dtype
    k,  # [D, 128] dot dtype
    v,  # [128, D] dot dtype; FP16_PV: fp16, times 2^v_shift
    key_pos,  # [128] logical positions of the block's keys
    limit,  # [BLOCK_M] last key position a row may see (-1: none); read only when ``diagonal``
    diagonal,  # scalar: the block is the rows' own, mask keys after each row's position
    qk_scale,  # >= 0, log2(e) folded in
    v_shift,  # int32 scalar: 2^v_shift brings the block's max |V| into [2^14, 2^15) (see ``v_partial_shift``)
    P_DTYPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP16_PV: tl.constexpr,  # P and V are fp16 (V pre-scaled by 2^v_shift): shift = v_shift
):
    """One block's attention for fresh rows: (normalised output times 2^shift [BLOCK_M, D] fp32, its
    log2-sum-exp [BLOCK_M], 2^-shift [BLOCK_M]), the output scaled to be stored as an fp16 partial.

    Off the diagonal every key is visible and rows without a pair have q = 0, so nothing is masked.
    The max is taken on the raw logits (``qk_scale >= 0``) and the scale folded into the exponent;
    on the diagonal the mask picks the max and zeroes the weights (masking the logits with -inf
    would turn a zero scale into NaN)."""
    s = tl.dot(q, k)  # [BLOCK_M, 128] raw logits
    if diagonal:
        s_max = tl.max(tl.where(key_pos[None, :] <= limit[:, None], s, float("-inf")), axis=1)
    else:
        s_max = tl.max(s, axis=1)
    m = tl.where(s_max == float("-inf"), 0.0, s_max * qk_scale)  # [BLOCK_M] log2 domain; 0 for a row that sees no key
    p = tl.exp2(s * qk_scale - m[:, None])
    if diagonal:
        p = tl.where(key_pos[None, :] <= limit[:, None], p, 0.0)
    l = tl.sum(p, axis=1)
    p = to_model_dtype(p, P_DTYPE)
    if DOT_FP32:
        p = widen(p)
    # l == 0: no visible key, an empty slot.  The FFMA s * scale - m uses the exact product while m was
    # rounded, so every weight carries the factor 2^r of m's rounding error r (it cancels in o and lse);
    # r stays at most 8 while |m| < 2^28 (an fp16 P stays below 2^8), but beyond (logits far past any real
    # attention, up to fp32's overflow) the weights become 0 or inf and the row would be silently wrong: such
    # rows are NaN, and the union walk and decode flag the same rows (``jit.HUGE_LOGIT``).
    l_safe = tl.where(l > 0.0, l, 1.0)
    inv_l = 1.0 / l_safe
    lse = tl.where(l == 0.0, float("-inf"), m + tl.log2(l_safe))
    lse = tl.where(tl.abs(m) < HUGE_LOGIT, lse, float("nan"))
    if FP16_PV:
        # V already carries 2^v_shift: the dot's rows are the scaled partial once divided by l
        # (l >= 2^-8 when it is not 0: the row's largest weight is 2^r)
        shift = tl.full(inv_l.shape, 0, tl.int32) + v_shift
        o = tl.dot(p, v) * inv_l[:, None]
    else:
        # The power of two joins the 1 / l factor (no extra multiply per element); it is limited so that the
        # factor stays a normal fp32 (r <= 8 bounds l) and 2^-shift too.
        inv_exp = ((inv_l.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # [BLOCK_M]
        shift = tl.minimum(tl.maximum(v_shift, -126 - inv_exp), 126 - inv_exp)
        shift = tl.minimum(tl.maximum(shift, -126), 126)
        factor = inv_l * ((shift + 127) << 23).to(tl.float32, bitcast=True)
        o = tl.dot(p, v) * factor[:, None]
    return o, lse, ((127 - shift) << 23).to(tl.float32, bitcast=True)


@triton.jit
def v_partial_shift(v):
    """The exponent that brings max |V| of a block into [2^14, 2^15): every normalised output row of the
    block (|o| <= max |V|, up to P's rounding) then fits fp16 with its 11 significant bits (0 for an
    all-zero or non-finite block)."""
    v_max = widen(tl.max(tl.abs(v)))
    v_exp = ((v_max.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # -127 for a subnormal maximum
    return tl.where((v_max > 0.0) & (v_max < float("inf")), 14 - v_exp, 0)


@triton.jit
def kv_centric_attn_kernel(
    q_ptr,  # [total_q, Hq, D]
    kv_ptr,  # [num_blocks, Hkv, 128, 2D]
    sorted_keys_ptr,  # [N] int32 (N = Hkv * total_q * BLOCK_T), ascending, ``uncounted`` last
    order_ptr,  # [N] int64: the flat (head, token, slot) index of each sorted key
    pos_ptr,  # [total_q] int32
    block_table_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    k_scale_ptr,
    v_scale_ptr,
    partial_ptr,  # [T, total_q, Hq, D] fp16, the normalised output times 2^shift
    lse_ptr,  # [T, total_q, Hq] fp32
    unscale_ptr,  # [T, total_q, Hq] fp32: 2^-shift
    num_pairs,
    uncounted,
    total_q,
    Hq,
    num_reqs,
    max_blocks,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_btr,
    stride_btb,
    stride_ksh,
    stride_kss,
    stride_vsh,
    stride_vss,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_TOK: tl.constexpr,
    PAIRS: tl.constexpr,  # sorted pairs per program
    SLOT_BITS: tl.constexpr,  # log2(BLOCK_T)
    FP8: tl.constexpr,  # the FP8 launch constants (kernels/fp8.py); FP8 == 0: a bf16/fp16 cache
    FP8_MAX: tl.constexpr,
    FP8_NATIVE_LOAD: tl.constexpr,
    FP8_NATIVE_STORE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FOLD_SCALES: tl.constexpr,  # fp16 model, FP8 cache, scalar or no scales: K/V unscaled, k_scale folded
    CONVERT_V_FIRST: tl.constexpr,  # schedule.launch_options
    V_PAIRS: tl.constexpr,  # schedule.launch_options: off for prefill tiles
):
    """Rows of a tile are (pair, query head): row = pair_in_tile * BLOCK_H + head_in_group."""
    tl.static_assert(not V_PAIRS, "a run's V is shifted and reused as a 16-bit tile")
    BLOCK_M: tl.constexpr = BLOCK_TOK * BLOCK_H
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes Python floats as fp64 scalars
    k_scale, v_scale = scalar_scales(k_scale_ptr, v_scale_ptr, SCALE_MODE)
    if FOLD_SCALES:
        qk_scale = qk_scale * k_scale
    # A negative scale flips which logit is the max: flip K's sign instead (exact), once per run.
    negate_k = qk_scale < 0.0
    qk_scale = tl.abs(qk_scale)
    MODEL_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    # bf16 caches: P rounded to fp16 (11 significant bits, 8 in bf16) for P.V, V converted to match (an FP8
    # cache's V is converted once already; converting it again cost 9% at TP1 1x8192 on the H200)
    FP16_PV: tl.constexpr = (MODEL_DTYPE == tl.bfloat16) and (FP8 == 0)
    P_DTYPE: tl.constexpr = tl.float16 if FP16_PV else MODEL_DTYPE
    start = tl.program_id(0).to(tl.int64) * PAIRS
    index = tl.arange(0, PAIRS)
    run_keys = tl.load(sorted_keys_ptr + start + index, mask=start + index < num_pairs, other=uncounted)  # [PAIRS]
    counted = tl.sum((run_keys < uncounted).to(tl.int32))  # sorted: the counted pairs come first
    rows = tl.arange(0, BLOCK_M)
    head_in_group = rows % BLOCK_H
    offs = tl.arange(0, PAGE)
    dims = tl.arange(0, D)
    run_first = tl.full([], 0, tl.int32)
    while run_first < counted:
        # the run starting at run_first: its key, and its length (sorted: all its pairs are in this run)
        run_key = tl.sum(tl.where(index == run_first, run_keys, 0))
        run_end = run_first + tl.sum((run_keys == run_key).to(tl.int32))
        diagonal = (run_key & 1) == 1
        group = run_key >> 1
        block = group % max_blocks
        head_req = group // max_blocks
        req = head_req % num_reqs
        kv_head = head_req // num_reqs
        page = tl.load(block_table_ptr + req.to(tl.int64) * stride_btr + block * stride_btb).to(tl.int64)
        key_pos = block * PAGE + offs  # [128] logical positions
        key_ok = key_pos < tl.load(seq_lens_ptr + req)
        k, v = load_block(
            kv_ptr + kv_head.to(tl.int64) * stride_kh,
            page,
            key_ok,
            k_scale,
            v_scale,
            k_scale_ptr,
            v_scale_ptr,
            kv_head,
            stride_kb,
            stride_kt,
            stride_ksh,
            stride_kss,
            stride_vsh,
            stride_vss,
            D,
            MODEL_DTYPE,
            SCALE_MODE,
            DOT_FP32,
            FOLD_SCALES,
            FP8,
            FP8_NATIVE_LOAD,
            CONVERT_V_FIRST,
            V_PAIRS,
        )  # [D, 128], [128, D]: loaded and converted once for the run
        if negate_k:
            k = -k
        v_shift = v_partial_shift(v)
        if FP16_PV:
            # the block's V times 2^v_shift in fp16, once per run: exact (bf16's 8 significant bits in fp16's
            # 11) down to 2^-29 of the block's max |V|, so P.V can take P in fp16 (see the module docstring)
            v_shift = tl.minimum(v_shift, 126)  # 2^v_shift and 2^-v_shift stay normal fp32
            v = (widen(v) * ((v_shift + 127) << 23).to(tl.float32, bitcast=True)).to(tl.float16)
            if DOT_FP32:
                v = widen(v)
        heads = kv_head * G + head_in_group  # [BLOCK_M]
        head_tokens = kv_head.to(tl.int64) * total_q
        # Tiles are software-pipelined by hand, in registers: tile i + 1's query rows and tile i + 2's
        # pair entries load while tile i computes.  (Triton's pipeliner keeps one buffer for the entries
        # an indirect load depends on and so waits for every copy at the top of each iteration.)
        pair_row = rows // BLOCK_H
        flat = tl.load(order_ptr + start + run_first + pair_row, mask=run_first + pair_row < run_end, other=0)
        token = (flat >> SLOT_BITS) - head_tokens
        member = run_first + pair_row < run_end
        pos = tl.load(pos_ptr + token, mask=member, other=-1)
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
            mask=(member & (head_in_group < G))[:, None],
            other=0.0,
        )  # [BLOCK_M, D]
        next_entry = run_first + BLOCK_TOK + pair_row
        next_flat = tl.load(order_ptr + start + next_entry, mask=next_entry < run_end, other=0)
        for tile_first in tl.range(run_first, run_end, BLOCK_TOK, num_stages=1):
            slot = flat & ((1 << SLOT_BITS) - 1)
            row_mask = member & (head_in_group < G)
            part_row = (slot * total_q + token) * Hq + heads  # [BLOCK_M] row of [T, total_q, Hq]
            tile_q = q
            tile_limit = tl.where(head_in_group < G, pos, -1)
            if DOT_FP32:
                tile_q = widen(tile_q)
            # prefetch: the next tile's rows (entries loaded one iteration ago), the entries after it
            next_token = (next_flat >> SLOT_BITS) - head_tokens
            next_member = tile_first + BLOCK_TOK + pair_row < run_end
            pos_next = tl.load(pos_ptr + next_token, mask=next_member, other=-1)
            q = tl.load(
                q_ptr + next_token[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=(next_member & (head_in_group < G))[:, None],
                other=0.0,
            )
            after_entry = tile_first + 2 * BLOCK_TOK + pair_row
            after_flat = tl.load(order_ptr + start + after_entry, mask=after_entry < run_end, other=0)
            o, lse, unscale = _attend_tile(
                tile_q,
                k,
                v,
                key_pos,
                tile_limit,
                diagonal,
                qk_scale,
                v_shift,
                P_DTYPE,
                DOT_FP32,
                FP16_PV,
            )
            tl.store(lse_ptr + part_row, lse, mask=row_mask)
            tl.store(unscale_ptr + part_row, unscale, mask=row_mask)
            tl.store(
                partial_ptr + part_row[:, None] * D + dims[None, :],
                to_model_dtype(o, partial_ptr.dtype.element_ty),
                mask=row_mask[:, None],
            )
            flat = next_flat
            token = next_token
            member = next_member
            pos = pos_next
            next_flat = after_flat
        run_first = run_end


@triton.jit
def merge_slots_kernel(
    keys_ptr,  # [Hkv, total_q, BLOCK_T] int32, < uncounted: the slot holds a partial
    partial_ptr,  # [T, total_q * Hq, D] fp16, scaled by 2^shift
    lse_ptr,  # [T, total_q * Hq] fp32
    unscale_ptr,  # [T, total_q * Hq] fp32: 2^-shift
    out_ptr,  # [total_q * Hq, D]
    v_scale_ptr,  # fp32 scalar, read when SCALE_OUT
    total_q,
    Hq,
    uncounted,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SCALE_OUT: tl.constexpr,  # folded v_scale (FOLD_SCALES): partials are unscaled, the merged row is not
):
    """out[row] = sum_c 2^lse_c o_c / sum_c 2^lse_c over the row's counted slots c (none -> 0)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) rows of [total_q, Hq]
    total_rows = total_q * Hq
    row_mask = rows < total_rows
    rows = tl.where(row_mask, rows, 0)
    token = rows // Hq
    kv_head = (rows - token * Hq) // G
    rows = rows.to(tl.int64)
    slots = tl.arange(0, BLOCK_T)
    keys = tl.load(
        keys_ptr + (kv_head.to(tl.int64) * total_q + token)[:, None] * BLOCK_T + slots[None, :],
        mask=row_mask[:, None],
        other=uncounted,
    )  # [BLOCK_R, BLOCK_T]
    counted = keys < uncounted
    lse = tl.load(lse_ptr + slots[None, :].to(tl.int64) * total_rows + rows[:, None], mask=counted, other=float("-inf"))
    lse_max = tl.max(lse, axis=1)
    ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.where(counted, tl.exp2(lse - ref[:, None]), 0.0)
    weight_sum = tl.sum(weights, axis=1)
    unscale = tl.load(unscale_ptr + slots[None, :].to(tl.int64) * total_rows + rows[:, None], mask=counted, other=0.0)
    part_weights = weights * unscale  # each slot's weight and its partial's 2^-shift, once per row
    dims = tl.arange(0, D)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for c in range(0, BLOCK_T):
        w = tl.sum(tl.where(slots[None, :] == c, part_weights, 0.0), axis=1)  # [BLOCK_R]
        o = tl.load(
            partial_ptr + (c * total_rows.to(tl.int64) + rows[:, None]) * D + dims[None, :],
            mask=(w > 0.0)[:, None],
            other=0.0,
        )
        acc += w[:, None] * widen(o)
    out = acc / tl.where(weight_sum > 0.0, weight_sum, 1.0)[:, None]
    if SCALE_OUT:
        out = out * tl.load(v_scale_ptr)
    tl.store(
        out_ptr + rows[:, None] * D + dims[None, :],
        to_model_dtype(out, out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


def sparse_attn_prefill_kv_centric(
    q: torch.Tensor,  # [total_q, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, Hkv, 128, 2D] storage-dtype view
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
    total_q, Hq, D = q.shape
    num_blocks, Hkv = kv_cache.shape[0], kv_cache.shape[1]
    G, D = int(Hq // Hkv), int(D)  # compile-time tile sizes
    T = topk_idx.shape[2]
    num_reqs, max_blocks = block_table.shape
    block_t = triton.next_power_of_2(int(T))
    uncounted = 2 * Hkv * num_reqs * max_blocks  # keys are 2 * group + diagonal
    torch._check(
        uncounted < 2**31, lambda: "sparse_attn_prefill: KV heads x requests x block-table width must be < 2^30"
    )
    keys = empty_row_major((Hkv, total_q, block_t), torch.int32, q.device)
    pos = torch.empty((total_q,), dtype=torch.int32, device=q.device)
    launch(
        pair_keys_kernel,
        (triton.cdiv(total_q, KEY_TOKENS), Hkv),
        topk_idx,
        block_table,
        cu_seqlens_q,
        seq_lens,
        keys,
        pos,
        total_q,
        num_reqs,
        num_blocks,
        max_blocks,
        T,
        uncounted,
        topk_idx.stride(0),
        topk_idx.stride(1),
        topk_idx.stride(2),
        block_table.stride(0),
        block_table.stride(1),
        BLOCK_TOK=KEY_TOKENS,
        BLOCK_T=block_t,
        num_warps=4,
    )
    sorted_keys, order = torch.sort(keys.view(-1), stable=True)

    block_tok = tile_tokens(G)
    block_h = schedule.head_block(G, block_tok)
    pairs = block_tok * TILES_PER_PROGRAM
    num_pairs = Hkv * total_q * block_t
    # written and read per counted slot
    partial = empty_row_major((T, total_q, Hq, D), torch.float16, q.device)
    lse = empty_row_major((T, total_q, Hq), torch.float32, q.device)
    unscale = empty_row_major((T, total_q, Hq), torch.float32, q.device)
    kv_cache, scale_mode, k_scale, v_scale, k_strides, v_strides, fp8 = kv_launch_args(
        kv_cache, fmt, scale_mode, k_scale, v_scale, seq_lens
    )
    # fp16 model over an FP8 cache with scalar or no scales: K/V stay unscaled fp16 (every FP8 value
    # fits), k_scale joins the logit factor and v_scale scales the merged rows (a slot's scaled partial
    # could overflow fp16 where the merged row, a convex combination, does not).
    fold_scales = fmt is not None and scale_mode != SCALE_PER_TOKEN_HEAD and q.dtype == torch.float16
    launch(
        kv_centric_attn_kernel,
        (triton.cdiv(num_pairs, pairs),),
        q,
        kv_cache,
        sorted_keys,
        order,
        pos,
        block_table,
        seq_lens,
        k_scale,
        v_scale,
        partial,
        lse,
        unscale,
        num_pairs,
        uncounted,
        total_q,
        Hq,
        num_reqs,
        max_blocks,
        float(sm_scale) * LOG2E,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
        block_table.stride(1),
        *k_strides,
        *v_strides,
        G=G,
        D=D,
        BLOCK_H=block_h,
        BLOCK_TOK=block_tok,
        PAIRS=pairs,
        SLOT_BITS=block_t.bit_length() - 1,
        SCALE_MODE=scale_mode,
        FOLD_SCALES=fold_scales,
        **fp8.constexprs(),
        **schedule.kernel_options(q.device, block_tok * block_h, prefill=True),
    )
    out = empty_row_major((total_q, Hq, D), q.dtype, q.device)
    launch(
        merge_slots_kernel,
        (triton.cdiv(total_q * Hq, MERGE_ROWS),),
        keys,
        partial,
        lse,
        unscale,
        out,
        v_scale,
        total_q,
        Hq,
        uncounted,
        G=G,
        D=D,
        BLOCK_R=MERGE_ROWS,
        BLOCK_T=block_t,
        SCALE_OUT=fold_scales and scale_mode == 1,
        num_warps=4,
    )
    return out
