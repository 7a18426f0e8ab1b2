"""Elementwise building blocks of the M3 layers: Gemma RMSNorm and partial NeoX RoPE, computed in fp32."""

from __future__ import annotations

import torch
from torch import nn


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm in fp32: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` (fp32 result)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())


class GemmaRMSNorm(nn.Module):
    def __init__(self, width: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps).to(x.dtype)


def rope_inv_freq(rotary_dim: int, theta: float, device) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return (1.0 / theta**exponents).to(torch.float32).to(device)  # [rotary_dim / 2]


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
    return angles.cos(), angles.sin()


def apply_partial_neox_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of dims ``[0, rotary_dim)`` of fp32 ``x [T, heads, dim]``; the rest passes through."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, half]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos, sin) -> torch.Tensor:
    """Per-head Gemma norm then partial RoPE, in fp32, rounded once to x's dtype (the fused M3 insert op)."""
    return apply_partial_neox_rope(gemma_rms_norm(x, weight, eps), cos, sin).to(x.dtype)
