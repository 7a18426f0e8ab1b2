"""MiniMax-M3 text-backbone configuration (spec §1) and the presets the tests and the demo use."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MiniMaxM3Config:
    """Model facts the layers need; defaults are the real MiniMax-M3 values (spec §1)."""

    hidden_size: int = 6144
    num_hidden_layers: int = 60
    num_dense_layers: int = 3  # layers [0, num_dense_layers) are dense attention + dense MLP
    vocab_size: int = 200064

    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    rotary_dim: int = 64  # partial NeoX RoPE on dims [0, rotary_dim)
    rope_theta: float = 5_000_000.0
    rms_norm_eps: float = 1e-6

    sparse_block_size: int = 128  # == KV page size; the ops require 128
    sparse_topk_blocks: int = 16
    sparse_init_blocks: int = 0
    sparse_local_blocks: int = 1
    num_index_heads: int = 4  # == num_key_value_heads (one index head per KV head), one shared index-K head
    index_head_dim: int = 128
    index_cache_dtype: str = "auto"  # "auto" = model dtype; "fp8" = the authority's e4m3 (see write_index_cache)

    num_experts: int = 128
    num_experts_per_tok: int = 4
    routed_scaling_factor: float = 2.0
    num_shared_experts: int = 1
    moe_intermediate_size: int = 3072
    shared_intermediate_size: int = 3072
    dense_intermediate_size: int = 12288

    swiglu_alpha: float = 1.702
    swiglu_beta: float = 1.0
    swiglu_limit: float = 7.0

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.num_index_heads != self.num_key_value_heads:
            raise ValueError("num_index_heads must equal num_key_value_heads (one index head per KV head)")
        if self.sparse_block_size != 128:
            raise ValueError("sparse_block_size must be 128 (one sparse block is one KV page)")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim or self.rotary_dim > self.index_head_dim:
            raise ValueError("rotary_dim must be even and at most head_dim and index_head_dim")
        for name in ("moe_intermediate_size", "shared_intermediate_size", "dense_intermediate_size", "hidden_size"):
            if getattr(self, name) % 32:
                raise ValueError(f"{name} must be a multiple of 32 (MXFP8 blocks), got {getattr(self, name)}")
        if self.head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128 (the attention kernels' tiles), got {self.head_dim}")
        if self.index_head_dim != self.head_dim:
            # the fused projection is viewed as heads of one width (M3: 128 and 128); a split of differently
            # wide parts would need views of non-contiguous slices, which guard on the token count
            raise ValueError(f"index_head_dim must equal head_dim ({self.head_dim}), got {self.index_head_dim}")
        if self.num_shared_experts not in (0, 1):
            raise ValueError("num_shared_experts must be 0 or 1")

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Sparse attention + MoE (True) or dense attention + dense MLP (False)."""
        return layer_idx >= self.num_dense_layers

    @classmethod
    def m3(cls) -> MiniMaxM3Config:
        """The full 60-layer model (never built whole here: it does not fit on one GPU)."""
        return cls()

    @classmethod
    def tiny(cls, **overrides) -> MiniMaxM3Config:
        """CPU-interpreter size with every structural feature of M3 kept.

        GQA group 2 with 2 KV heads (= 2 index heads, one shared index-K head), partial RoPE on half of
        the head dim, block size 128 with top-2 blocks (so prompts of >= 3 blocks, ~300+ tokens, really
        select), 8 experts top-4 with a shared expert, layer 0 dense and layer 1 sparse + MoE.
        """
        values = dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_dense_layers=1,
            vocab_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            rotary_dim=32,
            num_index_heads=2,
            index_head_dim=64,
            sparse_topk_blocks=2,
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=64,
            shared_intermediate_size=64,
            dense_intermediate_size=128,
        )
        values.update(overrides)
        return cls(**values)

    @classmethod
    def m3_1layer(cls, **overrides) -> MiniMaxM3Config:
        """One sparse + MoE layer at the real widths (GPU only).

        The vocabulary is cut to 4096: embedding and LM head are plain GEMMs outside the kernels under test,
        and the real 200064-row tables would only add 2.4 GB of random weights.
        """
        values = dict(num_hidden_layers=1, num_dense_layers=0, vocab_size=4096)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def preset(cls, name: str) -> MiniMaxM3Config:
        presets = {"tiny": cls.tiny, "m3-1layer": cls.m3_1layer, "m3_1layer": cls.m3_1layer, "m3": cls.m3}
        if name not in presets:
            raise ValueError(f"unknown config preset {name!r}; expected one of tiny, m3-1layer, m3")
        return presets[name]()
