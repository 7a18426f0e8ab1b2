"""MXFP8 linear weights (values + E8M0 scales, blocks along ``in``) and the SwiGLU-OAI MLPs built on them.

The dense MLP, the shared expert and the attention projections (q/k/v/o, index q/k: MXFP8 in the release)
use ``mm3::mxfp8_linear`` (the one-expert GEMM, :meth:`MXFP8Weight.linear`).
"""

from __future__ import annotations

import torch
from torch import nn

from mm3_compile import platform
from mm3_compile.contract import E8M0_BIAS, MX_BLOCK_SIZE
from mm3_compile.models import tp as tpmod
from mm3_compile.models.config import MiniMaxM3Config
from mm3_compile.models.tp import TPInfo


def mxfp8_dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., K] (platform MXFP8 dtype) x 2^(E8M0 - 127) per 32-block -> [..., K] in ``dtype``."""
    factor = torch.exp2(scales.view(torch.uint8).float() - E8M0_BIAS)  # [..., K/32]; E8M0 byte = exponent + 127
    blocks = values.float().unflatten(-1, (-1, MX_BLOCK_SIZE)) * factor.unsqueeze(-1)  # [..., K/32, 32]
    return blocks.flatten(-2).to(dtype)


class MXFP8Weight(nn.Module):
    """A linear weight ``[..., out, in]`` stored as MXFP8 values + E8M0 scales (blocks along ``in``)."""

    def __init__(self, shape: tuple[int, ...], device):
        super().__init__()
        value_dtype = platform.mxfp8_value_dtype(torch.device(device))
        self.register_buffer("values", torch.zeros(shape, dtype=value_dtype, device=device))
        scale_shape = (*shape[:-1], shape[-1] // MX_BLOCK_SIZE)
        # the E8M0 bytes are kept as uint8: Inductor's CPU backend has no float8_e8m0fnu type
        self.register_buffer("scales", torch.zeros(scale_shape, dtype=torch.uint8, device=device))

    @torch.no_grad()
    def load(self, w: torch.Tensor) -> None:
        values, scales = torch.ops.mm3.mxfp8_quantize(w.to(self.values.device).contiguous())
        self.values.copy_(values)
        self.scales.copy_(scales.view(torch.uint8))

    @torch.no_grad()
    def load_stored(self, values: torch.Tensor, scales: torch.Tensor, index: int | None = None) -> None:
        """Copy stored MXFP8 ``values`` (platform dtype) and E8M0 ``scales`` as they are (no re-quantization),
        into the whole weight or into its slice ``index`` of the leading (expert) dim."""
        dst_values, dst_scales = self.values, self.scales
        if index is not None:
            dst_values, dst_scales = dst_values[index], dst_scales[index]
        if values.dtype != dst_values.dtype or values.shape != dst_values.shape:
            want, got = f"{dst_values.dtype} {list(dst_values.shape)}", f"{values.dtype} {list(values.shape)}"
            raise ValueError(f"values: expected {want}, got {got}")
        if scales.dtype not in (torch.uint8, platform.E8M0_DTYPE) or scales.shape != dst_scales.shape:
            want, got = f"uint8 E8M0 bytes {list(dst_scales.shape)}", f"{scales.dtype} {list(scales.shape)}"
            raise ValueError(f"scales: expected {want}, got {got}")
        dst_values.copy_(values)
        dst_scales.copy_(scales.view(torch.uint8))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return mxfp8_dequantize(self.values, self.scales, dtype)

    def linear(self, x: torch.Tensor, x_scales: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ W^T -> [..., out] in x's dtype, the weight dequantized in registers (``mm3::mxfp8_linear``).

        With ``x_scales`` x is an MXFP8 activation (values + E8M0 scales) and the result is bf16.
        """
        return torch.ops.mm3.mxfp8_linear(x, self.values, self.scales, x_scales)


class MXFP8MLP(nn.Module):
    """SwiGLU-OAI MLP (dense MLP of layers 0-2, shared expert): column-parallel gate_up, row-parallel down.

    Returns this rank's partial sum (the caller reduces once for everything it adds up).
    """

    def __init__(self, config: MiniMaxM3Config, intermediate: int, tp: TPInfo, dtype, device):
        super().__init__()
        self.config, self.tp, self.dtype = config, tp, dtype
        local = tpmod.split_count(intermediate, tp, "intermediate size", multiple=MX_BLOCK_SIZE)
        self.gate_up = MXFP8Weight((2 * local, config.hidden_size), device)
        self.down = MXFP8Weight((config.hidden_size, local), device)

    def load_full(self, state: dict, prefix: str) -> None:
        self.gate_up.load(tpmod.shard_gate_up(state[prefix + "gate_up.weight"], self.tp, dim=0))
        self.down.load(tpmod.shard_down(state[prefix + "down.weight"], self.tp, dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        gate_up = self.gate_up.linear(x)  # [T, 2I]
        values, scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(
            gate_up, cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit
        )
        # the MXFP8 activation goes into the down GEMM as is
        return self.down.linear(values, scales).to(x.dtype)  # [T, H]


class DenseMLP(MXFP8MLP):
    def __init__(self, config: MiniMaxM3Config, tp: TPInfo, dtype, device):
        super().__init__(config, config.dense_intermediate_size, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))
