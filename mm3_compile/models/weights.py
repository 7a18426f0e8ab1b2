"""Seeded random weights of the full (unsharded) model under the names ``load_full`` reads."""

from __future__ import annotations

import math

import torch

from mm3_compile.models.config import MiniMaxM3Config


def random_full_state(config: MiniMaxM3Config, seed: int, dtype=torch.bfloat16, device="cpu") -> dict:
    """Seeded random weights of the full (unsharded) model, as a checkpoint would hold them (bf16, fp32 router).

    Scales keep activations O(1): linear weights ~ N(0, 1/fan_in), norm weights near 0 (Gemma's 1 + w).
    Generated on ``device`` (for the real widths: on the GPU), identical for every TP rank on that device type.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    H, D, Didx = config.hidden_size, config.head_dim, config.index_head_dim
    Hq, Hkv, E = config.num_attention_heads, config.num_key_value_heads, config.num_experts

    def randn(*shape, std=1.0, dt=dtype):
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dt)

    def linear(out, fan_in, *lead):
        return randn(*lead, out, fan_in, std=1.0 / math.sqrt(fan_in))

    state = {
        "embed.weight": randn(config.vocab_size, H),
        "lm_head.weight": linear(config.vocab_size, H),
        "final_norm.weight": randn(H, std=0.1),
    }
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        sparse = config.is_sparse_layer(i)
        qkv_rows = (Hq + 2 * Hkv) * D + ((Hkv + 1) * Didx if sparse else 0)
        state[p + "input_norm.weight"] = randn(H, std=0.1)
        state[p + "post_attn_norm.weight"] = randn(H, std=0.1)
        state[p + "attn.qkv_proj.weight"] = linear(qkv_rows, H)
        state[p + "attn.o_proj.weight"] = linear(H, Hq * D)
        norms = [("q_norm", D), ("k_norm", D)] + ([("index_q_norm", Didx), ("index_k_norm", Didx)] if sparse else [])
        for name, width in norms:
            state[p + f"attn.{name}.weight"] = randn(width, std=0.1)
        if sparse:
            I = config.moe_intermediate_size
            state[p + "moe.gate.weight"] = randn(E, H, std=1.0 / math.sqrt(H), dt=torch.float32)
            state[p + "moe.e_score_correction_bias"] = randn(E, std=0.05, dt=torch.float32)
            state[p + "moe.experts.gate_up.weight"] = linear(2 * I, H, E)
            state[p + "moe.experts.down.weight"] = linear(H, I, E)
            if config.num_shared_experts:
                Ish = config.shared_intermediate_size
                state[p + "moe.shared.gate_up.weight"] = linear(2 * Ish, H)
                state[p + "moe.shared.down.weight"] = linear(H, Ish)
        else:
            Id = config.dense_intermediate_size
            state[p + "mlp.gate_up.weight"] = linear(2 * Id, H)
            state[p + "mlp.down.weight"] = linear(H, Id)
    return state
