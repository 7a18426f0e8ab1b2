"""Routing alignment: the (token, expert) pairs grouped by expert, each group padded to the row tile.

Plain torch ops with static shapes (the buffers are sized by :func:`schedule.num_blocks`), no host sync:
under torch.compile they trace into the graph beside the GEMM kernels.
"""

import torch

from mm3_compile.kernels.moe.schedule import num_blocks


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] expert of each (token, slot) -> (sorted_pairs [NB * block_m] int32, block_expert [NB] int32).

    ``sorted_pairs`` lists pair indices ``t * k + j`` grouped by expert (stable: token order inside a group),
    each group starting at a multiple of ``block_m``; -1 pads. ``block_expert[b]`` is the expert of row block
    ``b``, -1 for the blocks past the last group (their GEMM programs exit without reading weights).
    """
    pairs = ids.numel()
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
