"""The union-walk block-sparse GQA attention kernel: decode, and prefill where KV-centric does not apply.

One program owns ``BLOCK_Q`` consecutive query tokens and one KV head; its rows are the (token,
query head) pairs of that KV head, ``BLOCK_M = BLOCK_Q x BLOCK_H`` rows of a ``[BLOCK_M, D]`` q
tile (``BLOCK_H = pow2(G)``, padded so BLOCK_M >= 16 for ``tl.dot``; padded rows load q = 0 and
are never written).  Each selected 128-token block costs one dot pair (``jit.attend_block``).

* BLOCK_Q > 1 (prefill on ROCm and for long lists; NVIDIA prefill is KV-centric, ``kv_centric.py``):
  neighbouring tokens' top-k lists overlap (own and local blocks, similar scores), so the tile walks
  the *union* of its tokens' valid (request, block) keys, each once, in ascending order (a
  min-reduction gives the next key), masking the rows whose own list does not name the block.
  Every K/V tile load is shared by the tile's tokens and the dots get M = 128.  Tiles may straddle
  requests (keys carry the request).  The keys are skipped/counted with reductions first so the
  attention loop is a counted loop that Triton software-pipelines.
* BLOCK_Q = 1 (decode): a counted loop over the token's list slots.

Decode splits each token's work: split c takes distinct blocks (slots for BLOCK_Q = 1)
``[c * blocks_per_split, (c + 1) * blocks_per_split)`` (BLOCK_Q > 1: the last split takes the rest)
and writes a normalised partial + log2-sum-exp; the last split to finish merges them (``_merge_partials``), or, in
small PDL grids (``schedule.merge_plan``), ``split_merge_kernel`` launched after the grid.

Selection: slots ``[0, min(T, p // 128 + 1))`` are read (position-derived); an id that is negative,
beyond ``p // 128`` or beyond the block table, or whose page is outside the cache, is skipped
through load masks (nothing out of bounds is ever dereferenced, whatever the caller passes); the
selected blocks are a set (an id listed twice counts once).  Numerics: see ``jit.py``.
"""

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mm3_compile import platform
from mm3_compile.contract import LOG2E, SCALE_NONE, SCALE_PER_TOKEN_HEAD
from mm3_compile.kernels._launch import launch, launches_traced, use_pdl
from mm3_compile.kernels.fp8 import fp8_launch
from mm3_compile.kernels.sparse_attn import schedule
from mm3_compile.kernels.sparse_attn.jit import (
    HUGE_LOGIT,
    PAGE,
    attend_block,
    listed_id_ok,
    packed_requests,
    page_ok,
    prefetch_l2,
    scalar_scales,
    select_slots,
    slot_window,
    to_model_dtype,
    token_slots,
    widen,
)
from mm3_compile.platform import FP8Format

# One-token lists up to this many (padded) slots find repeats with a [BLOCK_T, BLOCK_T] matrix; longer
# ones slot by slot (Triton tensors hold at most 2^20 elements).
MATRIX_DEDUP_SLOTS = tl.constexpr(1024)
# One-token decode loads its request's whole block-table row (up to this many entries, 4 KB) beside its list
# and picks the pages from registers; wider tables (requests past 128K tokens) gather the listed entries.
TABLE_ROW_MAX = 1024


@triton.jit
def sparse_attn_fwd_kernel(
    q_ptr,  # [total_q, Hq, D] bf16/fp16, last dim contiguous
    kv_ptr,  # [num_blocks, Hkv, 128, 2D] model dtype, typed FP8 (FP8_NATIVE_LOAD) or uint8 bytes
    topk_ptr,  # [Hkv, total_q, T] int32, logical block ids
    block_table_ptr,  # [num_reqs, max_blocks] int32
    cu_seqlens_ptr,  # [num_reqs + 1] int32 (VARLEN only)
    seq_lens_ptr,  # [num_reqs] int32, KV length including this step's tokens
    k_scale_ptr,  # fp32: 1 element (SCALE_MODE 1) or [Hkv, num_blocks * 128] (mode 2); dummy otherwise
    v_scale_ptr,
    out_ptr,  # [total_q, Hq, D]
    partial_ptr,  # [num_splits, total_q, Hq, D] model dtype (SPLIT only)
    lse_ptr,  # [num_splits, total_q, Hq] fp32 (SPLIT only)
    arrivals_ptr,  # [cdiv(total_q, BLOCK_Q) * Hkv] int32, zero on entry and on exit (SPLIT only)
    total_q,
    num_reqs,
    q_per_req,  # uniform decode: tokens per request (not VARLEN)
    num_blocks,
    max_blocks,
    T,
    num_splits,
    blocks_per_split,  # distinct blocks (BLOCK_Q = 1: list slots) per split
    last_merges,  # SPLIT: 1: the last split of a tile to arrive merges it; 0: split_merge_kernel does
    qk_scale,  # sm_scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_tkh,
    stride_tkt,
    stride_tks,
    stride_btr,
    stride_btb,
    stride_ksh,
    stride_kss,
    stride_vsh,
    stride_vss,
    G: tl.constexpr,  # query heads per KV head
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # pow2 >= G
    BLOCK_Q: tl.constexpr,  # consecutive query tokens per program
    BLOCK_T: tl.constexpr,  # pow2 >= T
    VARLEN: tl.constexpr,  # token -> request by binary search over cu_seqlens (prefill)
    SPLIT: tl.constexpr,  # write a partial + lse per split (decode)
    FP8: tl.constexpr,  # the FP8 launch constants (kernels/fp8.py); FP8 == 0: a bf16/fp16 cache
    FP8_MAX: tl.constexpr,
    FP8_NATIVE_LOAD: tl.constexpr,
    FP8_NATIVE_STORE: tl.constexpr,
    SCALE_MODE: tl.constexpr,  # 0 none, 1 scalar, 2 per (KV head, physical slot)
    DOT_FP32: tl.constexpr,
    CONVERT_V_FIRST: tl.constexpr,  # schedule.launch_options
    V_PAIRS: tl.constexpr,  # schedule.launch_options (and an even cache: launch_sparse_attn)
    FP16_DOTS: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (sm_90+): wait for the previous grid first
    MAX_SPLITS: tl.constexpr,  # a bound of num_splits (SPLIT only): the merge's unrolled loop
    TABLE_ROW: tl.constexpr,  # pow2 bound of max_blocks for one-token tiles (0: gather the listed entries)
):
    """Rows of the tile are (token, query head) pairs: row = token_in_tile * BLOCK_H + head_in_group."""
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    ROW_PAGES: tl.constexpr = BLOCK_Q == 1 and not VARLEN and BLOCK_T <= MATRIX_DEDUP_SLOTS and TABLE_ROW > 0
    if PDL:
        # Every input (q, lists, tables, the cache, the counters) may come from the previous kernel: no
        # load before the wait.  What overlaps is this grid's launch and the previous grid's tail, and
        # (one-token tiles) the L2 prefetch of this program's first dependent loads; the next dependent
        # launch may start its own launch as soon as every program is here.
        if ROW_PAGES:
            # from program ids and sizes only, every address clamped inside its tensor: what token_slots and
            # the q load read first (seq_len, the list, the table row, the KV head's q rows; FP8 scalar scales)
            p_token = tl.program_id(0) // num_splits
            p_req = p_token // q_per_req
            p_slots = tl.minimum(tl.arange(0, BLOCK_T), T - 1)
            p_entries = tl.minimum(tl.arange(0, TABLE_ROW), max_blocks - 1)
            p_heads = tl.program_id(1) * G + tl.minimum(tl.arange(0, BLOCK_H), G - 1)
            p_halves = tl.arange(0, 2) * (D // 2)  # a bf16/fp16 row of D = 128 spans two 128-byte lines
            prefetch_l2(seq_lens_ptr + p_req)
            prefetch_l2(
                topk_ptr
                + tl.program_id(1).to(tl.int64) * stride_tkh
                + p_token.to(tl.int64) * stride_tkt
                + p_slots * stride_tks
            )
            prefetch_l2(block_table_ptr + p_req.to(tl.int64) * stride_btr + p_entries.to(tl.int64) * stride_btb)
            prefetch_l2(q_ptr + p_token.to(tl.int64) * stride_qt + p_heads[:, None] * stride_qh + p_halves[None, :])
            if SCALE_MODE == 1:  # a layer's scalar FP8 scales are as cold as its cache
                prefetch_l2(k_scale_ptr)
                prefetch_l2(v_scale_ptr)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes Python floats as fp64 scalars
    NO_KEY = tl.full([], 0x3FFFFFFFFFFFFFFF, tl.int64)  # sorts after every real (request, block) key
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # A tile's splits are adjacent programs: they finish together for the merge.
    tile = pid // num_splits
    split = pid % num_splits
    MODEL_DTYPE: tl.constexpr = q_ptr.dtype.element_ty

    rows = tl.arange(0, BLOCK_M)
    token = tile * BLOCK_Q + rows // BLOCK_H  # [BLOCK_M]
    head_in_group = rows % BLOCK_H
    token_ok = token < total_q
    row_mask = token_ok & (head_in_group < G)
    token = tl.where(token_ok, token, 0)
    if VARLEN:
        req, q_len, offset, inside = packed_requests(cu_seqlens_ptr, num_reqs, token)
        packed = token_ok & inside  # tokens outside every request see nothing (their rows are 0)
    else:
        req = token // q_per_req
        q_len = q_per_req
        offset = token - req * q_per_req
        packed = token_ok
    pos, last_block, n_slots = slot_window(seq_lens_ptr, req, q_len, offset, packed, T)  # [BLOCK_M] each

    # The tile's keys: (request, logical block) of every valid slot, NO_KEY for skipped ones.
    slots = tl.arange(0, BLOCK_T)
    LONG_LIST: tl.constexpr = BLOCK_Q == 1 and BLOCK_T > MATRIX_DEDUP_SLOTS
    if ROW_PAGES:
        # one token per tile (BLOCK_M = BLOCK_H rows of it): its request from arithmetic, no load to wait on
        tile_req = tile // q_per_req
        tok_ids, tok_pages = token_slots(
            topk_ptr,
            block_table_ptr,
            seq_lens_ptr,
            kv_head,
            tile,
            tile_req,
            q_per_req,
            tile - tile_req * q_per_req,
            num_blocks,
            max_blocks,
            stride_tkh,
            stride_tkt,
            stride_tks,
            stride_btr,
            stride_btb,
            T,
            BLOCK_T,
            TABLE_ROW,
        )  # [BLOCK_T] each
    elif not LONG_LIST:
        ids, pages, valid = select_slots(
            topk_ptr,
            block_table_ptr,
            kv_head,
            token,
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
        )  # [BLOCK_M, BLOCK_T] each
        keys = tl.where(valid, req[:, None].to(tl.int64) * max_blocks + ids, NO_KEY)  # [BLOCK_M, BLOCK_T]

    dims = tl.arange(0, D)
    offs = tl.arange(0, PAGE)
    heads = kv_head * G + head_in_group
    q_ptrs = q_ptr + token[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)  # [BLOCK_M, D]

    k_scale, v_scale = scalar_scales(k_scale_ptr, v_scale_ptr, SCALE_MODE)
    if FP16_DOTS:
        # Scale each row by the power of two that brings its largest |q| into [2^14, 2^15): exact,
        # and fp16 then holds every element of at least 2^-28 of that maximum with all of bf16's
        # bits (smaller ones become fp16 subnormals, off by < 2^-38 of the maximum).  The shift
        # spans fp32's normal exponents, which cover every bf16 maximum (a subnormal maximum below
        # 2^-113 lands in [2^-6, 2^14), still normal in fp16).  Rows whose maximum is 0, inf or NaN
        # keep scale 1.  The logit factor is formed in fp64: sm_scale * k_scale alone may pass fp32.
        q = widen(q)
        row_max = tl.max(tl.abs(q), axis=1)  # [BLOCK_M]
        max_exponent = ((row_max.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        usable = (row_max > 0.0) & (row_max < float("inf"))
        shift = tl.where(usable, tl.minimum(tl.maximum(14 - max_exponent, -126), 127), 0)
        q_scale = ((shift + 127) << 23).to(tl.float32, bitcast=True)  # 2^shift
        q = (q * q_scale[:, None]).to(tl.float16)
        factor = qk_scale.to(tl.float64) * tl.cast(k_scale, tl.float64) / q_scale.to(tl.float64)
        qk_scale = factor.to(tl.float32)[:, None]  # [BLOCK_M, 1] logit factor per row
    if DOT_FP32:
        q = widen(q)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    low = tl.full([BLOCK_M], float("inf"), tl.float32)
    head_base = kv_ptr + kv_head.to(tl.int64) * stride_kh
    if BLOCK_Q == 1:
        # One token: walk its slots with a counted loop.  Every slot's page was resolved above, with
        # the list and the block table read once as vectors, so the loop's only memory traffic is
        # K/V, whose addresses come from registers: the software pipeliner can load block i + 1 while
        # block i is computed (per-slot id -> block-table loads made each step wait on two dependent
        # latencies before its K/V copy could even start).  A slot counts if valid and no earlier
        # slot names the same block.  Split c owns slots [c * blocks_per_split, (c + 1) * blocks_per_split).
        # A long list (LONG_LIST: dense layers pass every block of a wide table) would need a
        # [BLOCK_T, BLOCK_T] repeat matrix past Triton's 2^20-element limit: it is read once as a
        # vector, each slot is compared with the earlier ones when the loop reaches it, and its page
        # is read then (one dependent load per block, small next to the block's 32-64 KB).
        tok_pos = tl.max(pos)
        tok_req = tl.max(req)
        tok_seq_len = tl.load(seq_lens_ptr + tok_req)
        if LONG_LIST:
            tok_last_block = tl.max(last_block)
            list_ptr = topk_ptr + kv_head.to(tl.int64) * stride_tkh + tl.max(token).to(tl.int64) * stride_tkt
            tok_ids = tl.load(list_ptr + slots * stride_tks, mask=slots < tl.max(n_slots), other=-1)  # [BLOCK_T]
        else:
            if not ROW_PAGES:
                tok_ids = tl.max(ids, axis=0)  # [BLOCK_T] every row holds the same token's list
                tok_pages = tl.max(tl.where(valid, pages, -1), axis=0)  # [BLOCK_T], -1: slot skipped
            earlier = slots[None, :] < slots[:, None]  # [BLOCK_T, BLOCK_T]: slot s' comes before slot s
            repeat = tl.max(((tok_ids[None, :] == tok_ids[:, None]) & earlier).to(tl.int32), axis=1) > 0
            # (page, block) of each slot in one int64: the loop picks its slot with a single reduction
            slot_keys = tl.where((tok_pages >= 0) & ~repeat, (tok_pages.to(tl.int64) << 32) | tok_ids.to(tl.int64), -1)
        slot_begin = split * blocks_per_split
        slot_end = tl.minimum(slot_begin + blocks_per_split, tl.max(n_slots))
        for slot in range(slot_begin, slot_end):
            if LONG_LIST:
                listed = tl.load(list_ptr + slot * stride_tks)
                repeat = tl.max(((tok_ids == listed) & (slots < slot)).to(tl.int32)) > 0
                id_ok = listed_id_ok(listed, tok_last_block, max_blocks) & ~repeat
                listed_page = tl.load(
                    block_table_ptr + tok_req.to(tl.int64) * stride_btr + tl.where(id_ok, listed, 0) * stride_btb,
                    mask=id_ok,
                    other=-1,
                )
                listed_ok = id_ok & page_ok(listed_page, num_blocks)
                slot_key = tl.where(listed_ok, (listed_page.to(tl.int64) << 32) | listed.to(tl.int64), -1)
            else:
                slot_key = tl.max(tl.where(slots == slot, slot_keys, -1))
            slot_ok = slot_key >= 0
            page = tl.where(slot_ok, slot_key >> 32, 0)
            block = (slot_key & 0x7FFFFFFF).to(tl.int32)
            # -1 marks a skipped slot (a scalar-bool & vector mask trips the interpreter)
            key_pos = tl.where(slot_ok, block * PAGE + offs, -1)  # [128] logical positions
            key_ok = (key_pos >= 0) & (key_pos < tok_seq_len)
            visible = key_ok[None, :] & (key_pos[None, :] <= tok_pos)  # [BLOCK_M, 128]
            m, l, acc, low = attend_block(
                q,
                m,
                l,
                acc,
                low,
                head_base,
                page,
                key_ok,
                visible,
                k_scale,
                v_scale,
                k_scale_ptr,
                v_scale_ptr,
                kv_head,
                qk_scale,
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
                FP16_DOTS,
                FP8,
                FP8_NATIVE_LOAD,
                CONVERT_V_FIRST,
                V_PAIRS,
            )
    else:
        # Several tokens: walk the distinct keys of the tile once each, in ascending order (a
        # min-reduction gives the next one).  Skip the keys of earlier splits and count this
        # split's with reductions only, so the attention loop itself is counted (pipelinable).
        key = tl.min(keys)
        for _ in range(0, split * blocks_per_split):
            key = tl.min(tl.where(keys > key, keys, NO_KEY))
        limit = tl.where(split == num_splits - 1, 0x7FFFFFFF, blocks_per_split)
        count = tl.full([], 0, tl.int32)  # a tensor from the start: loop-carried values keep one type
        probe = key
        while (probe != NO_KEY) & (count < limit):
            count += 1
            probe = tl.min(tl.where(keys > probe, keys, NO_KEY))
        for _ in range(0, count):
            block_req = key // max_blocks
            block = (key - block_req * max_blocks).to(tl.int32)
            member = tl.max((keys == key).to(tl.int32), axis=1) > 0  # [BLOCK_M] rows whose list names it
            page = tl.load(block_table_ptr + block_req * stride_btr + block * stride_btb).to(tl.int64)
            key_pos = block * PAGE + offs  # [128] logical positions
            key_ok = key_pos < tl.load(seq_lens_ptr + block_req)
            visible = member[:, None] & key_ok[None, :] & (key_pos[None, :] <= pos[:, None])  # [BLOCK_M, 128]
            m, l, acc, low = attend_block(
                q,
                m,
                l,
                acc,
                low,
                head_base,
                page,
                key_ok,
                visible,
                k_scale,
                v_scale,
                k_scale_ptr,
                v_scale_ptr,
                kv_head,
                qk_scale,
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
                FP16_DOTS,
                FP8,
                FP8_NATIVE_LOAD,
                CONVERT_V_FIRST,
                V_PAIRS,
            )
            key = tl.min(tl.where(keys > key, keys, NO_KEY))  # next distinct key in ascending order

    has_keys = l > 0.0
    o = acc / tl.where(has_keys, l, 1.0)[:, None]  # rows that saw no key stay exactly 0
    huge = (m >= HUGE_LOGIT) | (low <= -HUGE_LOGIT)  # the contract's NaN rows, as in every schedule
    o = tl.where(huge[:, None], float("nan"), o)
    # FP16_DOTS: v_scale multiplies the normalised output (acc, a sum of up to T * 128 weighted values,
    # could overflow); a split's partial stays unscaled (|o| <= max |FP8|) and the merger scales the
    # merged row, which may fit the model dtype where one split's scaled partial would not.
    o_out = o
    if FP16_DOTS:
        o_out = o * v_scale
    Hq = G * tl.num_programs(1)
    row_offset = token.to(tl.int64) * Hq + heads  # [BLOCK_M] (token, head) row of [total_q, Hq]
    out_ptrs = out_ptr + row_offset[:, None] * D + dims[None, :]
    if SPLIT:
        if num_splits > 1:
            # Write this split's partial.  last_merges: the last of the tile's splits to arrive merges
            # them all in this launch.  NVIDIA ordering (the launcher never splits on ROCm): the CTA
            # barrier orders every thread's partial stores before thread 0's GPU-scope acq_rel arrival;
            # the merger acquires the same counter and reads the partials from L2 (.cg).  Otherwise
            # split_merge_kernel, launched next, merges them after this grid has ended.
            split_rows = total_q * Hq
            part_offset = split.to(tl.int64) * split_rows + row_offset
            lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("-inf"))
            lse = tl.where(huge, float("nan"), lse)
            tl.store(lse_ptr + part_offset, lse, mask=row_mask)
            tl.store(
                partial_ptr + part_offset[:, None] * D + dims[None, :],
                to_model_dtype(o, partial_ptr.dtype.element_ty),
                mask=row_mask[:, None],
            )
            if last_merges != 0:
                tl.debug_barrier()
                counter = arrivals_ptr + tile * tl.num_programs(1) + kv_head
                if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
                    # Zero again for the next call / CUDA-graph replay.  Relaxed: every split has arrived, so
                    # nothing else in this launch touches the counter, and the next launch starts after this
                    # one ends; acq_rel would add a GPU-scope fence on the merger's path.
                    tl.atomic_xchg(counter, 0, sem="relaxed")
                    _merge_partials(
                        partial_ptr,
                        lse_ptr,
                        out_ptrs,
                        row_offset,
                        row_mask,
                        split_rows,
                        num_splits,
                        v_scale,
                        D,
                        FP16_DOTS,
                        MAX_SPLITS,
                    )
        else:
            tl.store(out_ptrs, to_model_dtype(o_out, out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        tl.store(out_ptrs, to_model_dtype(o_out, out_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit
def _merge_partials(
    partial_ptr,
    lse_ptr,
    out_ptrs,
    row_offset,
    row_mask,
    split_rows,
    num_splits,
    out_scale,
    D: tl.constexpr,
    SCALE_OUT: tl.constexpr,
    MAX_SPLITS: tl.constexpr,  # a bound of num_splits
):
    """out = sum_c 2^(lse_c - M) o_c / sum_c 2^(lse_c - M), M = max_c lse_c, times ``out_scale`` if SCALE_OUT; a
    row with no key in any split -> 0, a NaN lse -> a NaN row.

    Both loops over splits are unrolled to MAX_SPLITS (splits past num_splits load nothing): their loads do
    not depend on each other and nothing between them waits on a barrier, so they are all in flight at once
    (a counted loop issued each split's loads after the previous split's arithmetic: one L2 round trip per
    split, ~0.3 us each on the H200 for the 16 splits of a one-token step).  The maximum comes first so that
    every split's weight is one exp2 of its own, where a running maximum rescaled the accumulator at every
    split (a chain of dependent exp2s): one-token steps with 16 splits took 0.15-0.28 us less (bench/NOTES.md,
    session 37)."""
    dims = tl.arange(0, D)
    lse_max = tl.full(row_offset.shape, float("-inf"), tl.float32)
    for c in tl.static_range(MAX_SPLITS):
        mask = row_mask & (tl.full(row_offset.shape, c, tl.int32) < num_splits)  # a vector: see key_pos above
        part_offset = c * tl.cast(split_rows, tl.int64) + row_offset  # an int where a trace specialised it
        lse = tl.load(lse_ptr + part_offset, mask=mask, other=float("-inf"), cache_modifier=".cg")
        lse_max = tl.maximum(lse_max, lse)
    ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no key in any split: weights 0, nothing NaN
    weight_sum = tl.zeros(row_offset.shape, tl.float32)
    acc = tl.zeros([row_offset.shape[0], D], tl.float32)
    for c in tl.static_range(MAX_SPLITS):
        mask = row_mask & (tl.full(row_offset.shape, c, tl.int32) < num_splits)
        part_offset = c * tl.cast(split_rows, tl.int64) + row_offset  # an int where a trace specialised it
        # the same lse load as above (the same address expression): the compiler issues it once
        lse = tl.load(lse_ptr + part_offset, mask=mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(
            partial_ptr + part_offset[:, None] * D + dims[None, :],
            mask=mask[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        w = tl.exp2(lse - ref)
        acc += w[:, None] * widen(o)
        weight_sum += w
    out = acc / tl.where(weight_sum > 0.0, weight_sum, 1.0)[:, None]
    if SCALE_OUT:
        out = out * out_scale
    tl.store(out_ptrs, to_model_dtype(out, out_ptrs.dtype.element_ty), mask=row_mask[:, None])


@triton.jit
def split_merge_kernel(
    partial_ptr,  # [num_splits, rows, D] model dtype
    lse_ptr,  # [num_splits, rows] fp32
    out_ptr,  # [rows, D] model dtype
    v_scale_ptr,  # fp32 scalar (SCALE_MODE 1), else unread
    rows,  # total_q * Hq: (token, query head) rows
    num_splits,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program
    SCALE_MODE: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # the partials are unscaled: the merged row takes v_scale
    MAX_SPLITS: tl.constexpr,  # a bound of num_splits
    PDL: tl.constexpr,  # launched as a programmatic dependent launch: wait for the attention grid first
):
    """The split merge of ``sparse_attn_fwd_kernel`` launched after it (``last_merges == 0``): ``BLOCK_R`` rows per
    program, the same arithmetic as the last arrival's merge (``_merge_partials``), so the same bits.  With one
    split at run time the attention grid stored the output itself."""
    if PDL:
        tl.extra.cuda.gdc_wait()  # the partials are the previous grid's: nothing is read before it ends
        tl.extra.cuda.gdc_launch_dependents()
    if num_splits > 1:
        row_offset = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        row_mask = row_offset < rows
        _, v_scale = scalar_scales(v_scale_ptr, v_scale_ptr, SCALE_MODE)
        out_ptrs = out_ptr + row_offset[:, None] * D + tl.arange(0, D)[None, :]
        _merge_partials(
            partial_ptr, lse_ptr, out_ptrs, row_offset, row_mask, rows, num_splits, v_scale, D, FP16_DOTS, MAX_SPLITS
        )


def max_splits(num_splits, T) -> int:
    """``MAX_SPLITS`` of a split launch: its split count, or T for a symbolic count (the shape-derived plan never
    splits a list of T slots more than T ways), rounded up to a power of two (fewer distinct compiled kernels).

    Examples:
        >>> max_splits(3, 16)
        4
    """
    return triton.next_power_of_2(int(num_splits if isinstance(num_splits, int) else T))


def table_row(max_blocks, one_token_decode: bool) -> int:
    """``TABLE_ROW`` of a launch: the block table's width rounded up to a power of two for a one-token decode
    tile of a static width up to ``TABLE_ROW_MAX``, else 0 (the listed entries are gathered).

    Examples:
        >>> table_row(256, True), table_row(2048, True), table_row(256, False)
        (256, 0, 0)
    """
    if not one_token_decode or not isinstance(max_blocks, int) or max_blocks > TABLE_ROW_MAX:
        return 0
    return triton.next_power_of_2(max_blocks)


def pairs_aligned(kv_cache: torch.Tensor) -> bool:
    """Whether an FP8 cache's V rows start at even bytes (``V_PAIRS`` reads them as int16): even strides and
    offset, and an even address where the cache has one (a traced cache's storage is the allocator's)."""
    offsets = (kv_cache.storage_offset(), *kv_cache.stride()[:3])
    if not all(statically_known_true(offset % 2 == 0) for offset in offsets):
        return False
    return launches_traced() or kv_cache.data_ptr() % 2 == 0


def kv_launch_args(kv_cache, fmt: FP8Format | None, scale_mode: int, k_scale, v_scale, placeholder: torch.Tensor):
    """What every attention launch passes about the cache: the cache as the kernel reads it (typed FP8,
    or bytes decoded with integer arithmetic where Triton lacks the type), the scale mode (none for
    bf16/fp16 caches), scale tensors (``placeholder`` where none is read: the kernel's scale branches
    are compiled out), per-slot scale strides, and the cache's :class:`~mm3_compile.kernels.fp8.FP8Launch`."""
    fp8 = fp8_launch(fmt, kv_cache)
    if fmt is None:
        scale_mode = SCALE_NONE
    if scale_mode == SCALE_NONE:
        k_scale = v_scale = placeholder
    k_strides = tuple(k_scale.stride()) if scale_mode == SCALE_PER_TOKEN_HEAD else (0, 0)
    v_strides = tuple(v_scale.stride()) if scale_mode == SCALE_PER_TOKEN_HEAD else (0, 0)
    return fp8.view(kv_cache), scale_mode, k_scale, v_scale, k_strides, v_strides, fp8


def launch_sparse_attn(
    q: torch.Tensor,  # [total_q, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, Hkv, 128, 2D] in its storage dtype (typed FP8 view for FP8)
    fmt: FP8Format | None,
    topk_idx: torch.Tensor,  # [Hkv, total_q, T] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor | None,  # [num_reqs + 1] int32 (prefill) or None (uniform decode)
    seq_lens: torch.Tensor,  # [num_reqs] int32
    sm_scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    scale_mode: int,
    out: torch.Tensor,  # [total_q, Hq, D]
    split_buffers: tuple | None,  # decode: (o_partial, lse, arrivals), see ``sparse_attn_fwd_kernel``
    q_per_req,
    num_splits,
    blocks_per_split,
    block_q: int,  # consecutive query tokens per program
    dependent_merge: bool | None = None,  # override (tests): whether split decode may merge in split_merge_kernel
) -> None:
    total_q, Hq, D = q.shape
    num_blocks, Hkv = kv_cache.shape[0], kv_cache.shape[1]
    # Head counts and the head dim are compile-time tile sizes: a symbolic trace specialises them.
    G, D = int(Hq // Hkv), int(D)
    block_h = schedule.head_block(G, block_q)
    T = topk_idx.shape[2]
    num_reqs = seq_lens.shape[0]
    kv_cache, scale_mode, k_scale, v_scale, k_strides, v_strides, fp8 = kv_launch_args(
        kv_cache, fmt, scale_mode, k_scale, v_scale, seq_lens
    )
    grid = (triton.cdiv(total_q, block_q) * num_splits, Hkv)
    decode_tile = cu_seqlens_q is None and block_q == 1
    # Decode steps are a few microseconds: overlapping the launch with the previous kernel's tail matters.
    pdl = cu_seqlens_q is None and use_pdl(q.device)
    # A dependent merge launch only pays where PDL hides it (and runs in the interpreter, where nothing is timed).
    if dependent_merge is None:
        dependent_merge = decode_tile and (pdl or platform.interpreting())
    dependent_merge = dependent_merge and split_buffers is not None
    last_merges = schedule.merge_plan(triton.cdiv(total_q, block_q) * Hkv) if dependent_merge else 1
    fp16_dots = schedule.fp16_dots(fmt, scale_mode)
    merge_bound = max_splits(num_splits, T) if split_buffers is not None else 1
    options = schedule.kernel_options(
        q.device,
        block_q * block_h,
        prefill=cu_seqlens_q is not None,
        fp8_decode=fmt is not None and decode_tile,
        decode_programs=grid[0] * Hkv if decode_tile else None,
        blocks_per_program=blocks_per_split if decode_tile else None,
        fp16_dots=fp16_dots,
    )
    # V_PAIRS reads V as int16: every V row must start at an even byte (any dense cache does)
    options["V_PAIRS"] = options["V_PAIRS"] and pairs_aligned(kv_cache)
    launch(
        sparse_attn_fwd_kernel,
        grid,
        q,
        kv_cache,
        topk_idx,
        block_table,
        cu_seqlens_q if cu_seqlens_q is not None else seq_lens,
        seq_lens,
        k_scale,
        v_scale,
        out,
        *(split_buffers if split_buffers is not None else (out, out, out)),
        total_q,
        num_reqs,
        q_per_req,
        num_blocks,
        block_table.shape[1],
        T,
        num_splits,
        blocks_per_split,
        last_merges,
        float(sm_scale) * LOG2E,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        topk_idx.stride(0),
        topk_idx.stride(1),
        topk_idx.stride(2),
        block_table.stride(0),
        block_table.stride(1),
        *k_strides,
        *v_strides,
        G=G,
        D=D,
        BLOCK_H=block_h,
        BLOCK_Q=block_q,
        BLOCK_T=triton.next_power_of_2(int(T)),
        VARLEN=cu_seqlens_q is not None,
        SPLIT=split_buffers is not None,
        SCALE_MODE=scale_mode,
        FP16_DOTS=fp16_dots,
        MAX_SPLITS=merge_bound,
        TABLE_ROW=table_row(block_table.shape[1], decode_tile),
        **fp8.constexprs(),
        pdl=pdl,
        **options,
    )
    if dependent_merge:
        rows = total_q * Hq
        block_r = schedule.merge_rows(rows, q.device)
        merge_grid = triton.cdiv(rows, block_r) * (1 - last_merges)  # 0 (no launch) where the last arrival merges
        if isinstance(merge_grid, int) and merge_grid == 0:
            return
        launch(
            split_merge_kernel,
            (merge_grid,),
            split_buffers[0],
            split_buffers[1],
            out,
            v_scale,
            rows,
            num_splits,
            D=D,
            BLOCK_R=block_r,
            SCALE_MODE=scale_mode,
            FP16_DOTS=fp16_dots,
            MAX_SPLITS=merge_bound,
            pdl=pdl,
            num_warps=schedule.MERGE_WARPS,
        )
