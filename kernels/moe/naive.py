"""Float64 references of the MoE ops, independent of the kernels (plain PyTorch, per-expert loops)."""

import torch

from mm3_compile.contract import E8M0_BIAS, MX_BLOCK_SIZE


def mx_dequantize_f64(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values [..., K] (any FP8 dtype) x 2^(E8M0 byte - 127) per 32-block -> float64 [..., K].

    The E8M0 byte 255 is NaN; a product at or past 2^128 (the largest codes times 2^127) is +-Inf, as it is for every fp32
    or bf16 consumer of the value (bf16 holds every smaller product exactly).
    """
    sb = scales.view(torch.uint8).double()
    factor = torch.where(sb == 2 * E8M0_BIAS + 1, torch.nan, torch.exp2(sb - E8M0_BIAS))
    blocks = (values.double().unflatten(-1, (-1, MX_BLOCK_SIZE)) * factor.unsqueeze(-1)).flatten(-2)
    return torch.where(blocks.abs() >= 2.0**128, blocks.sign() * torch.inf, blocks)


def mxfp8_linear_ref(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dequant(values [N, K])^T in float64 -> [..., N] float64."""
    return x.double() @ mx_dequantize_f64(values, scales).T


def grouped_gemm_ref(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per (token, slot) pair ``x[t] @ W[ids[t, j]]^T`` in float64: ``[T * k, N]`` in pair order ``t * k + j``.

    ``x`` is ``[T, K]`` (each token feeds its k pairs) or already ``[T * k, K]`` (one row per pair), float64.
    """
    flat = ids.reshape(-1)
    rows = x if x.shape[0] == flat.numel() else x.repeat_interleave(ids.shape[1], dim=0)
    out = torch.empty(flat.numel(), values.shape[1], dtype=torch.float64, device=x.device)
    for e in flat.unique().tolist():  # only the experts that received pairs
        sel = (flat == e).nonzero().squeeze(1)
        out[sel] = rows[sel].double() @ mx_dequantize_f64(values[e], scales[e]).T
    return out


def route_ref(
    logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """M3 sigmoid routing in fp32 (the model's precision): experts chosen on ``sigmoid(logits) + bias``, weighted
    by the un-biased sigmoid, renormalised, times ``scaling``. Order: the highest key first, ties by the lower
    expert index, NaN above every number (a stable descending sort). -> (ids [T, k] int64, weights [T, k] fp32).
    """
    scores = logits.float().sigmoid()  # [T, E]
    ids = torch.sort(scores + correction_bias.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(-1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * scaling
