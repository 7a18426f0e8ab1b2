"""GQA attention of the M3 layers over the paged KV cache, and the per-step metadata it reads.

* Dense attention (layers ``< num_dense_layers``) uses the same paged cache and the same ``mm3`` attention
  kernels as the sparse layers, with a block list naming every block (``arange(max_blocks)``): the kernels
  clip each query to its ``p // PAGE_SIZE + 1`` visible blocks, so that is exact causal attention, and FP8 KV
  works for dense layers too.
* The index-K cache (one shared head, ``[num_blocks, 1, PAGE_SIZE, Didx]``; model dtype or the authority's
  e4m3) is written with ``mm3::kv_cache_write`` like the main cache: the two halves of a row are the op's key
  and value, and padding tokens (slot < 0) are skipped by the op.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from mm3_compile import platform
from mm3_compile.models import tp as tpmod
from mm3_compile.models.config import MiniMaxM3Config
from mm3_compile.models.mxfp8 import MXFP8Weight
from mm3_compile.models.primitives import GemmaRMSNorm, norm_rope
from mm3_compile.models.tp import HeadShard, TPInfo
from mm3_compile.ops import decode_workspace, values_checked


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
        # the decode merge's arrival counters (zero between calls): a compiled step then zeroes none of its own.
        # One decode call per layer at a time: decode steps of this module overlapped on two streams would share it.
        self.register_buffer("decode_workspace", decode_workspace(device), persistent=False)

    def index_k_scale(self, fp8_dtype: torch.dtype | None = None) -> torch.Tensor:
        """fp32 [1]: the scalar FP8 scale of this layer's index-K, ``sqrt(Didx) * max|1 + w| / FP8_MAX``.

        Index-K is Gemma-RMS-normed (``|x_i| / rms(x) <= sqrt(Didx)``, times ``1 + w_i``) then rotated in
        pairs (which keeps each pair's norm), so ``|k_i| <= sqrt(Didx) * max|1 + w|``: no key saturates, and
        e4m3's relative precision is the same across its normal range.
        """
        dtype = fp8_dtype if fp8_dtype is not None else platform.platform_for(self.qkv.values.device).kv_e4m3_dtype
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
                index_q,
                index_cache.squeeze(1),
                meta.block_table,
                meta.cu_seqlens_q,
                meta.seq_lens,
                cfg.sparse_topk_blocks,
                cfg.sparse_init_blocks,
                cfg.sparse_local_blocks,
                "fp8" if fp8_index else "auto",
            )  # [Hkv, T, topk] int32
        else:
            # every block: the kernels clip query p to its p // 128 + 1 visible blocks -> exact causal attention
            max_blocks = meta.block_table.shape[1]
            blocks = torch.arange(max_blocks, dtype=torch.int32, device=x.device)
            # a broadcast add, not expand().contiguous(): the contiguity check would guard on T != 1
            topk_idx = torch.zeros((hkv, T, 1), dtype=torch.int32, device=x.device) + blocks  # [Hkv, T, max_blocks]

        if decode:
            out = torch.ops.mm3.sparse_attn_decode_with_workspace(
                q,
                kv_cache,
                topk_idx,
                meta.block_table,
                meta.seq_lens,
                self.decode_workspace,
                cfg.sm_scale,
                meta.kv_cache_dtype,
            )
        else:
            out = torch.ops.mm3.sparse_attn_prefill(
                q,
                kv_cache,
                topk_idx,
                meta.block_table,
                meta.cu_seqlens_q,
                meta.seq_lens,
                cfg.sm_scale,
                meta.kv_cache_dtype,
            )
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
