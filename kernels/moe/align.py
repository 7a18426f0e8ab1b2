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
CHUNK = 32  # pairs compared at once: [CHUNK, BLOCK_E] and [CHUNK, CHUNK] tiles in registers


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
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,  # rows padded per store
):
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    # pass 1: pairs per expert
    counts = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, pairs, CHUNK):
        p = c0 + lanes
        e = tl.load(ids_ptr + p, mask=p < pairs, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)  # [BLOCK_E] end row of each expert's padded group
    group_start = padded_end - padded
    # every row a pad first; the barrier orders these stores before the scatter below (other threads)
    for r0 in range(0, num_blocks * BLOCK_M, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(pairs_out_ptr + r, tl.full([FILL], -1, tl.int32), mask=r < num_blocks * BLOCK_M)
    tl.debug_barrier()
    # pass 2: each pair's row = its group's start + the pairs of its expert before it (stable)
    seen = tl.zeros([BLOCK_E], tl.int32)  # pairs per expert in earlier chunks
    earlier = lanes[None, :] < lanes[:, None]  # [CHUNK, CHUNK] j < i
    for c0 in range(0, pairs, CHUNK):
        p = c0 + lanes
        e = tl.load(ids_ptr + p, mask=p < pairs, other=-1).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
        before = tl.sum(((e[:, None] == e[None, :]) & earlier).to(tl.int32), axis=1)
        dest = tl.sum(onehot * (group_start + seen)[None, :], axis=1) + before
        tl.store(pairs_out_ptr + dest, p, mask=(p < pairs) & (e >= 0) & (e < num_experts))
        seen += tl.sum(onehot, axis=0)
    # the expert of each row block: the number of groups that end at or before the block's first row
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + lanes
        ended = tl.sum((padded_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(ended < num_experts, ended, -1), mask=b < num_blocks)


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
            CHUNK=CHUNK,
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
