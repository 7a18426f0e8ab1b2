"""Grouped GEMM over MXFP8 expert weights, dequantized in registers, and the one-expert MXFP8 linear.

``out[p, n] = sum_k x[row(p), k] * W[e(p), n, k]`` with ``W = values * 2^(scale - 127)`` per 32 values along k.
One program computes a ``[BLOCK_M, BLOCK_N]`` tile: ``BLOCK_M`` rows of one expert (an aligned row block from
:func:`align.moe_align`) or of the plain row range (the linear), looping over k in ``BLOCK_K`` steps. Each step
loads the weight bytes and their scale bytes, decodes them (typed hardware conversion where the platform has it,
integer decode of the raw bytes otherwise: the interpreter and emulated targets), multiplies by the power of two
of the scale (exact in bf16: an FP8 value times a power of two keeps its 3-4 significant bits) and feeds
``tl.dot`` with bf16 operands and fp32 accumulation. An MXFP8 ``x`` (the output of
``swiglu_oai_mxfp8_quant``) is decoded the same way, so neither operand is dequantized to memory.

Programs of row blocks that belong to no expert exit before reading anything: only experts that received rows
are read, once per column tile.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from mm3_compile import platform
from mm3_compile.contract import E8M0_BIAS, MX_BLOCK_SIZE
from mm3_compile.kernels._launch import empty_row_major, launch
from mm3_compile.kernels.fp8 import fp8_decode, fp8_launch
from mm3_compile.kernels.moe.schedule import GemmConfig
from mm3_compile.platform import FP8Format

MX = tl.constexpr(MX_BLOCK_SIZE)  # values per E8M0 scale (a Triton global must be a constexpr instance)
SCALE_NAN = tl.constexpr(2 * E8M0_BIAS + 1)  # the E8M0 NaN byte


@triton.jit
def _mx_tile(
    codes,  # [R, C] typed FP8 (FP8_NATIVE_LOAD) or uint8 bytes
    scale_bytes,  # [R, C / 32] uint8 E8M0
    R: tl.constexpr,
    C: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    FP8: tl.constexpr,
    FP8_NATIVE_LOAD: tl.constexpr,
):
    """values x 2^(scale - 127) -> [R, C] in OUT_DTYPE (exact: bf16 holds every scaled FP8 value)."""
    if FP8_NATIVE_LOAD:
        v = codes.to(tl.float32)
    else:
        v = fp8_decode(codes, FP8)
    s = scale_bytes.to(tl.int32)
    # 2^(s - 127) as fp32 bits: a normal exponent field for s >= 1; s = 0 is the subnormal 2^-127; 255 is NaN
    bits = tl.where(s == 0, 0x400000, s << 23)
    bits = tl.where(s == SCALE_NAN, 0x7FC00000, bits)
    factor = bits.to(tl.float32, bitcast=True)
    blocks = tl.reshape(v, (R, C // MX, MX)) * tl.reshape(factor, (R, C // MX, 1))
    return tl.reshape(blocks, (R, C)).to(OUT_DTYPE)


@triton.jit
def grouped_tile(pid, row_blocks, n_tiles, ROW_GROUP: tl.constexpr):
    """(row block, column tile) of flat program ``pid`` in groups of ``ROW_GROUP`` row blocks: a group's row
    blocks side by side, then its next column tile; the last group holds the row blocks left."""
    per_group = ROW_GROUP * n_tiles
    first = pid // per_group * ROW_GROUP
    in_group = pid % per_group
    size = tl.minimum(row_blocks - first, ROW_GROUP)
    return first + in_group % size, in_group // size


@triton.jit
def _round_bf16(v, INT_ROUND: tl.constexpr):
    """fp32 -> the nearest bf16 (ties to even), kept in fp32. The interpreter's cast truncates: integer RNE there."""
    if INT_ROUND:
        bits = v.to(tl.int32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))  # noqa: PLR0124 (NaN test)
    return v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _mxfp8_gemm_kernel(
    x_ptr,  # [M, K] float, or MXFP8 bytes/typed values when X_MX
    x_scales_ptr,  # [M, K / 32] uint8 (X_MX only)
    w_ptr,  # [E, N, K] MXFP8 values: typed FP8 (FP8_NATIVE_LOAD) or uint8 bytes
    w_scales_ptr,  # [E, N, K / 32] uint8
    shared_w_ptr,  # [N, K] the shared expert's values, group E (HAS_SHARED)
    shared_w_scales_ptr,  # [N, K / 32] uint8 (HAS_SHARED)
    out_ptr,  # [P, N]; [SPLIT_K, P, N] fp32 partial sums when SPLIT_K > 1
    pairs_ptr,  # [NB * BLOCK_M] int32 pair per aligned row, -1 pads (GROUPED)
    block_expert_ptr,  # [NB] int32 expert per row block, -1 = no rows (GROUPED)
    tiles_ptr,  # [grid 0] int32 first layout block of each program's tile, -1 = none (TILE_BLOCKS > 0)
    pair_weights_ptr,  # [P] fp32 (HAS_WEIGHTS)
    rows,  # P: output rows
    num_experts,  # E: block_expert entries outside [0, E + HAS_SHARED) have no rows
    n_units,  # N / 16
    k_units,  # K / (32 * K_ALIGN)
    split_steps,  # BLOCK_K steps per split (all of K's when SPLIT_K is 1)
    GROUPED: tl.constexpr,
    BLOCK_SPLIT: tl.constexpr,  # row tiles per aligned block of block_expert (its BLOCK_SPLIT * BLOCK_M rows)
    TILE_BLOCKS: tl.constexpr,  # > 0: each tile spans this many consecutive blocks of one expert, listed in tiles_ptr
    K_ALIGN: tl.constexpr,  # the largest power of two <= 16 dividing K / 32: scale rows start that aligned
    TOP_K: tl.constexpr,  # x row of pair p is p // TOP_K
    X_MX: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_SHARED: tl.constexpr,  # group E reads the shared expert's weight (one launch for routed + shared)
    ROUND_BF16: tl.constexpr,  # round the product to bf16 before the pair weight (MXFP8 x, or a bf16 output)
    INT_ROUND: tl.constexpr,  # the interpreter: bf16 rounding with integer ops
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,  # accumulate out^T = W @ x^T (the dequantized weight as the left operand)
    SPLIT_K: tl.constexpr,  # > 1: programs along k (axis 2) write raw fp32 partials, summed by _split_k_sum_kernel
    PREFETCH_SCALES: tl.constexpr,  # load the scale tiles one k step ahead, in registers
    ROW_GROUP: tl.constexpr,  # > 0: axis 0 numbers (row block, column tile) in groups of ROW_GROUP row blocks
    DOT_DTYPE: tl.constexpr,  # bf16 for bf16/MXFP8 x; fp32 for fp16/fp32 x and under the interpreter
    FP8: tl.constexpr,  # the FP8 launch constants of the weights and an MXFP8 x (kernels/fp8.py)
    FP8_MAX: tl.constexpr,
    FP8_NATIVE_LOAD: tl.constexpr,
    FP8_NATIVE_STORE: tl.constexpr,
    MAXNREG: tl.constexpr,  # the launch's register cap (0: none): read by launchers, not by this body (_launch.py)
):
    # sizes rebuilt from aligned units: the compiler sees their divisibility under Inductor's launch too
    N = n_units * 16
    k_blocks = k_units * K_ALIGN
    K = k_blocks * MX
    if ROW_GROUP > 0:
        n_tiles = tl.cdiv(N, BLOCK_N)
        pid_b, pid_n = grouped_tile(tl.program_id(0), tl.num_programs(0) // n_tiles, n_tiles, ROW_GROUP)
    else:
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    if GROUPED:
        if TILE_BLOCKS > 0:
            first = tl.load(tiles_ptr + pid_b)
            offs = first * (BLOCK_M // TILE_BLOCKS) + tl.arange(0, BLOCK_M)
            expert = tl.load(block_expert_ptr + tl.maximum(first, 0))
            expert = tl.where(first >= 0, expert, -1)
            listed = (first + tl.zeros([BLOCK_M], dtype=tl.int32)) >= 0  # [BLOCK_M]
            pairs = tl.load(pairs_ptr + offs, mask=listed, other=-1)
        else:
            expert = tl.load(block_expert_ptr + pid_b // BLOCK_SPLIT)
            pairs = tl.load(pairs_ptr + offs)
        groups = num_experts
        if HAS_SHARED:
            groups = num_experts + 1
        expert = tl.where(expert < groups, expert, -1)
        valid = (pairs >= 0) & (pairs < rows)  # a stray entry is skipped, never read or written out of bounds
    else:
        expert = pid_b * 0  # a tensor like the grouped branch's, for the same code below
        pairs = offs
        valid = offs < rows
    # a tile of pads only (the tail of an aligned block wider than the tile) reads nothing either
    if (expert >= 0) & (tl.max(valid.to(tl.int32), axis=0) > 0):
        out_rows = tl.where(valid, pairs, 0).to(tl.int64)
        x_rows = out_rows // TOP_K
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        col_ok = cols < N
        w_base = w_ptr
        ws_base = w_scales_ptr
        w_expert = expert
        if HAS_SHARED:
            if expert == num_experts:
                w_base = shared_w_ptr
                ws_base = shared_w_scales_ptr
                w_expert = expert * 0
        w_rows = w_expert.to(tl.int64) * N + tl.where(col_ok, cols, 0)  # [BLOCK_N] rows of the flat [E*N, K]
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        NBK: tl.constexpr = BLOCK_K // MX
        k_start = pid_k * split_steps * BLOCK_K  # a multiple of BLOCK_K: aligned loads of values and scales
        k_end = tl.minimum(K, k_start + split_steps * BLOCK_K)
        kb_end = k_end // MX
        kb0 = tl.arange(0, NBK)
        w_sb_ptrs = ws_base + w_rows[:, None] * k_blocks + kb0[None, :]  # [BLOCK_N, NBK] at k block 0
        x_sb_ptrs = x_scales_ptr + x_rows[:, None] * k_blocks + kb0[None, :]  # [BLOCK_M, NBK] (X_MX)
        if PREFETCH_SCALES:
            # the scale tiles are too narrow for the pipeliner's asynchronous copies (under 4 bytes per thread):
            # loaded one k step ahead into registers, their latency hides behind the step before
            kb = k_start // MX + kb0
            w_sb = tl.load(w_sb_ptrs + k_start // MX, mask=col_ok[:, None] & (kb < kb_end)[None, :], other=0)
            if X_MX:
                x_sb = tl.load(x_sb_ptrs + k_start // MX, mask=valid[:, None] & (kb < kb_end)[None, :], other=0)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kb = k0 // MX + kb0
            k_ok = ks < K
            kb_ok = kb < k_blocks
            if PREFETCH_SCALES:
                w_sb_now = w_sb
                nb_ok = (kb + NBK) < kb_end
                w_sb = tl.load(w_sb_ptrs + (k0 // MX + NBK), mask=col_ok[:, None] & nb_ok[None, :], other=0)
                if X_MX:
                    x_sb_now = x_sb
                    x_sb = tl.load(x_sb_ptrs + (k0 // MX + NBK), mask=valid[:, None] & nb_ok[None, :], other=0)
            else:
                w_sb_now = tl.load(w_sb_ptrs + k0 // MX, mask=col_ok[:, None] & kb_ok[None, :], other=0)
                if X_MX:
                    x_sb_now = tl.load(x_sb_ptrs + k0 // MX, mask=valid[:, None] & kb_ok[None, :], other=0)
            # one fill for both kinds: 0.0 casts to the FP8 zero and to the byte 0 (an int fill cannot cast to FP8)
            w_mask = col_ok[:, None] & k_ok[None, :]
            w_codes = tl.load(w_base + w_rows[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
            w = _mx_tile(w_codes, w_sb_now, BLOCK_N, BLOCK_K, DOT_DTYPE, FP8, FP8_NATIVE_LOAD)
            x_mask = valid[:, None] & k_ok[None, :]
            if X_MX:
                x_codes = tl.load(x_ptr + x_rows[:, None] * K + ks[None, :], mask=x_mask, other=0.0)
                xt = _mx_tile(x_codes, x_sb_now, BLOCK_M, BLOCK_K, DOT_DTYPE, FP8, FP8_NATIVE_LOAD)
            else:
                xt = tl.load(x_ptr + x_rows[:, None] * K + ks[None, :], mask=x_mask, other=0.0).to(DOT_DTYPE)
            if SWAP_AB:
                if DOT_DTYPE == tl.float32:
                    acc = tl.dot(w, tl.trans(xt), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, tl.trans(xt), acc)
            elif DOT_DTYPE == tl.float32:
                acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(w), acc)
        if SWAP_AB:
            acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        if SPLIT_K > 1:
            # the plain row range only (the launcher refuses grouped splits): rows are out_rows
            part_ptrs = out_ptr + (pid_k * rows + out_rows[:, None]) * N + cols[None, :]
            tl.store(part_ptrs, acc, mask=valid[:, None] & col_ok[None, :])
        else:
            if ROUND_BF16:
                acc = _round_bf16(acc, INT_ROUND)
            if HAS_WEIGHTS:
                acc = acc * tl.load(pair_weights_ptr + out_rows, mask=valid, other=0.0)[:, None]
            out_ptrs = out_ptr + out_rows[:, None] * N + cols[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _split_k_sum_kernel(
    partial_ptr,  # [splits, numel] fp32
    out_ptr,  # [numel]
    numel,
    splits,
    ROUND_BF16: tl.constexpr,
    INT_ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = the splits' partial sums added in split order (deterministic), rounded like the unsplit epilogue."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    ptrs = partial_ptr + offs
    acc = tl.load(ptrs, mask=ok, other=0.0)
    for _ in range(1, splits):
        ptrs += numel  # a pointer step per split: no split * numel product to overflow int32
        acc += tl.load(ptrs, mask=ok, other=0.0)
    if ROUND_BF16:
        acc = _round_bf16(acc, INT_ROUND)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


SPLIT_SUM_BLOCK = 1024
SPLIT_MAX_ROWS = 256  # rows up to which a split config splits: 3 x 256 x 9856 x 4 B = 30 MB of partials at most


def splits_run(split: int, rows):
    """The splits a ``SPLIT_K = split`` launch runs: all of them up to ``SPLIT_MAX_ROWS`` rows, one past that.

    A graph traced at a decode size and run at a prefill's would otherwise allocate ``split x rows x N`` fp32
    partials (gigabytes). Integer arithmetic only, so a symbolic row count stays symbolic: no guard, no
    recompile (the decode attention's split plan does the same).
    """
    return 1 + (split - 1) * torch.sym_min(1, SPLIT_MAX_ROWS // torch.sym_max(rows, 1))


def _dot_dtype(x_dtype: torch.dtype):
    """bf16 tensor-core operands when x is bf16 (the weights are exact in bf16); fp32 keeps fp16/fp32 x exact."""
    if platform.interpreting() or x_dtype != torch.bfloat16:
        return tl.float32
    return tl.bfloat16


def _units(n: int, what: str) -> int:
    if n % 16 != 0:
        raise ValueError(f"{what}: expected a multiple of 16, got {n}")
    return n // 16


def _compact(mask: torch.Tensor, cap) -> torch.Tensor:
    """[NB] bool -> [cap] int32: the indices where ``mask`` holds, in order, then -1 (static size, no host sync)."""
    dest = torch.where(mask, torch.cumsum(mask, 0) - 1, cap)  # every unlisted block to one slot past the list
    index = torch.arange(mask.shape[0], dtype=torch.int32, device=mask.device)
    listed = torch.full((cap + 1,), -1, dtype=torch.int32, device=mask.device).scatter(0, dest, index)
    return listed[:cap]


def pair_tiles(block_expert: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """block_expert [NB] (groups in expert order, -1 past the last) -> the paired tiles' first blocks.

    Each expert's blocks pair up from its first one: ``doubles [NB // 2]`` lists the first block of every pair,
    ``singles [min(NB, groups)]`` the odd last block of each expert that has one; -1 past the listed tiles.

    Examples:
        >>> doubles, singles = pair_tiles(torch.tensor([0, 0, 0, 2, 3, 3, -1], dtype=torch.int32), 4)
        >>> doubles.tolist(), singles.tolist()
        ([0, 4, -1], [2, 3, -1, -1])
    """
    nb = block_expert.shape[0]
    key = torch.where(block_expert >= 0, block_expert, groups)  # ascending: unused blocks sort last
    first = torch.searchsorted(key, key)  # [NB] first block of each block's group
    index = torch.arange(nb, device=key.device)
    head = (block_expert >= 0) & ((index - first) % 2 == 0)
    same_next = torch.cat([key[1:] == key[:-1], torch.zeros(1, dtype=torch.bool, device=key.device)])
    return _compact(head & same_next, nb // 2), _compact(head & ~same_next, torch.sym_min(nb, groups))


def mxfp8_gemm(
    x: torch.Tensor,  # [M, K] contiguous float, or MXFP8 values when x_scales is given
    x_scales: torch.Tensor | None,  # [M, K / 32] uint8
    values: torch.Tensor,  # [E, N, K] MXFP8
    scales: torch.Tensor,  # [E, N, K / 32] uint8
    fmt: FP8Format,
    config: GemmConfig,
    out_dtype: torch.dtype,
    sorted_pairs: torch.Tensor | None = None,  # [NB * BLOCK_M] int32 (grouped)
    block_expert: torch.Tensor | None = None,  # [NB] int32 (grouped)
    top_k: int = 1,
    pair_weights: torch.Tensor | None = None,  # [M * top_k] fp32
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,  # [N, K] values, [N, K / 32] uint8: group E
    layout_m: int | None = None,  # rows per block of the aligned layout (grouped; default config.BLOCK_M)
    tail_config: GemmConfig | None = None,  # paired tiles: the config of an expert's odd last block
) -> torch.Tensor:
    """out [M * top_k, N]: grouped over ``block_expert`` when given, else the plain ``x @ values[0]^T``.

    The aligned layout's blocks (``layout_m`` rows) may be wider than the row tile: each block then runs as
    ``layout_m / BLOCK_M`` tiles of its expert, and tiles holding only pads exit. A row tile of twice the
    blocks (paired tiles) spans two consecutive blocks of one expert; an expert's odd last block runs in a second
    launch with ``tail_config`` (default: the config at ``layout_m`` rows), so no tile is half pads by layout.

    With ``shared``, row blocks of group ``E`` (one past the routed experts) read that weight: the shared expert
    runs in the routed launch, its programs beside the routed ones.

    The fp32 accumulator is rounded to bf16 for a bf16 output and for an MXFP8 x (the expert's output in the
    model dtype, as a bf16 GEMM would store it) before the optional pair weight, applied in fp32.
    """
    M, K = x.shape
    E, N = values.shape[0], values.shape[1]
    rows = M * top_k
    out = empty_row_major((rows, N), out_dtype, x.device)
    grouped = block_expert is not None
    split = config.SPLIT_K
    if split > 1 and (grouped or pair_weights is not None or shared is not None):
        raise ValueError(f"config: SPLIT_K {split} is for the plain linear (no groups, pair weights or shared weight)")
    k_steps = triton.cdiv(K, config.BLOCK_K)
    if split > 1 and (split - 1) * triton.cdiv(k_steps, split) >= k_steps:
        raise ValueError(f"config: SPLIT_K {split} leaves a split without k steps (K {K}, BLOCK_K {config.BLOCK_K})")
    splits = splits_run(split, rows)
    split_steps = triton.cdiv(k_steps, splits)
    target = empty_row_major((splits, rows, N), torch.float32, x.device) if split > 1 else out
    layout_m = config.BLOCK_M if layout_m is None else layout_m
    paired = grouped and config.BLOCK_M == 2 * layout_m
    if grouped and not paired and layout_m % config.BLOCK_M != 0:
        raise ValueError(
            f"layout_m: expected a multiple of the row tile {config.BLOCK_M} or half of it, got {layout_m}"
        )
    # Inductor launches without Triton's divisible-by-16 specialisation of ints: the alignment of K / 32 (the
    # scale rows' stride) travels as a constexpr, or the scale loads of a split at an odd multiple of 8 scale
    # bytes went byte by byte (2x slower, H200)
    k_blocks = K // MX_BLOCK_SIZE
    k_align = min(16, k_blocks & -k_blocks)
    fp8 = fp8_launch(fmt, values)  # an MXFP8 x is read like the weights
    w = fp8.view(values)
    xk = x if x_scales is None else fp8.view(x)
    dummy = w  # pointers of absent operands are never read (their constexpr branch is off)
    round_bf16 = x_scales is not None or out_dtype == torch.bfloat16

    def run(cfg: GemmConfig, programs, tiles: torch.Tensor | None, tile_blocks: int, block_split: int) -> None:
        n_tiles = triton.cdiv(N, cfg.BLOCK_N)
        launch(
            _mxfp8_gemm_kernel,
            (programs * n_tiles, 1, splits) if cfg.ROW_GROUP else (programs, n_tiles, splits),
            xk,
            x_scales if x_scales is not None else dummy,
            w,
            scales,
            fp8.view(shared[0]) if shared is not None else dummy,
            shared[1] if shared is not None else dummy,
            target,
            sorted_pairs if grouped else dummy,
            block_expert if grouped else dummy,
            tiles if tiles is not None else dummy,
            pair_weights if pair_weights is not None else dummy,
            rows,
            E,
            _units(N, "N"),
            k_blocks // k_align,
            split_steps,
            K_ALIGN=k_align,
            GROUPED=grouped,
            BLOCK_SPLIT=block_split,
            TILE_BLOCKS=tile_blocks,
            TOP_K=top_k,
            X_MX=x_scales is not None,
            HAS_WEIGHTS=pair_weights is not None,
            HAS_SHARED=shared is not None,
            ROUND_BF16=round_bf16,
            INT_ROUND=platform.interpreting(),
            BLOCK_M=cfg.BLOCK_M,
            DOT_DTYPE=_dot_dtype(x.dtype if x_scales is None else torch.bfloat16),
            **cfg.launch_options(),
            **fp8.constexprs(),
        )

    if paired:
        tail = dataclasses.replace(config, BLOCK_M=layout_m) if tail_config is None else tail_config
        if tail.BLOCK_M != layout_m:
            raise ValueError(f"tail_config: expected BLOCK_M = layout_m = {layout_m}, got {tail.BLOCK_M}")
        groups = E + (shared is not None)
        doubles, singles = pair_tiles(block_expert, groups)
        run(config, doubles.shape[0], doubles, 2, 1)
        run(tail, singles.shape[0], singles, 1, 1)
    elif grouped:
        block_split = layout_m // config.BLOCK_M
        run(config, block_expert.shape[0] * block_split, None, 0, block_split)
    else:
        run(config, triton.cdiv(M, config.BLOCK_M), None, 0, 1)
    if split > 1:
        numel = rows * N
        launch(
            _split_k_sum_kernel,
            (triton.cdiv(numel, SPLIT_SUM_BLOCK),),
            target,
            out,
            numel,
            splits,
            ROUND_BF16=round_bf16,
            INT_ROUND=platform.interpreting(),
            BLOCK=SPLIT_SUM_BLOCK,
            num_warps=4,
        )
    return out
