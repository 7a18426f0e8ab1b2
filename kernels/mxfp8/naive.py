"""Pure-PyTorch references for the MXFP8 kernels, written from the contract, not from the kernels.

Scale exponents are computed in float64 (exact for every fp32 amax: a ratio amax/FP8_MAX that is
not a power of two stays more than one fp64 ulp away from it), values with torch's own
round-to-nearest-even cast after an explicit saturation.
"""

import torch

from mm3_compile.contract import MX_BLOCK_SIZE
from mm3_compile.platform import E8M0_DTYPE, FP8Format

FP32_TINY = torch.finfo(torch.float32).tiny


def mxfp8_quantize_ref(x: torch.Tensor, fmt: FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> values [..., K] (fmt.dtype), scales [..., K/32] (float8_e8m0fnu)."""
    K = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], K // MX_BLOCK_SIZE, MX_BLOCK_SIZE)  # [..., K/32, 32]
    # NaN elements do not take part in the block scale; they encode as NaN.
    magnitude = torch.where(torch.isnan(blocks), 0.0, blocks.abs())
    amax = magnitude.amax(dim=-1, keepdim=True).clamp(min=FP32_TINY).double()  # [..., K/32, 1]
    exponent = torch.ceil(torch.log2(amax / fmt.max)) + 127
    sb = torch.nan_to_num(exponent, posinf=254.0).clamp(0, 254)  # inf amax -> 254
    scaled = torch.where(torch.isnan(blocks), blocks, blocks * torch.exp2(127 - sb).float())
    values = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype).reshape(x.shape)
    scales = sb.squeeze(-1).to(torch.uint8).view(E8M0_DTYPE)
    return values, scales


def mxfp8_quantize_floor_ref(x: torch.Tensor, fmt: FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-#53110/#53668 rule ``floor(log2(amax)) + 127``: kept only as a negative control."""
    K = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], K // MX_BLOCK_SIZE, MX_BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30).double()
    sb = (torch.floor(torch.log2(amax)) + 127).clamp(0, 254)
    scaled = blocks / torch.exp2(sb - 127).float()
    values = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype).reshape(x.shape)
    return values, sb.squeeze(-1).to(torch.uint8).view(E8M0_DTYPE)


def mxfp8_dequantize_ref(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values.float() * 2^(sb - 127), per 32-element block; fp32 result."""
    sb = scales.view(torch.uint8).double()
    factor = torch.exp2(sb - 127).repeat_interleave(MX_BLOCK_SIZE, dim=-1)
    return (values.double() * factor).float()


def swiglu_oai_ref(gate_up: torch.Tensor, alpha: float = 1.702, beta: float = 1.0, limit: float | None = 7.0):
    """gate_up [..., 2I] split layout -> fp32 activation [..., I]."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)
