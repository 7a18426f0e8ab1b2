"""Jit building blocks shared by the block-sparse attention schedules (union walk, decode, KV-centric).

A selected 128-token block costs one ``[BLOCK_M, D] x [D, 128]`` and one ``[BLOCK_M, 128] x [128, D]`` dot
(``attend_block``); the selection helpers apply the contract's slot rule (``slot_window``, ``select_slots``).

Numerics (base 2, log2(e) folded into the scale): running max ``m``, running sum ``l`` and the
accumulator in fp32; K/V are dequantised to the model dtype (FP8 bytes -> fp32 -> x scale ->
model dtype) and P is rounded to the model dtype before P.V, as on the GPU's bf16 tensor-core path.
Attention over an FP8 cache with scalar (or no) scales (``FP16_DOTS``) instead feeds both
dots fp16 operands: the FP8 values exactly (one hardware conversion each, no multiply), q rescaled
per row by a power of two into fp16's range, k_scale folded into the logit scale, v_scale applied to
the output, P rounded to fp16.  Its operands are more exact than the bf16 path's, and the loop loses
the per-element fp32 multiply and bf16 conversion.  Under the interpreter (``DOT_FP32``) the operands
are widened to fp32 before each dot, because its bf16 dots are wrong; the roundings are kept so both
paths see the same operands.
"""

import triton
import triton.language as tl

from mm3_compile import platform
from mm3_compile.contract import PAGE_SIZE
from mm3_compile.kernels.fp8 import fp8_decode
from mm3_compile.kernels.packed import find_requests

PAGE = tl.constexpr(PAGE_SIZE)  # tokens per page == sparse block size (a Triton global must be a constexpr)
# The Triton interpreter converts fp32 -> bf16 by truncation toward zero (P and the outputs came out
# biased low) and widens bf16 subnormals wrongly (3 * 2^-133 -> 2^-127); under it every bf16
# conversion is done with integer arithmetic instead (``to_model_dtype``, ``widen``).  The GPU's
# conversions are already round-to-nearest-even and exact, so compiled kernels keep them.
EXACT_BF16 = tl.constexpr(platform.interpreting())
# Rows one of whose blocks has a maximum log2-domain logit (sm_scale * log2(e) * q.k over the block's
# visible keys) of magnitude >= 2^28 come out NaN in every schedule.  The KV-centric tile folds the
# scale into one FFMA per logit (exp2(s * scale - m) with m rounded, see kv_centric._attend_tile), which
# is exact up to a factor 2^r, |r| <= ulp(m) / 2 <= 8 while |m| < 2^28 (its fp16 P holds it), that
# cancels there but overflows beyond; the other schedules flag the same rows instead of answering
# where it cannot (such logits are ~1.9e8 in natural units, far past any attention a model computes).
HUGE_LOGIT = tl.constexpr(2.0**28)


@triton.jit
def widen(x):
    """x (bf16, fp16 or fp32) -> fp32, exactly (bf16 subnormals included)."""
    if EXACT_BF16 and x.dtype == tl.bfloat16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def to_model_dtype(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE (bf16/fp16/fp32), rounded to nearest even (NaN stays NaN, overflow -> inf)."""
    if EXACT_BF16 and DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # ties to the even upper half
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounded = tl.where(is_nan, (bits >> 16) | 0x40, rounded)  # a NaN stays a (quiet) NaN
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def load_kv_tile(
    ptrs,
    mask,
    scale,  # fp32 scalar (SCALE_MODE 1) or per-key fp32 vector broadcastable to the tile (mode 2)
    MODEL_DTYPE: tl.constexpr,
    FP8: tl.constexpr,  # FP8 format code (kernels/fp8.py), 0: a bf16/fp16 cache
    FP8_NATIVE_LOAD: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Load a K or V tile and return it in the dot dtype (model dtype, or fp32 under the interpreter)."""
    if FP8 != 0:
        if FP8_NATIVE_LOAD and SCALE_MODE == 0 and MODEL_DTYPE == tl.float16:
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float16)  # one hardware conversion, exact
        elif FP8_NATIVE_LOAD:
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)  # hardware conversion, exact
        else:
            x = fp8_decode(tl.load(ptrs, mask=mask, other=0), FP8)
            x = tl.where(mask, x, 0.0)
        if SCALE_MODE != 0:
            x = x * scale
        x = to_model_dtype(x, MODEL_DTYPE)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    if DOT_FP32:
        x = widen(x)
    return x


@triton.jit
def load_block(
    head_base,  # kv_ptr at this KV head
    page,  # int64 physical page of the block
    key_ok,  # [128] key exists (valid block, < seq_len)
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
    D: tl.constexpr,
    MODEL_DTYPE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    FP8: tl.constexpr,
    FP8_NATIVE_LOAD: tl.constexpr,  # the cache's FP8 (kernels/fp8.py)
    CONVERT_V_FIRST: tl.constexpr,  # NVIDIA: an FP8 V tile is converted before its transpose (below)
    V_PAIRS: tl.constexpr,  # FP16_DOTS: V stays FP8 bytes, read as int16 pairs (below, ``attend_loaded``)
):
    """One 128-key block's K^T [D, 128] and V [128, D] in the dot dtype, V issued right after K so both
    loads are in flight together.  FP16_DOTS (FP8 K/V with scalar or no scales): the FP8 values exactly
    and unscaled, in fp16 (the caller folds the scales into the logit factor and the output).  V_PAIRS:
    V instead as its raw bytes, [128, D / 2] int16 (``split_pairs``)."""
    dims = tl.arange(0, D)
    offs = tl.arange(0, PAGE)
    base = head_base + page * stride_kb + offs.to(tl.int64) * stride_kt  # [128] key row pointers
    ks = k_scale
    vs = v_scale
    if SCALE_MODE == 2:
        phys = page * PAGE + offs  # physical slot: the scale follows the page, not the position
        ks = tl.load(k_scale_ptr + kv_head * stride_ksh + phys * stride_kss, mask=key_ok, other=0.0)[None, :]
        vs = tl.load(v_scale_ptr + kv_head * stride_vsh + phys * stride_vss, mask=key_ok, other=0.0)[:, None]
    # FP16_DOTS: scale mode 0 converts without a multiply (the scales are applied outside)
    tile_scale_mode: tl.constexpr = 0 if FP16_DOTS else SCALE_MODE
    tile_dtype: tl.constexpr = tl.float16 if FP16_DOTS else MODEL_DTYPE
    k = load_kv_tile(
        base[None, :] + dims[:, None],
        key_ok[None, :],
        ks,
        tile_dtype,
        FP8,
        FP8_NATIVE_LOAD,
        tile_scale_mode,
        DOT_FP32,
    )  # [D, 128]
    if V_PAIRS:
        # The PV dot wants V's key-pairs in registers, the cache stores each key's D values contiguously: the
        # tile crosses shared memory transposed.  Read as int16 (two adjacent D values of one key), it takes
        # the 16-bit ldmatrix transpose straight from the bytes it was copied as (Triton hoists the
        # transpose above the elementwise byte split), and the FP8 -> fp16 conversion follows in registers.
        tl.static_assert(FP16_DOTS, "V_PAIRS needs fp16 dots over an FP8 cache with scalar or no scales")
        pairs = tl.arange(0, D // 2)
        pair_ptrs = tl.cast(base + D, tl.pointer_type(tl.int16), bitcast=True)  # even: the launcher checks
        v = tl.load(pair_ptrs[:, None] + pairs[None, :], mask=key_ok[:, None], other=0)  # [128, D / 2]
    else:
        v = load_kv_tile(
            base[:, None] + D + dims[None, :],
            key_ok[:, None],
            vs,
            tile_dtype,
            FP8,
            FP8_NATIVE_LOAD,
            tile_scale_mode,
            DOT_FP32,
        )  # [128, D]
        if FP8 != 0 and CONVERT_V_FIRST:
            # V feeds the PV dot as its [keys, D] operand, which the tensor cores want key-pairs of: Triton
            # moves the tile through shared memory transposed, and left alone it moves the conversion after
            # that transpose, which an 8-bit tile then takes byte by byte (sm_90, 4 warps: 128 LDS.U8 per
            # thread).  An opaque move (a non-pure asm is not moved) keeps the conversion first, so the 16-bit
            # tile takes the ldmatrix transpose as bf16 V does.
            v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=v.dtype, is_pure=False, pack=2)
    return k, v


# split_pairs on NVIDIA: per 32-bit register (two int16 pairs), gather the low (then high) bytes and convert both
# with one hardware instruction; the two formats differ only in it
_PAIRS_ASM = (
    "{ .reg .b32 t; .reg .b16 h; prmt.b32 t, $2, 0, 0x20; cvt.u16.u32 h, t; cvt.rn.f16x2.FMT $0, h; "
    "prmt.b32 t, $2, 0, 0x31; cvt.u16.u32 h, t; cvt.rn.f16x2.FMT $1, h; }"
)
E4M3_PAIRS_ASM = tl.constexpr(_PAIRS_ASM.replace("FMT", "e4m3x2"))
E5M2_PAIRS_ASM = tl.constexpr(_PAIRS_ASM.replace("FMT", "e5m2x2"))


@triton.jit
def split_pairs(w, FP8: tl.constexpr, FP8_NATIVE_LOAD: tl.constexpr, DOT_FP32: tl.constexpr):
    """[R, C] int16 pairs of FP8 bytes (D index 2j in the low byte, 2j + 1 in the high one) -> (even, odd)
    [R, C] fp16 (fp32 under DOT_FP32): the FP8 values exactly."""
    if FP8_NATIVE_LOAD:  # NVIDIA's e4m3fn or e5m2 (the schedule takes V_PAIRS nowhere else)
        PAIRS_ASM: tl.constexpr = E4M3_PAIRS_ASM if (FP8 & 3) == 3 else E5M2_PAIRS_ASM
        even, odd = tl.inline_asm_elementwise(
            PAIRS_ASM, "=r,=r,r", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=2
        )
    else:
        even = fp8_decode(w, FP8).to(tl.float16)  # every FP8 value is an fp16 value
        odd = fp8_decode(w >> 8, FP8).to(tl.float16)
    if DOT_FP32:
        even = widen(even)
        odd = widen(odd)
    return even, odd


@triton.jit
def attend_loaded(
    q,  # [BLOCK_M, D] dot dtype
    m,  # [BLOCK_M] running max (log2 domain)
    l,  # [BLOCK_M] running sum
    acc,  # [BLOCK_M, D] fp32
    low,  # [BLOCK_M] smallest block maximum so far (log2 domain)
    k,  # [D, 128] dot dtype
    v,  # [128, D] dot dtype
    visible,  # [BLOCK_M, 128] row may see the key (membership, causality)
    qk_scale,
    P_DTYPE: tl.constexpr,  # P is rounded to the operand dtype before P.V, like the GPU's tensor-core path
    DOT_FP32: tl.constexpr,
    FP8: tl.constexpr,
    FP8_NATIVE_LOAD: tl.constexpr,
    V_PAIRS: tl.constexpr,  # v is [128, D / 2] int16 pairs of FP8 bytes (``load_block``)
):
    """Online-softmax update of (m, l, acc, low) with one QK and one PV dot over a loaded block; ``low`` is
    the smallest block maximum seen (``HUGE_LOGIT``).  V_PAIRS: the PV dot is two, over V's even and odd D
    columns, each accumulating into its half of ``acc`` (split and interleaved again in registers): each output
    element sums the same products in the same order as one dot over the whole tile."""
    s = tl.dot(q, k) * qk_scale  # [BLOCK_M, 128] log2-domain logits
    s = tl.where(visible, s, float("-inf"))
    block_max = tl.max(s, axis=1)
    low = tl.where(block_max == float("-inf"), low, tl.minimum(low, block_max))
    m_new = tl.maximum(m, block_max)
    # A row that has seen no key yet keeps m = -inf; subtract 0 instead so nothing is NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    p = to_model_dtype(p, P_DTYPE)
    if DOT_FP32:
        p = widen(p)
    if V_PAIRS:
        even, odd = split_pairs(v, FP8, FP8_NATIVE_LOAD, DOT_FP32)  # [128, D / 2] each
        acc_even, acc_odd = tl.split(tl.reshape(acc * alpha[:, None], [acc.shape[0], v.shape[1], 2]))
        acc = tl.reshape(tl.join(tl.dot(p, even, acc_even), tl.dot(p, odd, acc_odd)), acc.shape)  # column 2j + i
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return m_new, l, acc, low


@triton.jit
def attend_block(
    q,  # [BLOCK_M, D] dot dtype
    m,  # [BLOCK_M] running max (log2 domain)
    l,  # [BLOCK_M] running sum
    acc,  # [BLOCK_M, D] fp32
    low,  # [BLOCK_M] smallest block maximum so far (log2 domain)
    head_base,  # kv_ptr at this KV head
    page,  # int64 physical page of the block
    key_ok,  # [128] key exists (valid block, < seq_len)
    visible,  # [BLOCK_M, 128] row may see the key (membership, causality)
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
    D: tl.constexpr,
    MODEL_DTYPE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    FP8: tl.constexpr,
    FP8_NATIVE_LOAD: tl.constexpr,  # the cache's FP8 (kernels/fp8.py)
    CONVERT_V_FIRST: tl.constexpr,
    V_PAIRS: tl.constexpr,
):
    """One 128-key block: load it, then the online-softmax update (see ``load_block``, ``attend_loaded``)."""
    k, v = load_block(
        head_base,
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
        FP16_DOTS,
        FP8,
        FP8_NATIVE_LOAD,
        CONVERT_V_FIRST,
        V_PAIRS,
    )
    tile_dtype: tl.constexpr = tl.float16 if FP16_DOTS else MODEL_DTYPE
    return attend_loaded(
        q, m, l, acc, low, k, v, visible, qk_scale, tile_dtype, DOT_FP32, FP8, FP8_NATIVE_LOAD, V_PAIRS
    )


@triton.jit
def scalar_scales(k_scale_ptr, v_scale_ptr, SCALE_MODE: tl.constexpr):
    """(k_scale, v_scale): the fp32 scalars in scale mode 1, else 1.0 (mode 2 reads them per key)."""
    k_scale = 1.0
    v_scale = 1.0
    if SCALE_MODE == 1:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    return k_scale, v_scale


@triton.jit
def packed_requests(cu_seqlens_ptr, num_reqs, tokens):
    """Packed tokens (``cu_seqlens``) -> (request, query length, offset inside the request, whether the
    token is inside it), all [R].  Tokens before ``cu_seqlens[0]`` or from ``cu_seqlens[-1]`` on belong
    to no request (value checks off, the GPU default, let such tables through): they attend nothing."""
    req = find_requests(cu_seqlens_ptr, num_reqs, tokens)
    q_start = tl.load(cu_seqlens_ptr + req)
    q_len = tl.load(cu_seqlens_ptr + req + 1) - q_start
    offset = tokens - q_start
    return req, q_len, offset, (offset >= 0) & (offset < q_len)


@triton.jit
def slot_window(seq_lens_ptr, req, q_len, offset, token_ok, T):
    """The contract's position rule: p = seq_len - q_len + offset (-1 for rows past the tokens), the last
    block a row may see (p // 128) and how many list slots it reads (min(T, p // 128 + 1))."""
    pos = tl.load(seq_lens_ptr + req) - q_len + offset
    pos = tl.where(token_ok, pos, -1)
    last_block = tl.where(pos >= 0, pos // PAGE, -1)
    return pos, last_block, tl.minimum(T, last_block + 1)


@triton.jit
def listed_id_ok(ids, last_block, max_blocks):
    """The contract's id rule: a listed block id counts if it is in [0, p // 128] and inside the block table."""
    return (ids >= 0) & (ids <= last_block) & (ids < max_blocks)


@triton.jit
def page_ok(pages, num_blocks):
    """The contract's page rule: a block-table entry counts if it names a page of the cache."""
    return (pages >= 0) & (pages < num_blocks)


@triton.jit
def token_slots(
    topk_ptr,
    block_table_ptr,
    seq_lens_ptr,
    kv_head,
    token,  # scalar: one token's list
    req,  # scalar: its request
    q_len,
    offset,
    num_blocks,
    max_blocks,
    stride_tkh,
    stride_tkt,
    stride_tks,
    stride_btr,
    stride_btb,
    T,
    BLOCK_T: tl.constexpr,
    TABLE_ROW: tl.constexpr,  # pow2 >= max_blocks
):
    """:func:`select_slots` for one token: ids [BLOCK_T] (-1 past n_slots) and their pages [BLOCK_T] (-1: slot
    skipped), by the same rule.  The list, the seq_len and the request's whole block-table row are loaded at
    once and the pages are picked from the row in registers, so a decode program's chain of dependent loads
    is seq_len | list | table row -> K/V, one dependent load fewer than the listed entries' gather."""
    slots = tl.arange(0, BLOCK_T)
    ids = tl.load(
        topk_ptr + kv_head.to(tl.int64) * stride_tkh + token.to(tl.int64) * stride_tkt + slots * stride_tks,
        mask=slots < T,
        other=-1,
    )
    entries = tl.arange(0, TABLE_ROW)
    row = tl.load(
        block_table_ptr + req.to(tl.int64) * stride_btr + entries.to(tl.int64) * stride_btb,
        mask=entries < max_blocks,
        other=-1,
    )  # [TABLE_ROW]
    pos = tl.load(seq_lens_ptr + req) - q_len + offset
    last_block = tl.where(pos >= 0, pos // PAGE, -1)
    ids = tl.where(slots < tl.minimum(T, last_block + 1), ids, -1)
    valid = listed_id_ok(ids, last_block, max_blocks)
    pages = tl.gather(row, tl.where(valid, ids, 0), 0)
    valid = valid & page_ok(pages, num_blocks)
    return ids, tl.where(valid, pages, -1)


@triton.jit
def prefetch_l2(ptrs):
    """A hint: the L2 lines of ``ptrs`` start moving from HBM; nothing reaches registers, so no value read
    here can be stale (the previous grid's writes land in the L2).  Returns a dummy (inline PTX needs one)."""
    return tl.inline_asm_elementwise(
        "{ mov.u32 $0, 0; prefetch.global.L2 [$1]; }",
        "=r,l",
        [ptrs.to(tl.int64)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def select_slots(
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
    BLOCK_T: tl.constexpr,
):
    """The contract's slot rule for rows of tokens (``token``, ``req``, ``last_block = p // 128``,
    ``n_slots = min(T, p // 128 + 1)``, all [R]): ids [R, BLOCK_T] (-1 past n_slots), their pages, and
    which are valid (id in [0, p // 128] and inside the table, page inside the cache).  Masked, never
    dereferenced: slots past T, invalid ids, pages outside the cache.  Repeats are the caller's.

    Every slot of the list is loaded (``token`` is a row of the ``[Hkv, total_q, T]`` list: in bounds) and
    the slots past n_slots are dropped afterwards, so the list load does not wait for the seq_len load
    that n_slots comes from: a decode program's chain of dependent loads is seq_len | list -> page -> K/V."""
    slots = tl.arange(0, BLOCK_T)
    ids = tl.load(
        topk_ptr
        + kv_head.to(tl.int64) * stride_tkh
        + token[:, None].to(tl.int64) * stride_tkt
        + slots[None, :] * stride_tks,
        mask=(slots < T)[None, :],
        other=-1,
    )
    ids = tl.where(slots[None, :] < n_slots[:, None], ids, -1)
    valid = listed_id_ok(ids, last_block[:, None], max_blocks)
    pages = tl.load(
        block_table_ptr + req[:, None].to(tl.int64) * stride_btr + tl.where(valid, ids, 0).to(tl.int64) * stride_btb,
        mask=valid,
        other=-1,
    )
    valid = valid & page_ok(pages, num_blocks)
    return ids, pages, valid
