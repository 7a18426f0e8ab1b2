"""The MiniMax-M3 model on the ``torch.ops.mm3`` kernels: plain ``nn.Module``s that
``torch.compile(fullgraph=True)`` traces without graph breaks.

Activations live in the model dtype (bf16); norms, RoPE and the router compute in fp32 and round once.
Per-step metadata is all tensors (:class:`~mm3_compile.models.attention.AttentionMetadata`), so batch size,
token counts and sequence lengths never become Python constants of a compiled graph; prefill and decode are
separate entry points (:meth:`MiniMaxM3ForCausalLM.prefill` / :meth:`MiniMaxM3ForCausalLM.decode`), hence two
graphs, no recompile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mm3_compile.models.attention import AttentionMetadata, M3Attention, check_uniform_decode
from mm3_compile.models.config import MiniMaxM3Config
from mm3_compile.models.moe import M3MoE
from mm3_compile.models.mxfp8 import DenseMLP
from mm3_compile.models.primitives import GemmaRMSNorm, rope_cos_sin, rope_inv_freq
from mm3_compile.models.tp import TPInfo
from mm3_compile.models.weights import random_full_state


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


def build_model(
    config: MiniMaxM3Config,
    seed: int = 0,
    device="cpu",
    dtype=torch.bfloat16,
    group=None,
    state: dict | None = None,
) -> MiniMaxM3ForCausalLM:
    """A seeded random model (this rank's shard when ``group`` is a TP process group).

    Args:
        config: the model's shape (``MiniMaxM3Config.tiny()`` on a CPU, ``.m3_1layer()``, ``.from_pretrained``).
        seed: seeds :func:`~mm3_compile.models.weights.random_full_state` (ignored with ``state``).
        device, dtype: where the model lives and its activation dtype (MXFP8 weights are quantized here).
        group: a ``torch.distributed`` process group for tensor parallelism (``None``: one rank).
        state: full (unsharded) weights under ``random_full_state``'s names, instead of random ones.

    Returns:
        The model in eval mode: ``prefill`` / ``decode(input_ids [T], meta, caches)`` give
        ``(logits [T, vocab] fp32, hiddens, topk)``.

    Examples:
        >>> model = build_model(MiniMaxM3Config.tiny(), seed=0, device="cpu")
        >>> runtime = PagedKVRuntime(model, num_blocks=16, max_blocks_per_request=4)
    """
    device = torch.device(device)
    model = MiniMaxM3ForCausalLM(config, TPInfo.from_group(group), dtype, device)
    model.load_full(state if state is not None else random_full_state(config, seed, dtype, device))
    return model.eval()
