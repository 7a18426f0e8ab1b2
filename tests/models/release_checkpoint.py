"""Writes tiny synthetic checkpoints in the MiniMax-M3 release layout (names, dtypes, config.json, shards, index).

Written independently of the loader: the names come from the release (see the module docstring of
mm3_compile/models/checkpoint.py), the MXFP8 bytes from ``mm3::mxfp8_quantize`` on the CPU (OCP
e4m3fn values, E8M0 bytes as uint8 under ``weight_scale_inv``).
"""

import json
import os

import torch
from safetensors.torch import save_file

from mm3_compile import platform
from mm3_compile.models import MiniMaxM3Config


def hf_config(config: MiniMaxM3Config, vl: bool = True, mxfp8: bool = True) -> dict:
    """config.json of the release (VL form: the text model under text_config)."""
    L, dense = config.num_hidden_layers, config.num_dense_layers
    pattern = [0] * dense + [1] * (L - dense)
    text = {
        "model_type": "minimax_m3_text",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": L,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "use_gemma_norm": True,
        "rope_theta": config.rope_theta,
        "partial_rotary_factor": config.rotary_dim / config.head_dim,
        "hidden_act": "swigluoai",
        "swiglu_alpha": config.swiglu_alpha,
        "swiglu_limit": config.swiglu_limit,
        "intermediate_size": config.moe_intermediate_size,
        "dense_intermediate_size": config.dense_intermediate_size,
        "shared_intermediate_size": config.shared_intermediate_size,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "n_shared_experts": config.num_shared_experts,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "routed_scaling_factor": config.routed_scaling_factor,
        "moe_layer_freq": pattern,
        "num_mtp_modules": 1,
        "tie_word_embeddings": config.tie_word_embeddings,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": 1048576,
        "sparse_attention_config": {
            "sparse_attention_freq": pattern,
            "sparse_num_index_heads": config.num_index_heads,
            "sparse_index_dim": config.index_head_dim,
            "sparse_topk_blocks": config.sparse_topk_blocks,
            "sparse_block_size": config.sparse_block_size,
            "sparse_init_block": config.sparse_init_blocks,
            "sparse_local_block": config.sparse_local_blocks,
            "sparse_score_type": "max",
            "sparse_disable_index_value": True,
        },
    }
    quant = {"quant_method": "mxfp8", "weight_block_size": [1, 32], "ignored_layers": ["lm_head"]}
    if not vl:
        return text | ({"quantization_config": quant} if mxfp8 else {})
    top = {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"]}
    return top | {"text_config": text} | ({"quantization_config": quant} if mxfp8 else {})


def release_tensors(state: dict, config: MiniMaxM3Config, vl: bool = True, mxfp8: bool = True) -> dict:
    """Our full state (random_full_state's names) under the release's names and dtypes, plus MTP/vision extras."""
    prefix = "language_model.model." if vl else "model."
    out = {}

    def linear(name, w):
        if mxfp8:
            values, scales = torch.ops.mm3.mxfp8_quantize(w.contiguous())
            assert values.dtype == platform.FP8_E4M3_OCP
            out[prefix + name + ".weight"] = values
            out[prefix + name + ".weight_scale_inv"] = scales.view(torch.uint8)
        else:
            out[prefix + name + ".weight"] = w.contiguous()

    H, D, Didx = config.hidden_size, config.head_dim, config.index_head_dim
    Hq, Hkv = config.num_attention_heads, config.num_key_value_heads
    out[prefix + "embed_tokens.weight"] = state["embed.weight"]
    out[prefix + "norm.weight"] = state["final_norm.weight"]
    out[("language_model." if vl else "") + "lm_head.weight"] = state["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        p, r = f"layers.{i}.", f"layers.{i}."
        sparse = config.is_sparse_layer(i)
        out[prefix + r + "input_layernorm.weight"] = state[p + "input_norm.weight"]
        out[prefix + r + "post_attention_layernorm.weight"] = state[p + "post_attn_norm.weight"]
        sizes = [Hq * D, Hkv * D, Hkv * D] + ([Hkv * Didx, Didx] if sparse else [])
        names = ["q_proj", "k_proj", "v_proj"] + (["index_q_proj", "index_k_proj"] if sparse else [])
        for name, w in zip(names, state[p + "attn.qkv_proj.weight"].split(sizes)):
            linear(r + "self_attn." + name, w)
        linear(r + "self_attn.o_proj", state[p + "attn.o_proj.weight"])
        for name in ["q_norm", "k_norm"] + (["index_q_norm", "index_k_norm"] if sparse else []):
            out[prefix + r + f"self_attn.{name}.weight"] = state[p + f"attn.{name}.weight"]
        if not sparse:
            gate, up = state[p + "mlp.gate_up.weight"].chunk(2)
            linear(r + "mlp.gate_proj", gate)
            linear(r + "mlp.up_proj", up)
            linear(r + "mlp.down_proj", state[p + "mlp.down.weight"])
            continue
        m = r + "block_sparse_moe."
        out[prefix + m + "gate.weight"] = state[p + "moe.gate.weight"]
        out[prefix + m + "e_score_correction_bias"] = state[p + "moe.e_score_correction_bias"]
        for e in range(config.num_experts):
            gate, up = state[p + "moe.experts.gate_up.weight"][e].chunk(2)
            linear(f"{m}experts.{e}.w1", gate)
            linear(f"{m}experts.{e}.w3", up)
            linear(f"{m}experts.{e}.w2", state[p + "moe.experts.down.weight"][e])
        if config.num_shared_experts:
            gate, up = state[p + "moe.shared.gate_up.weight"].chunk(2)
            linear(m + "shared_experts.gate_proj", gate)
            linear(m + "shared_experts.up_proj", up)
            linear(m + "shared_experts.down_proj", state[p + "moe.shared.down.weight"])
    # skipped by the loader: an MTP module and (VL form) a vision tower weight
    out["model.mtp.0.enorm.weight"] = torch.zeros(H, dtype=torch.bfloat16)
    if vl:
        out["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3, dtype=torch.bfloat16)
    return {k: v.contiguous() for k, v in out.items()}


def write_checkpoint(directory, state, config, vl=True, mxfp8=True, shards=3, extra=None, drop=()) -> dict:
    """config.json + ``shards`` safetensors files + model.safetensors.index.json; returns the tensors."""
    os.makedirs(directory, exist_ok=True)
    tensors = release_tensors(state, config, vl, mxfp8) | (extra or {})
    for name in drop:
        del tensors[name]
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(config, vl, mxfp8), f, indent=1)
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return tensors
