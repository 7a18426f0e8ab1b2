"""The M3 MoE block: fp32 sigmoid router (``mm3::router_logits``, ``mm3::moe_route``), routed experts on MXFP8
weights, one shared expert.

Dispatch is static-shape: ``mm3::moe_align`` groups the ``T * top_k`` (token, expert) pairs by expert on
device (each group padded to the GEMM row tile, at most 128), ``mm3::mxfp8_grouped_gemm`` runs both expert GEMMs on the
MXFP8 weights (values + E8M0 scales from ``mm3::mxfp8_quantize``), dequantized in registers, reading only the
experts that received pairs; the activation between the GEMMs is the MXFP8 output of
``mm3::swiglu_oai_mxfp8_quant``, consumed as is; the router weights scale GEMM2's fp32 accumulator.
``mm3::moe_experts`` chains the three.
"""

from __future__ import annotations

import torch
from torch import nn

from mm3_compile.contract import MX_BLOCK_SIZE
from mm3_compile.models import tp as tpmod
from mm3_compile.models.config import MiniMaxM3Config
from mm3_compile.models.mxfp8 import MXFP8MLP, MXFP8Weight
from mm3_compile.models.tp import TPInfo


class RoutedExperts(nn.Module):
    """All experts of one MoE layer, this rank's slice of the intermediate dim, MXFP8 weights."""

    def __init__(self, config: MiniMaxM3Config, tp: TPInfo, device):
        super().__init__()
        self.config, self.tp = config, tp
        E, H = config.num_experts, config.hidden_size
        local = tpmod.split_count(config.moe_intermediate_size, tp, "moe_intermediate_size", multiple=MX_BLOCK_SIZE)
        self.gate_up = MXFP8Weight((E, 2 * local, H), device)
        self.down = MXFP8Weight((E, H, local), device)

    def load_full(self, state: dict, prefix: str) -> None:
        self.gate_up.load(tpmod.shard_gate_up(state[prefix + "gate_up.weight"], self.tp, dim=1))
        self.down.load(tpmod.shard_down(state[prefix + "down.weight"], self.tp, dim=2))

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared: MXFP8MLP | None = None
    ) -> torch.Tensor:
        """x [T, H], ids/weights [T, k] -> fp32 [T, H] = sum_k weights * expert_k(x) (+ ``shared(x)``, whose
        widths must be the routed experts', in the same launches)."""
        cfg = self.config
        extra = (
            ()
            if shared is None
            else (shared.gate_up.values, shared.gate_up.scales, shared.down.values, shared.down.scales)
        )
        return torch.ops.mm3.moe_experts(
            x,
            ids,
            weights,
            self.gate_up.values,
            self.gate_up.scales,
            self.down.values,
            self.down.scales,
            cfg.swiglu_alpha,
            cfg.swiglu_beta,
            cfg.swiglu_limit,
            *extra,
        )

    def can_fold(self, shared: MXFP8MLP) -> bool:
        """Whether ``shared`` has this layer's expert widths (M3: 3072 both), so it runs as one more expert."""
        return (
            shared.gate_up.values.shape == self.gate_up.values.shape[1:]
            and shared.down.values.shape == self.down.values.shape[1:]
        )


class M3MoE(nn.Module):
    """Router (fp32, replicated), routed experts, one shared expert; one all-reduce for the sum."""

    def __init__(self, config: MiniMaxM3Config, tp: TPInfo, dtype, device):
        super().__init__()
        self.config, self.tp = config, tp
        E, H = config.num_experts, config.hidden_size
        self.gate_weight = nn.Parameter(torch.zeros(E, H, dtype=torch.float32, device=device), requires_grad=False)
        self.register_buffer("correction_bias", torch.zeros(E, dtype=torch.float32, device=device))
        self.experts = RoutedExperts(config, tp, device)
        self.shared = (
            MXFP8MLP(config, config.shared_intermediate_size, tp, dtype, device) if config.num_shared_experts else None
        )

    @torch.no_grad()
    def load_full(self, state: dict, prefix: str) -> None:
        self.gate_weight.copy_(state[prefix + "gate.weight"])
        self.correction_bias.copy_(state[prefix + "e_score_correction_bias"])
        self.experts.load_full(state, prefix + "experts.")
        if self.shared is not None:
            self.shared.load_full(state, prefix + "shared.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        logits = torch.ops.mm3.router_logits(x, self.gate_weight)  # [T, E] fp32
        ids, weights = torch.ops.mm3.moe_route(
            logits, self.correction_bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        )
        if self.shared is not None and self.experts.can_fold(self.shared):
            out = self.experts(x, ids, weights, self.shared)  # [T, H] fp32, the shared expert included
        else:
            out = self.experts(x, ids, weights)
            if self.shared is not None:
                out = out + self.shared(x).float()
        return self.tp.all_reduce(out.to(x.dtype))
