"""Routing alignment: the (token, expert) pairs grouped by expert, each group padded to the row tile.

Static shapes (the buffers are sized by :func:`schedule.num_blocks`), no host sync. Decode-sized routings
(at most ``SMALL_PAIRS`` pairs) take one single-program Triton kernel: the torch ops below cost one launch
each (~8 in a compiled graph), a large part of a one-token MoE block. Larger routings take the torch ops,
which under torch.compile trace into the graph beside the GEMM kernels.
"""

import torch
import triton
import triton.language as tl

from mm3_compile.kernels._launch import empty_row_major, launch, size_hint
from mm3_compile.kernels.moe.schedule import num_blocks

SMALL_PAIRS = 2048  # pairs the one-program kernel takes (a 32-token decode step routes 160 with the shared expert)
SMALL_EXPERTS = 512
# Pairs the kernel sorts at once: the whole routing up to 1024 pairs (a 128-token step routes 640 with the shared
# expert), in chunks of this many past that.  The chunk is the launch-time routing's size rounded up to a power
# of two (a compiled graph reused for more pairs runs more chunks).
MAX_CHUNK = 1024
MIN_CHUNK = 32


@triton.jit
def _align_small_kernel(
    ids_ptr,  # [P] expert per pair (int32 or int64)
    pairs_out_ptr,  # [NB * BLOCK_M] int32
    block_expert_ptr,  # [NB] int32
    pairs,  # P
    num_experts,
    num_blocks,  # NB
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next_pow2(num_experts)
    CHUNK: tl.constexpr,  # pairs sorted at once, a power of two
    FILL: tl.constexpr,  # rows padded per store
):
    """Every step is a whole-tile operation (a sort, a histogram, a gather): a loop over small chunks of pairs,
    each waiting on the previous one's counts, was bound by that chain (bench/NOTES.md, sessions 19 and 22)."""
    lanes = tl.arange(0, CHUNK)
    # pass 1: pairs per expert (an id outside [0, E) lands in the upper bins and is never placed)
    counts = tl.zeros([2 * BLOCK_E], tl.int32)
    for c0 in range(0, pairs, CHUNK):
        p = c0 + lanes
        e = tl.load(ids_ptr + p, mask=p < pairs, other=-1).to(tl.int32)
        valid = (e >= 0) & (e < num_experts)
        counts += tl.histogram(tl.where(valid, e, BLOCK_E), 2 * BLOCK_E)
    bins = tl.arange(0, 2 * BLOCK_E)
    counts = tl.where(bins < BLOCK_E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    group_start = tl.cumsum(padded, 0) - padded  # [2 * BLOCK_E] first row of each expert's padded group
    # every row a pad and every block unused first; the barrier orders these stores before the scatters below
    for r0 in range(0, num_blocks * BLOCK_M, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(pairs_out_ptr + r, tl.full([FILL], -1, tl.int32), mask=r < num_blocks * BLOCK_M)
    for b0 in range(0, num_blocks, FILL):
        b = b0 + tl.arange(0, FILL)
        tl.store(block_expert_ptr + b, tl.full([FILL], -1, tl.int32), mask=b < num_blocks)
    tl.debug_barrier()
    # pass 2: sort each chunk by (expert, pair) -- stable by construction -- so a pair's rank among its expert's
    # pairs is its sorted position minus the position of its expert's first pair in the chunk
    seen = tl.zeros([2 * BLOCK_E], tl.int32)  # pairs per expert in earlier chunks
    for c0 in range(0, pairs, CHUNK):
        p = c0 + lanes
        e = tl.load(ids_ptr + p, mask=p < pairs, other=-1).to(tl.int32)
        valid = (e >= 0) & (e < num_experts)
        e = tl.where(valid, e, BLOCK_E)  # sorts after every real expert
        chunk_counts = tl.histogram(e, 2 * BLOCK_E)
        chunk_first = tl.cumsum(chunk_counts, 0) - chunk_counts  # [2 * BLOCK_E] sorted position of each expert
        ordered = tl.sort(e * CHUNK + lanes)  # [CHUNK]
        expert = ordered // CHUNK
        pair = c0 + ordered % CHUNK
        row_base = group_start + seen - chunk_first  # [2 * BLOCK_E]: row of an expert's pair = this + its position
        dest = tl.gather(row_base, expert, 0) + lanes
        placed = expert < BLOCK_E
        tl.store(pairs_out_ptr + dest, pair, mask=placed)
        # a block's first row always holds a pair (groups are padded at their end): it names the block's expert
        tl.store(block_expert_ptr + dest // BLOCK_M, expert, mask=placed & (dest % BLOCK_M == 0))
        seen += chunk_counts


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] expert of each (token, slot) -> (sorted_pairs [NB * block_m] int32, block_expert [NB] int32).

    ``sorted_pairs`` lists pair indices ``t * k + j`` grouped by expert (stable: token order inside a group),
    each group starting at a multiple of ``block_m``; -1 pads. ``block_expert[b]`` is the expert of row block
    ``b``, -1 for the blocks past the last group (their GEMM programs exit without reading weights).
    """
    pairs = ids.numel()
    hint = size_hint(pairs)
    if hint is not None and hint <= SMALL_PAIRS and num_experts <= SMALL_EXPERTS:
        nb = num_blocks(pairs, num_experts, block_m)
        sorted_pairs = empty_row_major((nb * block_m,), torch.int32, ids.device)
        block_expert = empty_row_major((nb,), torch.int32, ids.device)
        launch(
            _align_small_kernel,
            (1,),
            ids.contiguous(),  # read flat: no reshape of the token dim in a traced graph (ops/moe.py)
            sorted_pairs,
            block_expert,
            pairs,
            num_experts,
            nb,
            BLOCK_M=block_m,
            BLOCK_E=triton.next_power_of_2(num_experts),
            CHUNK=min(MAX_CHUNK, max(MIN_CHUNK, triton.next_power_of_2(hint))),
            FILL=1024,
        )
        return sorted_pairs, block_expert
    flat = ids.reshape(-1).to(torch.int64)  # [P]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # [E] end row of each padded group
    group_start = counts.cumsum(0) - counts  # [E] first sorted position of each expert
    order = torch.argsort(flat, stable=True)  # [P] pairs grouped by expert
    expert = flat[order]
    rank = torch.arange(pairs, device=ids.device) - group_start[expert]  # position inside the group
    dest = padded_end[expert] - padded[expert] + rank  # [P] row in the padded layout
    nb = num_blocks(pairs, num_experts, block_m)
    sorted_pairs = torch.full((nb * block_m,), -1, dtype=torch.int32, device=ids.device)
    sorted_pairs = sorted_pairs.scatter(0, dest, order.to(torch.int32))
    block_start = torch.arange(nb, device=ids.device) * block_m  # [NB]
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # first group ending after the start
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert
