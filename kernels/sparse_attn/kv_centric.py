"""KV-centric block-sparse prefill: each program loads one block once and attends every pair that names it.

The union walk (``common.py``, BLOCK_Q > 1) hands a tile of consecutive tokens every block any of
them selected; with independent lists most of its dot rows are masked (~28% useful at TP1 1x8192)
and each block is re-read by every tile whose union holds it.  Here the (token, slot) pairs are
grouped by the (KV head, request, block) they name with one sort on the device.  A *chunk* is up to
``pairs_per_chunk`` consecutive pairs of one group: its program loads and converts the block's K/V
once, then walks the chunk in tiles of ``BLOCK_TOK`` tokens x ``BLOCK_H`` heads, every row useful:
per tile one ``[BLOCK_M, D] x [D, 128]`` and one ``[BLOCK_M, 128] x [128, D]`` dot, with the next
tile's query rows gathered while this one computes (software-pipelined counted loop).  Each pair
writes its normalised partial and log2-sum-exp at ``[slot, token, head]``; ``merge_slots_kernel``
combines a token's slots like decode combines its splits.

Which slots count is the contract's rule (see ``common.py``), evaluated with tensor ops: slots
``< min(T, p // 128 + 1)``, ids in ``[0, p // 128]`` and inside the block table, pages inside the
cache, an id listed twice counted once.  The number of chunks depends on the lists, so the grid is
the shape-derived bound ``ceil(pairs / pairs_per_chunk) + groups``; programs past the last chunk
return at once.  Nothing here synchronises with the host, so the launcher traces into one graph.

Numerics match the union walk's per block (same operand roundings, ``_attend_loaded``); a token's
blocks are combined from fp32 partials, like decode's splits.
"""

import torch
import triton
import triton.language as tl

from mm3_compile.kernels._launch import empty_row_major, launch
from mm3_compile.kernels.fp8 import format_constants
from mm3_compile.kernels.sparse_attn.common import (
    LOG2E,
    PAGE,
    _attend_loaded,
    _load_block,
    _prepare_q,
    kernel_options,
)
from mm3_compile.ops._kv import SCALE_NONE, SCALE_PER_TOKEN_HEAD
from mm3_compile.platform import FP8Format, triton_native_fp8

PAGE_TOKENS = PAGE.value
PAIR_ROWS = 128  # rows (token x query head) per tile: the tensor cores' tile height
MAX_TILE_TOKENS = 16
TILES_PER_CHUNK = 16  # tiles that share one loaded block: amortises its load and conversion
MERGE_ROWS = 32
# fp32: model-dtype partials add a rounding per block that the union walk does not have.
PARTIAL_DTYPE = torch.float32


def tile_tokens(G: int) -> int:
    """Pairs (tokens) per tile: 128 rows of pow2(G) heads each."""
    return max(1, min(MAX_TILE_TOKENS, PAIR_ROWS // triton.next_power_of_2(int(G))))


def slot_bits(T: int) -> int:
    """Bits of a pair's slot in its packed ``token << bits | slot`` (the kernel unpacks with shifts)."""
    return max(1, (int(T) - 1).bit_length())


def group_pairs(topk_idx, block_table, cu_seqlens_q, seq_lens, num_blocks: int, pairs_per_chunk: int):
    """The pairs sorted by the block they name, and each program's chunk of them.

    Returns pairs [N] int32 (N = Hkv * total_q * T): ``token << slot_bits | slot`` of each sorted pair
    (counted pairs first, grouped, tokens ascending inside a group);
    group_start [groups + 1] int32: each group's first sorted pair (groups = Hkv * num_reqs *
    max_blocks, group = (head * num_reqs + request) * max_blocks + block); chunk_group [grid] int32:
    each program's group, ``groups`` for programs without a chunk; chunk_first [grid] int32: its first
    pair; pos [total_q] int32: each token's absolute position.
    """
    Hkv, total_q, T = topk_idx.shape
    num_reqs, max_blocks = block_table.shape
    device = topk_idx.device
    tokens = torch.arange(total_q, device=device)
    cu = cu_seqlens_q.long()
    req = torch.searchsorted(cu[1:], tokens, right=True).clamp(max=num_reqs - 1)  # empty requests skipped
    q_start = cu[req]
    pos = seq_lens.long()[req] - (cu[req + 1] - q_start) + (tokens - q_start)  # [total_q]
    last_block = torch.where(pos >= 0, torch.div(pos, PAGE_TOKENS, rounding_mode="floor"), -1)
    n_slots = torch.clamp(last_block + 1, min=0, max=T)
    ids = topk_idx.long()  # [Hkv, total_q, T]
    slots = torch.arange(T, device=device)
    counted = (slots < n_slots[:, None]) & (ids >= 0) & (ids <= last_block[:, None]) & (ids < max_blocks)
    pages = torch.gather(block_table.long()[req].expand(Hkv, total_q, max_blocks), 2, torch.where(counted, ids, 0))
    counted = counted & (pages >= 0) & (pages < num_blocks)
    repeat = ((ids[..., :, None] == ids[..., None, :]) & (slots[None, :] < slots[:, None])).any(-1)
    counted = counted & ~repeat
    heads = torch.arange(Hkv, device=device)[:, None, None]
    groups = Hkv * num_reqs * max_blocks
    keys = torch.where(counted, (heads * num_reqs + req[None, :, None]) * max_blocks + ids, groups)
    sorted_keys, order = torch.sort(keys.reshape(-1), stable=True)
    packed = (tokens[:, None] << slot_bits(T)) | slots  # [total_q, T]
    pairs = torch.take(packed.to(torch.int32), order % (total_q * T))
    group_start = torch.searchsorted(sorted_keys, torch.arange(groups + 1, device=device))
    chunks = torch.div(group_start[1:] - group_start[:-1] + pairs_per_chunk - 1, pairs_per_chunk, rounding_mode="floor")
    chunk_end = torch.cumsum(chunks, 0)  # [groups]
    grid = (Hkv * total_q * T + pairs_per_chunk - 1) // pairs_per_chunk + groups
    program = torch.arange(grid, device=device)
    chunk_group = torch.searchsorted(chunk_end, program, right=True)  # [grid], groups past the last chunk
    group = chunk_group.clamp(max=groups - 1)
    chunk_first = group_start[group] + (program - (chunk_end[group] - chunks[group])) * pairs_per_chunk
    return pairs, group_start.to(torch.int32), chunk_group.to(torch.int32), chunk_first.to(torch.int32), pos.to(torch.int32)


@triton.jit
def kv_centric_attn_kernel(
    q_ptr,  # [total_q, Hq, D]
    kv_ptr,  # [num_blocks, Hkv, 128, 2D]
    pairs_ptr,  # [N] int32 token << SLOT_BITS | slot of each sorted pair
    group_start_ptr,  # [groups + 1] int32
    chunk_group_ptr,  # [grid] int32, >= groups: no chunk
    chunk_first_ptr,  # [grid] int32
    pos_ptr,  # [total_q] int32
    block_table_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    k_scale_ptr,
    v_scale_ptr,
    partial_ptr,  # [T, total_q, Hq, D] PARTIAL_DTYPE
    lse_ptr,  # [T, total_q, Hq] fp32, -inf where no pair writes
    groups,
    total_q,
    Hq,
    num_reqs,
    max_blocks,
    T,
    pairs_per_chunk,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_btr, stride_btb,
    stride_ksh, stride_kss,
    stride_vsh, stride_vss,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_TOK: tl.constexpr,
    IS_FP8: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_FNUZ: tl.constexpr,
    FP8_HAS_INF: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    SLOT_BITS: tl.constexpr,
):  # fmt: skip
    """Rows of a tile are (pair, query head): row = pair_in_tile * BLOCK_H + head_in_group."""
    BLOCK_M: tl.constexpr = BLOCK_TOK * BLOCK_H
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes Python floats as fp64 scalars
    MODEL_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    P_DTYPE: tl.constexpr = tl.float16 if FP16_DOTS else MODEL_DTYPE
    pid = tl.program_id(0)
    group = tl.load(chunk_group_ptr + pid)
    if group < groups:
        first = tl.load(chunk_first_ptr + pid)
        end = tl.minimum(tl.load(group_start_ptr + group + 1), first + pairs_per_chunk)
        block = group % max_blocks
        head_req = group // max_blocks
        req = head_req % num_reqs
        kv_head = head_req // num_reqs
        page = tl.load(block_table_ptr + req.to(tl.int64) * stride_btr + block * stride_btb).to(tl.int64)
        offs = tl.arange(0, PAGE)
        dims = tl.arange(0, D)
        key_pos = block * PAGE + offs  # [128] logical positions
        key_ok = key_pos < tl.load(seq_lens_ptr + req)
        k_scale = 1.0
        v_scale = 1.0
        if SCALE_MODE == 1:
            k_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
        k, v = _load_block(
            kv_ptr + kv_head.to(tl.int64) * stride_kh, page, key_ok, k_scale, v_scale, k_scale_ptr, v_scale_ptr, kv_head,
            stride_kb, stride_kt, stride_ksh, stride_kss, stride_vsh, stride_vss,
            D, MODEL_DTYPE, IS_FP8, NATIVE_FP8, SCALE_MODE, DOT_FP32, FP8_MANT, FP8_BIAS, FP8_FNUZ, FP8_HAS_INF,
            FP16_DOTS,
        )  # [D, 128], [128, D]: loaded and converted once for the whole chunk  # fmt: skip
        rows = tl.arange(0, BLOCK_M)
        head_in_group = rows % BLOCK_H
        heads = kv_head * G + head_in_group  # [BLOCK_M]
        for tile_first in range(first, end, BLOCK_TOK):
            entry = tile_first + rows // BLOCK_H  # [BLOCK_M] sorted pair of each row
            member = entry < end
            pair = tl.load(pairs_ptr + entry, mask=member, other=0)
            token = pair >> SLOT_BITS  # int32 shifts: a 64-bit division is a ~100-instruction call per row
            slot = pair & ((1 << SLOT_BITS) - 1)
            row_mask = member & (head_in_group < G)
            pos = tl.load(pos_ptr + token, mask=member, other=-1)
            q = tl.load(q_ptr + token[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                        mask=row_mask[:, None], other=0.0)  # [BLOCK_M, D]  # fmt: skip
            q, row_scale = _prepare_q(q, qk_scale, k_scale, FP16_DOTS, DOT_FP32)
            visible = row_mask[:, None] & key_ok[None, :] & (key_pos[None, :] <= pos[:, None])  # [BLOCK_M, 128]
            m, l, acc = _attend_loaded(
                q, tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
                tl.zeros([BLOCK_M, D], tl.float32), k, v, visible, row_scale, P_DTYPE, DOT_FP32,
            )  # fmt: skip
            has_keys = l > 0.0
            o = acc / tl.where(has_keys, l, 1.0)[:, None]
            if FP16_DOTS:
                o = o * v_scale
            lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("-inf"))
            part_row = (slot.to(tl.int64) * total_q + token) * Hq + heads  # [BLOCK_M] row of [T, total_q, Hq]
            tl.store(lse_ptr + part_row, lse, mask=row_mask)
            tl.store(partial_ptr + part_row[:, None] * D + dims[None, :], o.to(partial_ptr.dtype.element_ty),
                     mask=row_mask[:, None])  # fmt: skip


@triton.jit
def merge_slots_kernel(
    partial_ptr,  # [T, rows, D]
    lse_ptr,  # [T, rows] fp32, -inf: the slot holds no pair (its partial was never written)
    out_ptr,  # [rows, D]
    total_rows,
    T,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """out[row] = sum_c 2^lse_c o_c / sum_c 2^lse_c; slots without a pair are not read; no pair at all -> 0."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < total_rows
    rows = tl.where(row_mask, rows, 0).to(tl.int64)
    slots = tl.arange(0, BLOCK_T)
    lse = tl.load(lse_ptr + slots[None, :] * total_rows + rows[:, None],
                  mask=row_mask[:, None] & (slots[None, :] < T), other=float("-inf"))  # [BLOCK_R, BLOCK_T]  # fmt: skip
    lse_max = tl.max(lse, axis=1)
    ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - ref[:, None])  # 0 for slots without a pair
    weight_sum = tl.sum(weights, axis=1)
    dims = tl.arange(0, D)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for c in range(0, T):
        w = tl.sum(tl.where(slots[None, :] == c, weights, 0.0), axis=1)  # [BLOCK_R]
        o = tl.load(partial_ptr + (c * total_rows + rows[:, None]) * D + dims[None, :],
                    mask=(row_mask & (w > 0.0))[:, None], other=0.0)  # fmt: skip
        acc += w[:, None] * o.to(tl.float32)
    out = acc / tl.where(weight_sum > 0.0, weight_sum, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * D + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


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
    out = empty_row_major((total_q, Hq, D), q.dtype, q.device)
    block_tok = tile_tokens(G)
    block_h = max(triton.next_power_of_2(G), 16 // block_tok)  # tl.dot needs M >= 16 rows
    pairs_per_chunk = block_tok * TILES_PER_CHUNK
    pairs, group_start, chunk_group, chunk_first, pos = group_pairs(
        topk_idx, block_table, cu_seqlens_q, seq_lens, num_blocks, pairs_per_chunk
    )
    partial = empty_row_major((T, total_q, Hq, D), PARTIAL_DTYPE, q.device)  # read only where lse > -inf
    lse = torch.full((T, total_q, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    if fmt is not None and not triton_native_fp8(fmt.dtype, q.device):
        kv_cache = kv_cache.view(torch.uint8)  # decoded from the bytes with integer arithmetic
    if fmt is None:
        scale_mode = SCALE_NONE
    fp8_constants = format_constants(fmt) if fmt is not None else dict(
        FP8_MANT=0, FP8_BIAS=0, FP8_MAX=0.0, FP8_FNUZ=False, FP8_HAS_INF=False
    )  # fmt: skip
    fp8_constants.pop("FP8_MAX")  # reading never saturates
    if scale_mode == SCALE_NONE:
        k_scale = v_scale = seq_lens  # never read
    k_strides = tuple(k_scale.stride()) if scale_mode == SCALE_PER_TOKEN_HEAD else (0, 0)
    v_strides = tuple(v_scale.stride()) if scale_mode == SCALE_PER_TOKEN_HEAD else (0, 0)
    launch(
        kv_centric_attn_kernel, (chunk_group.shape[0],),
        q, kv_cache, pairs, group_start, chunk_group, chunk_first, pos, block_table, seq_lens, k_scale, v_scale,
        partial, lse, group_start.shape[0] - 1, total_q, Hq, block_table.shape[0], block_table.shape[1], T,
        pairs_per_chunk, float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_table.stride(0), block_table.stride(1), *k_strides, *v_strides,
        G=G, D=D, BLOCK_H=block_h, BLOCK_TOK=block_tok, IS_FP8=fmt is not None,
        NATIVE_FP8=fmt is not None and kv_cache.dtype != torch.uint8, SCALE_MODE=scale_mode,
        FP16_DOTS=fmt is not None and scale_mode != SCALE_PER_TOKEN_HEAD, SLOT_BITS=slot_bits(T), **fp8_constants,
        **kernel_options(q.device, block_tok * block_h, prefill=True),
    )  # fmt: skip
    launch(
        merge_slots_kernel, (triton.cdiv(total_q * Hq, MERGE_ROWS),), partial, lse, out, total_q * Hq, T,
        D=D, BLOCK_R=MERGE_ROWS, BLOCK_T=triton.next_power_of_2(int(T)), num_warps=4,
    )  # fmt: skip
    return out
