"""The M3 router: its logits on tensor cores at fp32 accuracy, and its selection in one kernel (sigmoid scores,
top-k of ``score + bias``, renormalised weights).

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
from mm3_compile.kernels.moe.schedule import RouterConfig


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


@triton.jit
def _router_logits_kernel(
    x_ptr,  # [T, H] bf16
    w_ptr,  # [E, H] fp32
    out_ptr,  # [T, E] fp32
    tokens,
    num_experts,
    h_units,  # H / 16
    one,  # 1.0, a run-time value (see the leading piece's dot)
    PIECE_DTYPE: tl.constexpr,  # the pieces' dot dtype: bf16 (GPU), fp32 holding them (the interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out^T = w @ x^T with fp32 products and fp32 sums, on bf16 tensor cores.

    A bf16 x is exact in bf16; an fp32 weight is the sum of three bf16 pieces (8 significant bits each: 24, all of
    fp32's), so every product is exact. The weight pieces are the dot's left operand, which sm_90 reads from
    registers (as the right one they went through shared memory: 181 vs 213 us at 8192 tokens, bench/NOTES.md
    session 29). Tensor cores add products without rounding to nearest: one accumulating dot over all of H was
    8.1e-7 of sum |x w| off the float64 logits. So each k step's leading-piece dot starts from zero and is added
    to the fp32 sum by the CUDA cores (times a run-time 1.0: Triton folds a plain ``acc + dot`` back into an
    accumulating dot): 3.2e-8, under cuBLAS's fp32 GEMM's 7.2e-8. The two small pieces (2^-8 of the leading one
    and less) accumulate in their own dot chain.
    """
    H = h_units * 16
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < tokens
    col_ok = cols < num_experts
    x_rows = tl.where(row_ok, rows, 0).to(tl.int64) * H
    w_rows = tl.where(col_ok, cols, 0).to(tl.int64) * H
    unit = tl.cast(one, tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    small = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        x = tl.load(x_ptr + x_rows[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + w_rows[:, None] + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.trans(x.to(PIECE_DTYPE))  # [BLOCK_K, BLOCK_M]
        # any rounding of the cuts (the interpreter truncates) leaves an exact remainder for the next piece
        hi = w.to(tl.bfloat16).to(tl.float32)
        rest = w - hi
        mid = rest.to(tl.bfloat16).to(tl.float32)
        lo = (rest - mid).to(tl.bfloat16).to(tl.float32)
        acc = acc + tl.dot(hi.to(PIECE_DTYPE), xt) * unit
        small = tl.dot(mid.to(PIECE_DTYPE), xt, small)
        small = tl.dot(lo.to(PIECE_DTYPE), xt, small)
    out = rows.to(tl.int64)[:, None] * num_experts + cols[None, :]
    tl.store(out_ptr + out, tl.trans(acc + small), mask=row_ok[:, None] & col_ok[None, :])


def router_logits(x: torch.Tensor, weight: torch.Tensor, config: RouterConfig, interpreting: bool) -> torch.Tensor:
    """x [T, H] bf16, weight [E, H] fp32, both contiguous -> logits [T, E] fp32."""
    T, H = x.shape
    E = weight.shape[0]
    out = empty_row_major((T, E), torch.float32, x.device)
    launch(
        _router_logits_kernel,
        (triton.cdiv(T, config.BLOCK_M), triton.cdiv(E, config.BLOCK_N)),
        x,
        weight,
        out,
        T,
        E,
        H // 16,
        1.0,
        PIECE_DTYPE=tl.float32 if interpreting else tl.bfloat16,
        BLOCK_M=config.BLOCK_M,
        BLOCK_N=config.BLOCK_N,
        BLOCK_K=config.BLOCK_K,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
