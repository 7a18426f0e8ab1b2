"""MiniMax-M3 layers on the ``torch.ops.mm3`` kernels: plain ``nn.Module``s that ``torch.compile(fullgraph=True)``
traces without graph breaks.

Activations live in the model dtype (bf16); norms, RoPE and the router compute in fp32 and round once.
Per-step metadata is all tensors (:class:`AttentionMetadata`), so batch size, token counts and sequence
lengths never become Python constants of a compiled graph; prefill and decode are separate entry points
(:meth:`MiniMaxM3ForCausalLM.prefill` / :meth:`MiniMaxM3ForCausalLM.decode`), hence two graphs, no recompile.

Design choices worth knowing:

* Dense attention (layers ``< num_dense_layers``) uses the same paged cache and the same ``mm3`` attention
  kernels as the sparse layers, with a block list naming every block (``arange(max_blocks)``): the kernels
  clip each query to its ``p // 128 + 1`` visible blocks, so that is exact causal attention, and FP8 KV
  works for dense layers too.
* The index-K cache (model dtype, one shared head, ``[num_blocks, 1, 128, Didx]``) is written with
  ``mm3::kv_cache_write`` like the main cache: the two halves of a row are the op's key and value, and
  padding tokens (slot < 0) are skipped by the op.
* MoE dispatch is static-shape: ``mm3::moe_align`` groups the ``T * top_k`` (token, expert) pairs by expert
  on device (each group padded to the GEMM row tile), ``mm3::mxfp8_grouped_gemm`` runs both expert GEMMs on
  the MXFP8 weights (values + E8M0 scales from ``mm3::mxfp8_quantize``), dequantized in registers, reading only
  the experts that received pairs; the activation between the GEMMs is the MXFP8 output of
  ``mm3::swiglu_oai_mxfp8_quant``, consumed as is; the router weights scale GEMM2's fp32 accumulator.
* The dense MLP, the shared expert and the attention projections (q/k/v/o, index q/k: MXFP8 in the release)
  use ``mm3::mxfp8_linear`` (the one-expert GEMM, :meth:`MXFP8Weight.linear`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from mm3_compile import platform
from mm3_compile.contract import E8M0_BIAS, MX_BLOCK_SIZE
from mm3_compile.models import tp as tpmod
from mm3_compile.models.config import MiniMaxM3Config
from mm3_compile.models.tp import HeadShard, TPInfo
from mm3_compile.ops import values_checked


@dataclasses.dataclass
class AttentionMetadata:
    """One step's batch description, all device tensors (plus the static cache spec).

    Tokens are packed request-major: request r owns rows ``cu_seqlens_q[r]:cu_seqlens_q[r+1]``; its query i
    sits at position ``seq_lens[r] - q_len_r + i``.
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, page * 128 + offset (< 0: do not write); same pages for both caches
    block_table: torch.Tensor  # [R, max_blocks] int32, logical block -> physical page
    cu_seqlens_q: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32, KV length including this step's tokens
    kv_cache_dtype: str = "auto"


# ---------------------------------------------------------------------------------------------------
# Elementwise building blocks


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


# ---------------------------------------------------------------------------------------------------
# MXFP8 weights


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


# ---------------------------------------------------------------------------------------------------
# Attention


class M3Attention(nn.Module):
    """GQA attention over the paged cache: sparse (lightning indexer + top-k blocks) or dense (every block)."""

    def __init__(self, config: MiniMaxM3Config, sparse: bool, tp: TPInfo, dtype, device):
        super().__init__()
        self.config, self.sparse, self.tp = config, sparse, tp
        self.heads = HeadShard.for_rank(config.num_attention_heads, config.num_key_value_heads, tp)
        D, Didx = config.head_dim, config.index_head_dim
        hq, hkv = self.heads.num_q_heads, self.heads.num_kv_heads
        # packed row [q | k | v | index_q | index_k] in heads of width D (= Didx, see the config); index heads
        # follow the KV heads, index-K is one shared head
        self.head_splits = [hq, hkv, hkv] + ([hkv, 1] if sparse else [])
        # MXFP8 like the release stores them (q/k/v/o and the index projections)
        self.qkv = MXFP8Weight((sum(self.head_splits) * D, config.hidden_size), device)
        self.o = MXFP8Weight((config.hidden_size, hq * D), device)
        eps = config.rms_norm_eps
        self.q_norm = GemmaRMSNorm(D, eps, dtype, device)
        self.k_norm = GemmaRMSNorm(D, eps, dtype, device)
        if sparse:
            self.index_q_norm = GemmaRMSNorm(Didx, eps, dtype, device)
            self.index_k_norm = GemmaRMSNorm(Didx, eps, dtype, device)

    def index_k_scale(self, fp8_dtype: torch.dtype | None = None) -> torch.Tensor:
        """fp32 [1]: the scalar FP8 scale of this layer's index-K, ``sqrt(Didx) * max|1 + w| / FP8_MAX``.

        Index-K is Gemma-RMS-normed (``|x_i| / rms(x) <= sqrt(Didx)``, times ``1 + w_i``) then rotated in
        pairs (which keeps each pair's norm), so ``|k_i| <= sqrt(Didx) * max|1 + w|``: no key saturates, and
        e4m3's relative precision is the same across its normal range.
        """
        dtype = fp8_dtype if fp8_dtype is not None else platform.platform_for(self.qkv_weight.device).kv_e4m3_dtype
        bound = (1.0 + self.index_k_norm.weight.float()).abs().amax() * math.sqrt(self.config.index_head_dim)
        return (bound / platform.fp8_format(dtype).max).clamp(min=torch.finfo(torch.float32).tiny).reshape(1)

    @torch.no_grad()
    def load_full(self, state: dict, prefix: str) -> None:
        cfg, h = self.config, self.heads
        D, Didx, Hq, Hkv = cfg.head_dim, cfg.index_head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        full_sizes = [Hq * D, Hkv * D, Hkv * D] + ([Hkv * Didx, Didx] if self.sparse else [])
        q, k, v, *index = state[prefix + "qkv_proj.weight"].split(full_sizes, dim=0)
        pieces = [
            tpmod.shard_heads(q, D, h.q_start, h.num_q_heads),
            tpmod.shard_heads(k, D, h.kv_start, h.num_kv_heads),
            tpmod.shard_heads(v, D, h.kv_start, h.num_kv_heads),
        ]
        if self.sparse:
            pieces += [tpmod.shard_heads(index[0], Didx, h.kv_start, h.num_kv_heads), index[1]]
        self.qkv.load(torch.cat(pieces, dim=0))
        self.o.load(tpmod.shard_heads(state[prefix + "o_proj.weight"], D, h.q_start, h.num_q_heads, dim=1))
        names = ["q_norm", "k_norm"] + (["index_q_norm", "index_k_norm"] if self.sparse else [])
        for name in names:
            getattr(self, name).weight.copy_(state[prefix + name + ".weight"])

    def forward(
        self,
        x: torch.Tensor,  # [T, H] normed hidden states
        meta: AttentionMetadata,
        cos: torch.Tensor,  # [T, rotary_dim / 2] fp32
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, Hkv, 128, 2D] (mutated)
        index_cache: torch.Tensor | None,  # [num_blocks, 1, 128, Didx] (mutated): one shared index-K head
        decode: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        T = x.shape[0]
        D = cfg.head_dim
        hq, hkv = self.heads.num_q_heads, self.heads.num_kv_heads
        eps = cfg.rms_norm_eps
        # view the contiguous projection as heads, then split: a view of a split slice would guard on T
        parts = self.qkv.linear(x).view(T, -1, D).split(self.head_splits, dim=1)
        q = norm_rope(parts[0], self.q_norm.weight, eps, cos, sin)  # [T, hq, D]
        k = norm_rope(parts[1], self.k_norm.weight, eps, cos, sin)  # [T, hkv, D]
        v = parts[2]  # V gets neither norm nor RoPE
        torch.ops.mm3.kv_cache_write(k, v, kv_cache, meta.slot_mapping, meta.kv_cache_dtype)

        if self.sparse:
            index_q = norm_rope(parts[3], self.index_q_norm.weight, eps, cos, sin)  # [T, Hidx, Didx]
            index_k = norm_rope(parts[4], self.index_k_norm.weight, eps, cos, sin)  # [T, 1, Didx]
            fp8_index = platform.is_fp8(index_cache.dtype)
            write_index_cache(index_cache, index_k, meta.slot_mapping, self.index_k_scale() if fp8_index else None)
            topk_idx = torch.ops.mm3.index_topk(
                index_q, index_cache.squeeze(1), meta.block_table, meta.cu_seqlens_q, meta.seq_lens,
                cfg.sparse_topk_blocks, cfg.sparse_init_blocks, cfg.sparse_local_blocks,
                "fp8" if fp8_index else "auto",
            )  # [Hkv, T, topk] int32  # fmt: skip
        else:
            # every block: the kernels clip query p to its p // 128 + 1 visible blocks -> exact causal attention
            max_blocks = meta.block_table.shape[1]
            blocks = torch.arange(max_blocks, dtype=torch.int32, device=x.device)
            # a broadcast add, not expand().contiguous(): the contiguity check would guard on T != 1
            topk_idx = torch.zeros((hkv, T, 1), dtype=torch.int32, device=x.device) + blocks  # [Hkv, T, max_blocks]

        if decode:
            out = torch.ops.mm3.sparse_attn_decode(
                q, kv_cache, topk_idx, meta.block_table, meta.seq_lens, cfg.sm_scale, meta.kv_cache_dtype
            )
        else:
            out = torch.ops.mm3.sparse_attn_prefill(
                q, kv_cache, topk_idx, meta.block_table, meta.cu_seqlens_q, meta.seq_lens, cfg.sm_scale,
                meta.kv_cache_dtype,
            )  # fmt: skip
        out = self.o.linear(out.reshape(T, hq * D))  # [T, H] partial sum over this rank's heads
        return self.tp.all_reduce(out), topk_idx


def write_index_cache(
    index_cache: torch.Tensor, index_k: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None
) -> None:
    """index_k [T, 1, Didx] -> index_cache [num_blocks, 1, 128, Didx] through ``mm3::kv_cache_write``.

    The op stores a row as [key | value]: the two halves of the index key are its "key" and "value"
    (one head of width Didx = 2 * Didx/2), so padding slots (< 0) are skipped the same way as in the KV cache.
    An FP8 cache (typed in the authority's e4m3 flavour) stores ``index_k / k_scale`` with one scalar
    ``k_scale`` per layer (:meth:`M3Attention.index_k_scale`); one positive scale for every key does not
    change any ranking, so ``mm3::index_topk`` reads the stored values unscaled.
    """
    half = index_k.shape[-1] // 2
    spec = "fp8" if platform.is_fp8(index_cache.dtype) else "auto"
    torch.ops.mm3.kv_cache_write(
        index_k[..., :half], index_k[..., half:], index_cache, slot_mapping, spec, k_scale, k_scale
    )


# ---------------------------------------------------------------------------------------------------
# MoE


def route(
    logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing: experts chosen on ``sigmoid + bias``, weighted by the un-biased sigmoid, renormalised."""
    scores = logits.sigmoid()  # [T, E] fp32
    _, ids = torch.topk(scores + correction_bias, top_k, dim=-1)  # [T, k]
    weights = scores.gather(-1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * scaling


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

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids/weights [T, k] -> fp32 [T, H] = sum_k weights * expert_k(x)."""
        cfg = self.config
        return torch.ops.mm3.moe_experts(
            x, ids, weights, self.gate_up.values, self.gate_up.scales, self.down.values, self.down.scales,
            cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit,
        )  # fmt: skip


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
        logits = F.linear(x.float(), self.gate_weight)  # [T, E] fp32
        ids, weights = route(logits, self.correction_bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        out = self.experts(x, ids, weights)  # [T, H] fp32
        if self.shared is not None:
            out = out + self.shared(x).float()
        return self.tp.all_reduce(out.to(x.dtype))


class DenseMLP(MXFP8MLP):
    def __init__(self, config: MiniMaxM3Config, tp: TPInfo, dtype, device):
        super().__init__(config, config.dense_intermediate_size, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


# ---------------------------------------------------------------------------------------------------
# Decoder


class M3DecoderLayer(nn.Module):
    def __init__(self, config: MiniMaxM3Config, layer_idx: int, tp: TPInfo, dtype, device):
        super().__init__()
        self.sparse = config.is_sparse_layer(layer_idx)
        eps = config.rms_norm_eps
        self.input_norm = GemmaRMSNorm(config.hidden_size, eps, dtype, device)
        self.attn = M3Attention(config, self.sparse, tp, dtype, device)
        self.post_attn_norm = GemmaRMSNorm(config.hidden_size, eps, dtype, device)
        self.mlp = M3MoE(config, tp, dtype, device) if self.sparse else DenseMLP(config, tp, dtype, device)

    @torch.no_grad()
    def load_full(self, state: dict, prefix: str) -> None:
        self.input_norm.weight.copy_(state[prefix + "input_norm.weight"])
        self.post_attn_norm.weight.copy_(state[prefix + "post_attn_norm.weight"])
        self.attn.load_full(state, prefix + "attn.")
        self.mlp.load_full(state, prefix + ("moe." if self.sparse else "mlp."))

    def forward(self, h, meta, cos, sin, kv_cache, index_cache, decode: bool):
        attn_out, topk_idx = self.attn(self.input_norm(h), meta, cos, sin, kv_cache, index_cache, decode)
        h_mid = h + attn_out
        h_out = h_mid + self.mlp(self.post_attn_norm(h_mid))
        return h_mid, h_out, topk_idx


class MiniMaxM3ForCausalLM(nn.Module):
    """Embedding, decoder layers, final Gemma norm, LM head.

    ``prefill``/``decode`` return ``(logits [T, V] fp32, hiddens, topk)``: ``hiddens`` are the residual
    stream at every sub-block boundary (``[embed, l0 after attn, l0 out, l1 after attn, ...]``, 2L+1 tensors,
    what the reference checks sub-block by sub-block) and ``topk`` the ``[Hkv, T, topk]`` block lists of the
    sparse layers.
    """

    def __init__(self, config: MiniMaxM3Config, tp: TPInfo | None = None, dtype=torch.bfloat16, device="cpu"):
        super().__init__()
        self.config, self.tp, self.dtype = config, tp or TPInfo(), dtype
        self.device = torch.device(device)
        H = config.hidden_size
        self.embed = nn.Parameter(torch.zeros(config.vocab_size, H, dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(
            M3DecoderLayer(config, i, self.tp, dtype, device) for i in range(config.num_hidden_layers)
        )
        self.final_norm = GemmaRMSNorm(H, config.rms_norm_eps, dtype, device)
        self.lm_head = nn.Parameter(torch.zeros(config.vocab_size, H, dtype=dtype, device=device), requires_grad=False)
        self.register_buffer("inv_freq", rope_inv_freq(config.rotary_dim, config.rope_theta, device), persistent=False)

    @torch.no_grad()
    def load_full(self, state: dict) -> None:
        """Load a full (unsharded) state dict, keeping this rank's shard; MoE/MLP weights are quantized here."""
        self.embed.copy_(state["embed.weight"])
        self.lm_head.copy_(state["lm_head.weight"])
        self.final_norm.weight.copy_(state["final_norm.weight"])
        for i, layer in enumerate(self.layers):
            layer.load_full(state, f"layers.{i}.")

    def _forward(self, input_ids, meta: AttentionMetadata, caches, decode: bool):
        h = F.embedding(input_ids, self.embed)  # [T, H]
        cos, sin = rope_cos_sin(meta.positions, self.inv_freq)
        hiddens, topks = [h], []
        for layer, (kv_cache, index_cache) in zip(self.layers, caches):
            h_mid, h, topk_idx = layer(h, meta, cos, sin, kv_cache, index_cache, decode)
            hiddens += [h_mid, h]
            if layer.sparse:
                topks.append(topk_idx)
        logits = F.linear(self.final_norm(h), self.lm_head).float()  # [T, V]
        return logits, tuple(hiddens), tuple(topks)

    def prefill(self, input_ids: torch.Tensor, meta: AttentionMetadata, caches):
        """Packed prompts (any lengths, with or without a cached prefix) -> (logits, hiddens, topk)."""
        return self._forward(input_ids, meta, caches, decode=False)

    def decode(self, input_ids: torch.Tensor, meta: AttentionMetadata, caches):
        """Uniform decode: the same number of new tokens (usually 1) for every request."""
        if not torch.compiler.is_compiling():
            check_uniform_decode(meta)
        return self._forward(input_ids, meta, caches, decode=True)


def check_uniform_decode(meta: AttentionMetadata) -> None:
    """Decode attention maps token b to request b // q_per_req (the op takes no cu_seqlens_q): a ragged
    batch would attend the wrong requests' keys, so it is refused when index values are checked
    (CPU tensors, or MM3_VALIDATE=1; one device sync on a GPU)."""
    if not values_checked(meta.cu_seqlens_q):
        return
    q_lens = meta.cu_seqlens_q.diff().tolist()
    if len(set(q_lens)) > 1:
        raise ValueError(
            f"meta: decode needs the same number of new tokens for every request, got {q_lens}; "
            "run ragged batches through prefill"
        )


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


def build_model(
    config: MiniMaxM3Config,
    seed: int = 0,
    device="cpu",
    dtype=torch.bfloat16,
    group=None,
    state: dict | None = None,
) -> MiniMaxM3ForCausalLM:
    """A seeded random model (this rank's shard when ``group`` is a TP process group)."""
    device = torch.device(device)
    model = MiniMaxM3ForCausalLM(config, TPInfo.from_group(group), dtype, device)
    model.load_full(state if state is not None else random_full_state(config, seed, dtype, device))
    return model.eval()
