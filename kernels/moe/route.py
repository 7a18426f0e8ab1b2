"""The M3 router's selection in one kernel: sigmoid scores, top-k of ``score + bias``, renormalised weights.

``torch.topk`` and the ops around it were five kernels of a one-token MoE block (sigmoid, a radix select, a
bitonic sort, a gather, the renormalisation: ~18 µs of a graph-replayed B1 step, bench/NOTES.md); here one
program takes ``BLOCK_T`` tokens, their ``[BLOCK_T, E]`` scores in registers, and picks the k experts in k
rounds of a row maximum. Order: the highest key first; equal keys by the lower expert index; a NaN key
ranks above every number (as in ``torch.sort``), so a NaN logit is routed, and its weight poisons the row.
"""

import torch
import triton
import triton.language as tl

from mm3_compile.kernels._launch import empty_row_major, launch


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] fp32
    bias_ptr,  # [E] fp32
    ids_ptr,  # [T, TOP_K] int32
    weights_ptr,  # [T, TOP_K] fp32
    tokens,
    num_experts,
    scaling,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # next_pow2(TOP_K)
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next_pow2(E)
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    e = tl.arange(0, BLOCK_E)
    kk = tl.arange(0, K_PAD)
    t_ok = t < tokens
    rows = t.to(tl.int64)
    ok = t_ok[:, None] & (e < num_experts)[None, :]
    x = tl.load(logits_ptr + rows[:, None] * num_experts + e[None, :], mask=ok, other=0.0)
    score = 1.0 / (1.0 + tl.exp(-x))  # [BLOCK_T, BLOCK_E]
    key = score + tl.load(bias_ptr + e, mask=e < num_experts, other=0.0)[None, :]
    nan = key != key
    avail = ok
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    picked = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        any_nan = tl.max((avail & nan).to(tl.int32), axis=1) > 0
        best = tl.max(tl.where(avail & ~nan, key, float("-inf")), axis=1)
        tied = tl.where(any_nan[:, None], avail & nan, avail & (key == best[:, None]))
        expert = tl.min(tl.where(tied, e[None, :], BLOCK_E), axis=1)  # [BLOCK_T] the lowest index among the best
        chosen = e[None, :] == expert[:, None]
        w = tl.sum(tl.where(chosen, score, 0.0), axis=1)
        ids = tl.where(kk[None, :] == j, expert[:, None], ids)
        picked = tl.where(kk[None, :] == j, w[:, None], picked)
        total += w
        avail = avail & ~chosen
    # the reference's order of operations: weights / sum * scaling, in fp32 (Inductor passes floats as fp64)
    weights = picked / total[:, None] * tl.cast(scaling, tl.float32)
    out = rows[:, None] * TOP_K + kk[None, :]
    mask = t_ok[:, None] & (kk < TOP_K)[None, :]
    tl.store(ids_ptr + out, ids, mask=mask)
    tl.store(weights_ptr + out, weights, mask=mask)


def moe_route(
    logits: torch.Tensor,  # [T, E] fp32
    correction_bias: torch.Tensor,  # [E] fp32
    top_k: int,
    scaling: float,
    interpreting: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, top_k] int32, weights [T, top_k] fp32); the interpreter takes 64 tokens per program (it pays
    per program), the GPU 4 (more programs in flight for a prefill's thousands of tokens)."""
    T, E = logits.shape
    ids = empty_row_major((T, top_k), torch.int32, logits.device)
    weights = empty_row_major((T, top_k), torch.float32, logits.device)
    block_t = 64 if interpreting else 4
    launch(
        _route_kernel,
        (triton.cdiv(T, block_t),),
        logits,
        correction_bias,
        ids,
        weights,
        T,
        E,
        scaling,
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        BLOCK_T=block_t,
        BLOCK_E=triton.next_power_of_2(E),
        num_warps=4,
    )
    return ids, weights
