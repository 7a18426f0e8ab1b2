"""Launch schedules of the attention kernels: pure functions of shapes and the device, shared with the tests.

The launchers (``union.py``, ``kv_centric.py``, ``decode.py``, ``prefill.py``) and the compile-ahead
tests take their tile heights, dot operand modes, warps and stages from here, so a test compiles
what a launch runs.  Split counts (``decode.split_plan``) and the prefill tile (``prefill.prefill_block_q``)
live beside their launchers; they are shape functions too.  Measurements behind the choices:
``bench/NOTES.md``.
"""

import torch
import triton

from mm3_compile import platform
from mm3_compile.contract import SCALE_PER_TOKEN_HEAD
from mm3_compile.kernels._launch import size_hint, sm_count
from mm3_compile.platform import FP8Format

MIN_DOT_ROWS = 16  # tl.dot needs M >= 16 rows


def head_block(G: int, block_q: int) -> int:
    """``BLOCK_H``: query heads per row group, pow2(G), padded so ``block_q * BLOCK_H >= 16`` rows."""
    return max(triton.next_power_of_2(int(G)), MIN_DOT_ROWS // block_q)


def fp16_dots(fmt: FP8Format | None, scale_mode: int) -> bool:
    """``FP16_DOTS``: an FP8 cache with scalar or no scales feeds both dots fp16 operands (see ``jit.py``)."""
    return fmt is not None and scale_mode != SCALE_PER_TOKEN_HEAD


# Split one-token decode of at most this many (token, KV head) tiles merges in a dependent launch (``merge_plan``);
# measured at 1 and 4 tiles (B1 TP8 / TP1), where every tile's splits end together.
DEPENDENT_MERGE_MAX_TILES = 4
MERGE_MAX_ROWS = 16  # rows one merge program combines (its [rows, D] tiles stay in registers)


def merge_plan(tiles):
    """``last_merges`` of a split one-token decode whose launcher may merge in ``union.split_merge_kernel``: 1 where
    the last split of each tile to arrive merges its tile, 0 where the dependent merge launch does.

    A value computed from the grid, not a choice at trace time: a graph traced at one batch runs every batch
    (symbolic ``tiles`` give a symbolic value without a guard), and the merge launch's grid is 0 where it is 1
    (no launch). The last arrival's merge is a serial tail where every tile's splits end together: partial
    stores, CTA barrier, GPU-scope fence and atomic, then one SM reading all of its tile's partials from the L2.
    A dependent launch trades both for the grid boundary and a merge spread over many programs (H100, graph
    replay, B1 s32768: TP1 7.72 -> 6.99 us bf16, 7.33 -> 6.94 FP8; TP8, on L2-warm pages, 6.06 -> 5.58, 5.77 ->
    5.52). With many tiles the last arrivals' merges overlap other tiles' pages and the boundary is pure cost
    (forced at TP8 B32: 16.95 -> 18.21 us bf16, 13.16 -> 14.67 FP8): bench/NOTES.md, sessions 38 and 41.

    Examples:
        >>> merge_plan(4), merge_plan(5), merge_plan(128)
        (0, 1, 1)
    """
    return torch.sym_min(1, torch.sym_max(0, tiles - DEPENDENT_MERGE_MAX_TILES))


MERGE_WARPS = 4
MERGE_INTERPRETER_PROGRAMS = 4  # the interpreter's merge grids: several programs, partly masked row tiles


def merge_rows(rows, device: torch.device) -> int:
    """``BLOCK_R`` of a merge launch: the fewest (token, query head) rows per program, a power of two from 2 to
    ``MERGE_MAX_ROWS``, that keep its grid within one program per SM (``rows`` may be symbolic: its hint).

    Examples:
        >>> cpu = torch.device("cpu")  # the interpreter aims at 4 programs
        >>> merge_rows(64, cpu), merge_rows(8, cpu), merge_rows(8192, cpu)
        (16, 2, 16)
    """
    if device.type == "cuda" and not platform.interpreting():
        programs = sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        programs = MERGE_INTERPRETER_PROGRAMS
    hint = size_hint(rows) or 1
    return min(MERGE_MAX_ROWS, max(2, triton.next_power_of_2(-(-hint // programs))))


def launch_options(
    vendor: str,
    sm_count: int | None,
    block_m: int,
    prefill: bool,
    fp8_decode: bool = False,
    decode_programs: int | None = None,
    interpreting: bool = False,
    blocks_per_program: int | None = None,
    fp16_dots: bool = False,
) -> dict:
    """``DOT_FP32``, ``CONVERT_V_FIRST``, ``V_PAIRS``, warps and stages of an attention launch.

    Args:
        vendor: ``"nvidia"``, ``"amd"``, or ``"cpu"`` (the interpreter).
        sm_count: streaming multiprocessors of an NVIDIA device (unused elsewhere).
        block_m: rows of the program's q tile.
        prefill: a prefill tile (several tokens of packed requests).
        fp8_decode: one-token decode over an FP8 cache.
        decode_programs: the grid size of a one-token decode, else None.
        interpreting: the Triton interpreter, whose bf16 dots are wrong (widen the operands).
        blocks_per_program: the blocks one decode program walks (its split's), if known.
        fp16_dots: the launch's ``FP16_DOTS`` (an FP8 cache with scalar or no scales).

    Returns:
        Keyword options of the launch. sm_90, a one-token decode grid of at most one program per SM
        (one wave): 4 warps; 3 stages for bf16 KV (two blocks in flight behind the one it computes), for FP8
        KV 1 where a program walks one block (nothing to pipeline), else 2. Larger decode grids: bf16
        8 warps (16 rows; 4 warps spill) with 2 stages, FP8 4 warps with 3 stages (1-byte tiles leave room
        for two 3-stage programs per SM), 2 stages where a program walks at most 2 blocks. Prefill: 8 warps
        for 128-row tiles, 4 for tiles of <= 64 rows, 2 stages. ``CONVERT_V_FIRST`` (``jit.load_block``: an
        FP8 V tile converted before its transpose) for one-token FP8 decode, except in larger grids of
        programs of at most 2 blocks, whose pipelined copies it slows; ``V_PAIRS`` instead (V's bytes
        transposed as int16 pairs, converted after) wherever the dots are fp16, and in the interpreter.
        gfx9: 4 wavefronts of 64 and one stage (64 KB LDS).

    Examples:
        >>> launch_options("nvidia", 132, 16, False, True, 256, blocks_per_program=8, fp16_dots=True)
        {'DOT_FP32': False, 'CONVERT_V_FIRST': False, 'V_PAIRS': True, 'num_warps': 4, 'num_stages': 3}
        >>> launch_options("nvidia", 132, 16, False, fp8_decode=True, decode_programs=64, blocks_per_program=1)
        {'DOT_FP32': False, 'CONVERT_V_FIRST': True, 'V_PAIRS': False, 'num_warps': 4, 'num_stages': 1}
        >>> launch_options("nvidia", 132, 16, False, True, 256, blocks_per_program=2, fp16_dots=True)
        {'DOT_FP32': False, 'CONVERT_V_FIRST': False, 'V_PAIRS': True, 'num_warps': 4, 'num_stages': 2}
    """
    if interpreting or vendor == "cpu":
        return dict(DOT_FP32=True, CONVERT_V_FIRST=False, V_PAIRS=fp8_decode and fp16_dots, num_warps=4)
    if vendor == "amd":
        return dict(DOT_FP32=False, CONVERT_V_FIRST=False, V_PAIRS=False, num_warps=4, num_stages=1)
    one_wave = decode_programs is not None and decode_programs <= sm_count
    # One wave, 8 -> 4 warps (H100, graph replay, s32768): bf16 (3 stages) TP1 B1 7.06 -> 6.43 us, TP8 B8 9.12 ->
    # 8.41, TP8 B32 16.74 -> 16.29; FP8 (2 -> 1 stage) TP1 B1 6.94 -> 6.67, TP8 B8 8.31 -> 7.61; TP1 B2 FP8 8.72 ->
    # 8.90 the one loss (bench/NOTES.md, session 40).
    if fp8_decode:
        # Larger grids: 8 warps took a 32-token step 17.3 us against 13.0 (H200, bench/NOTES.md, session 24).
        # Programs of at most 2 blocks: 2 stages (H100, TP8 B32, 8 splits of 2 blocks: 14.48 -> 13.15 us; TP1
        # B32's 2 splits of 8 blocks keep 3: 32.88 us against 33.73; bench/NOTES.md, session 34)
        short = blocks_per_program is not None and blocks_per_program <= 2
        if one_wave:  # programs of one block have nothing to pipeline
            stages = 1 if blocks_per_program == 1 else 2
        else:
            stages = 2 if short else 3
        # Over fp16 dots V is read as int16 pairs; against V converted first, and for short programs in larger
        # grids Triton's order (H100, same call, bench/NOTES.md, session 43): TP8 B32 13.09 -> 12.22 us, TP1 B8
        # 13.62 -> 11.94, TP1 B32 30.51 -> 29.49, TP1 B128 98.8 -> 96.1, TP8 B1 5.56 -> 5.50, TP1 B1 even.  A
        # symbolic split too (compiled with dynamic shapes, session 44): TP8 B32 13.66 -> 12.81, TP1 B32 32.16 ->
        # 30.86, TP1 B128 99.6 -> 95.7, TP1 B1 6.48 -> 6.26, TP8 B1 5.53 -> 5.55.
        # Otherwise V converted first (H100, session 42): TP1 B1 6.71 -> 6.32 us, TP8 B1 5.83 -> 5.56, TP1 B32
        # 32.84 -> 30.56, TP1 B128 105.1 -> 98.8; short programs in larger grids lose (TP8 B16 9.86 -> 11.06).
        first = not fp16_dots and (one_wave or not short)
        return dict(DOT_FP32=False, CONVERT_V_FIRST=first, V_PAIRS=fp16_dots, num_warps=4, num_stages=stages)
    num_warps = 4 if one_wave or (prefill and block_m <= 64) else 8
    return dict(
        DOT_FP32=False, CONVERT_V_FIRST=False, V_PAIRS=False, num_warps=num_warps, num_stages=3 if one_wave else 2
    )


def kernel_options(
    device: torch.device,
    block_m: int,
    prefill: bool,
    fp8_decode: bool = False,
    decode_programs=None,
    blocks_per_program=None,
    fp16_dots: bool = False,
) -> dict:
    """:func:`launch_options` for ``device``; ``decode_programs`` may be symbolic (a trace with a symbolic batch).

    A graph traced at one request runs every batch. A symbolic one-token bf16 decode grid takes its trace's hint
    (warps and stages follow it): traced at B1 it runs B128 in 4 warps and 3 stages (forced in eager on the H100:
    TP1 B128 180.4 us against 177.5 for the multi-wave options, TP8 B128 47.8 against 47.8; bench/NOTES.md,
    session 40). A symbolic FP8 grid gets the multi-wave options (3 stages: a symbolic split's block count counts
    as unknown); the one-wave options cost a 32-token FP8 step 4% (TP1 B32 33.8 us in 2 stages against 32.6).
    """
    if isinstance(decode_programs, torch.SymInt):
        decode_programs = None if fp8_decode else size_hint(decode_programs)
    if isinstance(blocks_per_program, torch.SymInt):  # unknown: a graph traced at one request runs every batch
        blocks_per_program = None
    if platform.interpreting() or device.type != "cuda":
        return launch_options(
            "cpu", None, block_m, prefill, fp8_decode, decode_programs, interpreting=True, fp16_dots=fp16_dots
        )
    vendor = platform.platform_for(device).vendor
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = sm_count(index) if vendor == "nvidia" else None
    return launch_options(
        vendor,
        sms,
        block_m,
        prefill,
        fp8_decode,
        decode_programs,
        blocks_per_program=blocks_per_program,
        fp16_dots=fp16_dots,
    )
