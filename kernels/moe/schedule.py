"""The launch configuration of the MoE GEMMs: a pure function of shapes (and whether the interpreter runs them).

The launchers and the tests share it, so a test can name the tile its inputs exercise (a token count that is
not a multiple of ``BLOCK_M``, a grid with empty blocks).
"""

import dataclasses

import torch
import triton


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    BLOCK_M: int  # rows (token, expert) pairs per program; align pads every expert's group to a multiple
    BLOCK_N: int
    BLOCK_K: int  # a multiple of the MX block: one scale column per 32 values
    num_warps: int
    num_stages: int
    # out^T = W @ x^T: the weight tile, dequantized in registers, is the dot's left operand, which sm_90's
    # wgmma reads from registers; as the right operand it goes through shared memory every k step
    SWAP_AB: bool = False
    # programs along k for the one-expert linear (fp32 partials + an ordered sum): a one-token linear has one
    # row block, too few programs to keep every SM streaming weight bytes
    SPLIT_K: int = 1
    # load the scale tiles one k step ahead into registers: a prefill tile's scale tile is under 4 bytes per thread,
    # too narrow for the pipeliner's asynchronous copies, so each step waited on its scale load
    PREFETCH_SCALES: bool = False
    # registers per thread at most (None: ptxas's choice): 128 lets two 8-warp programs share an SM
    maxnreg: int | None = None
    # launch order. 0: every row block of a column tile before the next column tile; g >= 1: groups of g row
    # blocks, each group's column tiles one after another (its g row blocks side by side). Programs running at
    # once share what they read through the L2: a column tile of each expert's weight in the first order, the
    # group's x row blocks (and the weight tiles of its experts) in the second. The prefill tiles take 1
    ROW_GROUP: int = 0

    def launch_options(self) -> dict:
        return {
            "maxnreg": self.maxnreg,
            "BLOCK_N": self.BLOCK_N,
            "BLOCK_K": self.BLOCK_K,
            "SWAP_AB": self.SWAP_AB,
            "SPLIT_K": self.SPLIT_K,
            "PREFETCH_SCALES": self.PREFETCH_SCALES,
            "ROW_GROUP": self.ROW_GROUP,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


# The interpreter pays per program and per loop step, not per element (numpy runs each tile op whole): large
# tiles. A 440 x 256 @ 256 x 768 linear took 47 s with 16 x 64 x 64 tiles and 1 s with 128 x 256 x 256 ones.
INTERPRETER = GemmConfig(BLOCK_M=64, BLOCK_N=256, BLOCK_K=256, num_warps=4, num_stages=1)


# One-expert split-k programs an SM holds at once: 3 stages of a 64 x 256 FP8 weight tile, its scales and a 16-row
# bf16 x tile take ~75 KB of shared memory each
SPLIT_PROGRAMS_PER_SM = 3
SPLIT_BLOCK_K = 256


def split_k(row_blocks: int, n_tiles: int, k_steps: int, sms: int) -> int:
    """Programs along k for a one-expert linear: enough that its grid fills every SM's program slots once.

    Each split gets whole ``BLOCK_K`` steps (the same number, the last one fewer) and none is empty.

    Examples:
        >>> split_k(1, 154, 24, 132)  # the M3 qkv projection at one token: 154 column tiles
        3
        >>> split_k(1, 96, 32, 132)  # the o projection: 32 steps as 7, 7, 7, 7, 4
        5
    """
    want = min(k_steps, -(-(SPLIT_PROGRAMS_PER_SM * sms) // (row_blocks * n_tiles)))
    if want <= 1:
        return 1
    steps = -(-k_steps // want)
    return -(-k_steps // steps)


def schedule(
    rows: int | None,
    n: int,
    k: int,
    num_experts: int,
    interpreting: bool,
    x_mx: bool = False,
    sms: int | None = None,
    x_bytes: int = 2,
    splittable: bool = True,
) -> GemmConfig:
    """Tiles for ``rows`` (token, expert) pairs through ``num_experts`` weights of ``[n, k]``.

    Args:
        rows: pairs routed (T * top_k; T for the one-expert linear), or None when unknown (a symbolic size
            without a hint): the decode schedule, correct for every size.
        n, k: the weight's output and input widths.
        num_experts: experts sharing the rows (1 for the linear).
        interpreting: the Triton interpreter runs one numpy program at a time: few, large programs.
        x_mx: x is an MXFP8 activation (GEMM2), dequantized in registers like the weight.
        sms: the device's SM count; the one-expert linear splits k over programs when its column tiles are too
            few to fill them (None: no split).
        x_bytes: bytes per element of a float x (fp32 x: fewer pipeline stages fit in shared memory).
        splittable: False for a grouped launch (one group is still grouped: no split k).

    Returns:
        A :class:`GemmConfig`. Decode (few rows per expert) streams the weights: ``BLOCK_M`` 16 (the smallest
        ``tl.dot``) and 64-column tiles (128 for the grouped GEMM2). Prefill (many rows per expert) uses
        tensor-core tiles that reuse each dequantized weight tile over 128 or 256 rows (:func:`_prefill`).

    Examples:
        >>> schedule(4, 6144, 6144, 128, False).BLOCK_M
        16
        >>> schedule(16384, 6144, 6144, 128, False).BLOCK_M
        128
        >>> schedule(32768, 6144, 6144, 128, False).BLOCK_M
        256
    """
    if interpreting:
        return dataclasses.replace(INTERPRETER, BLOCK_N=min(INTERPRETER.BLOCK_N, max(16, triton.next_power_of_2(n))))
    rows_per_expert = None if rows is None else rows / max(1, min(num_experts, rows))
    if rows_per_expert is not None and rows_per_expert >= 64:
        return _fit_stages(_prefill(rows_per_expert, x_mx), 1 if x_mx else x_bytes)
    # 64 columns per program streamed the weights fastest at 1 and 32 tokens, for 4 experts and for one
    # (wider tiles leave too few loads in flight per SM, narrower ones pay their per-step overhead on half
    # the bytes), even where the grid leaves SMs idle: one expert's 96 programs beat 192 of 32 columns 2x
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    if num_experts == 1 and sms is not None and splittable:
        row_blocks = 1 if rows is None else max(1, -(-rows // 16))
        split = split_k(row_blocks, -(-n // block_n), -(-k // SPLIT_BLOCK_K), sms)
        if split > 1:
            # H200, M3 qkv / o at 1 token 31.7 -> 27.3 / 24.2 -> 22.4 us, at 32 tokens 46.9 -> 43.1 / 39.7 -> 37.6 us
            # (bench/NOTES.md, session 18); 256-wide steps in 3 stages beat 512 and 128 for every split count
            return GemmConfig(
                BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=SPLIT_BLOCK_K, num_warps=4, num_stages=3, SPLIT_K=split
            )
    if not x_mx and k % 512 == 0:
        # bf16 x (GEMM1, k 6144): 512-wide k steps in 3 stages streamed 2-3% faster (T1 52.2 -> 50.7 us, T32
        # 711 -> 693 us); for GEMM2 (MXFP8 x, dequantized per step too; k 3072) they were 1.5-1.7x slower
        return GemmConfig(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=512, num_warps=4, num_stages=3)
    if x_mx and num_experts > 1:
        # grouped GEMM2: 128 columns decode each x tile for twice the outputs (H200, M3 widths, graph replay over 4
        # routes: T1 43.2 -> 37.0 us, T32 458 -> 416 us, T128 787 -> 704 us; bench/NOTES.md session 23)
        block_n = min(128, max(16, triton.next_power_of_2(n)))
    # GEMM2 (and k not a multiple of 512): 256-wide k steps in 3 stages (4 before: T1 32.5 -> 31.4 us, T32 417 -> 395
    # us, T128 706 -> 669 us, bench/NOTES.md session 16)
    return GemmConfig(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=256 if k % 256 == 0 else 128, num_warps=4, num_stages=3)


def _prefill(rows_per_expert: float, x_mx: bool) -> GemmConfig:
    """Tensor-core tiles, the weight as the dot's register operand (``SWAP_AB``); GEMM2's tile is one for every size.

    H200, 8192 tokens x top-4 (256 rows per expert), routed experts (bench/NOTES.md, session 19): 256-row tiles
    with the scales loaded ahead took GEMM1 10.50 -> 6.54 ms (128 x 128 x 128 tiles, 3 stages, before). A 256-row
    tile dequantizes each weight tile once for twice the rows; it pads every expert's rows to a multiple of 256, so
    it starts where experts average 256 rows. GEMM2's tile divides GEMM1's: it runs over GEMM1's align layout.

    Every prefill tile launches row block by row block (``ROW_GROUP`` 1: a row block's column tiles run side by
    side and share its x rows through the L2, instead of each column tile reading every row block's x again). H100,
    8192 tokens, the bench block's routes, alone: GEMM1 7.00 -> 6.39 ms, GEMM2 5.32 -> 5.10 ms, the block (eager)
    16.3 -> 15.4 ms; groups of 2 and 4 row blocks were between (bench/NOTES.md, session 34).
    """
    if x_mx:
        # GEMM2 (MXFP8 x, decoded per step too): 128-row tiles of 8 warps capped at 128 registers, two programs per
        # SM (16 warps) over either align layout. H200, 8192 tokens, alone: 6.50 -> 5.06 ms against 4 warps at 254
        # registers (two programs, 8 warps per SM); 8 warps uncapped take 143 registers, one program: 7.18 ms;
        # 16 warps split the weight rows over two warp groups that both decode them: 8.1 ms (bench/NOTES.md,
        # session 25). On the 256-row layout a block runs as two tiles, and a tile of pads only exits
        return GemmConfig(128, 128, 32, 8, 4, SWAP_AB=True, PREFETCH_SCALES=True, maxnreg=128, ROW_GROUP=1)
    if rows_per_expert >= 256:
        return GemmConfig(256, 128, 64, 8, 4, SWAP_AB=True, PREFETCH_SCALES=True, ROW_GROUP=1)
    return GemmConfig(128, 128, 128, 8, 4, SWAP_AB=True, PREFETCH_SCALES=True, ROW_GROUP=1)  # 10.50 -> 7.95 ms


# Rows per block of the align layout at most: GEMM2's prefill tile. GEMM1's 256-row tile spans two blocks of an
# expert ("paired tiles") and an expert's odd last block runs on the 128-row tile: at 8192 tokens x top-4 the
# 256-row layout held 235-239 blocks for 160 blocks' worth of pairs (bench routes, 3 seeds), pairs of 128-row
# blocks 151-154 + 81-88 tails (CPU arithmetic, bench/NOTES.md session 29)
LAYOUT_MAX_M = 128


def layout_m(config: GemmConfig) -> int:
    """Rows per block of the align layout both GEMMs run over, for GEMM1's ``config``.

    Examples:
        >>> layout_m(schedule(32768, 6144, 6144, 128, False))  # 256-row tiles over pairs of 128-row blocks
        128
        >>> layout_m(schedule(4, 6144, 6144, 128, False))
        16
    """
    return min(config.BLOCK_M, LAYOUT_MAX_M)


def tail_schedule(config: GemmConfig, x_bytes: int = 2) -> GemmConfig:
    """The config of an expert's odd last layout block when ``config``'s row tile spans two blocks."""
    if config.BLOCK_M == 2 * LAYOUT_MAX_M:
        return _fit_stages(_prefill(LAYOUT_MAX_M, False), x_bytes)
    return dataclasses.replace(config, BLOCK_M=config.BLOCK_M // 2)


# shared memory the pipelined operand tiles of a prefill program may take (sm_90 allows 227 KB per program;
# the rest is left to the epilogue and the compiler's own buffers)
STAGE_BUDGET = 200 * 1024


def _fit_stages(config: GemmConfig, x_bytes: int) -> GemmConfig:
    """The config with as many of its stages as fit ``STAGE_BUDGET``: an x tile of ``x_bytes`` per element and
    an FP8 weight tile per stage (fp32 x doubles the x tile of the bf16 configs, which were sized for it)."""
    per_stage = config.BLOCK_M * config.BLOCK_K * x_bytes + config.BLOCK_N * config.BLOCK_K
    stages = config.num_stages
    while stages > 2 and stages * per_stage > STAGE_BUDGET:
        stages -= 1
    return dataclasses.replace(config, num_stages=stages)


def num_blocks(rows, num_experts: int, block_m: int):
    """Row blocks of the aligned layout: each expert's group padded to ``block_m``, empty experts take none.

    ``sum_e ceil(c_e / block_m)`` is at most ``rows`` (every used block holds a row) and at most
    ``ceil((rows + E * (block_m - 1)) / block_m)``; the smaller static bound sizes the buffers and the grid.
    """
    bound = (rows + num_experts * (block_m - 1) + block_m - 1) // block_m
    return torch.sym_min(rows, bound)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    BLOCK_M: int  # tokens per program
    BLOCK_N: int  # experts per program
    BLOCK_K: int
    num_warps: int
    num_stages: int


# Tokens from which the router's logits take the split-bf16 kernel. H200, 6144 x 128 fp32 weight, graph replay
# (bench/NOTES.md session 29): the fp32 linear (a bf16 -> fp32 copy of x and an FFMA GEMM) 400.1 us at 8192
# tokens, 117.5 us at 2048, 26.5 us at 256; this tile 126.7 / 95.1 us (not timed below 2048; a first tile's
# time did not fall with the token count: its k loop is a floor), so a decode step keeps the linear
ROUTER_KERNEL_ROWS = 2048


def router_schedule(rows: int | None, num_experts: int, hidden: int, interpreting: bool) -> RouterConfig | None:
    """The router-logits kernel's tiles for ``rows`` tokens, or None: the plain fp32 linear (few or unknown rows,
    a width not in 16s).

    Examples:
        >>> router_schedule(8192, 128, 6144, False)
        RouterConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
        >>> router_schedule(1, 128, 6144, False) is None
        True
    """
    if hidden % 16 != 0:
        return None
    if interpreting:  # one program per 64 tokens: the interpreter pays per program
        block_n = min(128, max(16, triton.next_power_of_2(num_experts)))
        return RouterConfig(64, block_n, min(256, max(16, triton.next_power_of_2(hidden))), 4, 1)
    if rows is None or rows < ROUTER_KERNEL_ROWS:
        return None
    # H200, 8192 / 2048 tokens (us): 64 x 64 x 128 on 4 warps 126.7 / 95.1, 128 x 64 x 64 124.9 / 128.4,
    # 64 x 128 x 64 on 8 warps 141.2 / 140.2, 128 x 128 x 64 226.1 / 234.7
    return RouterConfig(64, min(64, max(16, triton.next_power_of_2(num_experts))), 128, 4, 3)
