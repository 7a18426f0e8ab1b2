"""MiniMax-M3 text-backbone configuration and the presets the tests and the demo use."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from mm3_compile.contract import MX_BLOCK_SIZE, PAGE_SIZE


@dataclasses.dataclass(frozen=True)
class MiniMaxM3Config:
    """Model facts the layers need; defaults are the real MiniMax-M3 values (the release's config.json)."""

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

    sparse_block_size: int = PAGE_SIZE  # == KV page size; the ops require it
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

    tie_word_embeddings: bool = False  # True: the LM head is the embedding table (no lm_head tensor)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.num_index_heads != self.num_key_value_heads:
            raise ValueError("num_index_heads must equal num_key_value_heads (one index head per KV head)")
        if self.sparse_block_size != PAGE_SIZE:
            raise ValueError(f"sparse_block_size must be {PAGE_SIZE} (one sparse block is one KV page)")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim or self.rotary_dim > self.index_head_dim:
            raise ValueError("rotary_dim must be even and at most head_dim and index_head_dim")
        for name in ("moe_intermediate_size", "shared_intermediate_size", "dense_intermediate_size", "hidden_size"):
            if getattr(self, name) % MX_BLOCK_SIZE:
                raise ValueError(
                    f"{name} must be a multiple of {MX_BLOCK_SIZE} (MXFP8 blocks), got {getattr(self, name)}"
                )
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
        values = {
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "num_dense_layers": 1,
            "vocab_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "rotary_dim": 32,
            "num_index_heads": 2,
            "index_head_dim": 64,
            "sparse_topk_blocks": 2,
            "num_experts": 8,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 64,
            "shared_intermediate_size": 64,
            "dense_intermediate_size": 128,
        }
        values.update(overrides)
        return cls(**values)

    @classmethod
    def m3_1layer(cls, **overrides) -> MiniMaxM3Config:
        """One sparse + MoE layer at the real widths (GPU only).

        The vocabulary is cut to 4096: embedding and LM head are plain GEMMs outside the kernels under test,
        and the real 200064-row tables would only add 2.4 GB of random weights.
        """
        values = {"num_hidden_layers": 1, "num_dense_layers": 0, "vocab_size": 4096}
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> MiniMaxM3Config:
        """The config of a checkpoint directory (its ``config.json``, VL or text-only form).

        Args:
            path: a checkpoint directory holding ``config.json``, or the path of the json file itself.

        Returns:
            The text model's :class:`MiniMaxM3Config` (see :meth:`from_hf_config` for what is refused).

        Examples:
            >>> config = MiniMaxM3Config.from_pretrained("/models/MiniMax-M3-MXFP8")  # doctest: +SKIP
            >>> config.num_hidden_layers, config.num_experts  # doctest: +SKIP
        """
        file = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"path: expected a checkpoint directory with config.json, got {os.fspath(path)!r}")
        with open(file) as f:
            return cls.from_hf_config(json.load(f))

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> MiniMaxM3Config:
        """Translate a Hugging Face MiniMax-M3 config dict: the VL form (``model_type: minimax_m3_vl``, text
        model under ``text_config``) or the text-only one (``minimax_m3_text``).

        Keys whose values the layers do not implement are refused by name (``ValueError: config: hidden_act
        'silu' is not supported; expected 'swigluoai'``); keys the text model does not use are ignored.

        Examples::

            config = MiniMaxM3Config.from_pretrained("/models/MiniMax-M3-MXFP8")
        """
        model_type = hf.get("model_type")
        if model_type == "minimax_m3_vl":
            if not isinstance(hf.get("text_config"), dict):
                raise ValueError("config: a minimax_m3_vl config needs a text_config dict")
            quant = hf.get("quantization_config", hf["text_config"].get("quantization_config"))
            hf = hf["text_config"]
            if hf.get("model_type", "minimax_m3_text") != "minimax_m3_text":
                raise ValueError(f"config: text_config.model_type {hf['model_type']!r}; expected 'minimax_m3_text'")
        elif model_type == "minimax_m3_text":
            quant = hf.get("quantization_config")
        else:
            raise ValueError(
                f"config: model_type {model_type!r} is not supported; expected 'minimax_m3_vl' or 'minimax_m3_text'"
            )

        def need(key, kind=int, where=hf, prefix=""):
            if key not in where:
                raise ValueError(f"config: missing key {prefix + key!r}")
            return _typed(prefix + key, where[key], kind)

        def get(key, default, kind):
            return _typed(key, hf[key], kind) if key in hf else default

        def expect(key, allowed, default=None):
            value = hf.get(key, default)
            if value not in allowed:
                raise ValueError(
                    f"config: {key} {value!r} is not supported; expected {' or '.join(map(repr, allowed))}"
                )

        expect("hidden_act", ("swigluoai",))
        expect("use_gemma_norm", (True,))
        expect("scoring_func", ("sigmoid",))
        expect("use_routing_bias", (True,))
        _check_quantization(quant)
        layers = need("num_hidden_layers")
        head_dim = need("head_dim")
        from_factor = None
        if "partial_rotary_factor" in hf:
            from_factor = head_dim * need("partial_rotary_factor", float)
            if from_factor != int(from_factor):
                raise ValueError(
                    f"config: partial_rotary_factor {hf['partial_rotary_factor']} x head_dim {head_dim} is not an integer"
                )
            from_factor = int(from_factor)
        if "rotary_dim" in hf:
            rotary_dim = need("rotary_dim")
            if from_factor is not None and from_factor != rotary_dim:
                raise ValueError(
                    f"config: rotary_dim {rotary_dim} and partial_rotary_factor {hf['partial_rotary_factor']} x "
                    f"head_dim {head_dim} = {from_factor} disagree"
                )
        elif from_factor is not None:
            rotary_dim = from_factor
        else:
            raise ValueError("config: missing key 'rotary_dim' (or 'partial_rotary_factor')")
        sparse = need("sparse_attention_config", dict)
        for key, allowed in (("sparse_score_type", ("max",)), ("sparse_disable_index_value", (True,))):
            if sparse.get(key) not in allowed:
                raise ValueError(
                    f"config: sparse_attention_config.{key} {sparse.get(key)!r} is not supported; expected {allowed[0]!r}"
                )

        def need_sparse(key):  # no defaults: vLLM's would differ from the release's (sparse_local_block 0 vs 1)
            return need(key, int, sparse, "sparse_attention_config.")

        moe = _layer_pattern(hf.get("moe_layer_freq"), layers, "moe_layer_freq")
        attn = _layer_pattern(
            sparse.get("sparse_attention_freq"), layers, "sparse_attention_config.sparse_attention_freq"
        )
        if moe != attn:
            raise ValueError(
                "config: moe_layer_freq and sparse_attention_config.sparse_attention_freq must mark the same layers "
                "(the layers pair sparse attention with MoE and dense attention with the dense MLP)"
            )
        dense = moe.index(True) if True in moe else layers
        if any(not m for m in moe[dense:]):
            raise ValueError(
                "config: moe_layer_freq: expected dense layers first then only MoE layers, got " + str(moe)
            )
        shared = get("n_shared_experts", 0, int)
        return cls(
            hidden_size=need("hidden_size"),
            num_hidden_layers=layers,
            num_dense_layers=dense,
            vocab_size=need("vocab_size"),
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=need("num_key_value_heads"),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=need("rope_theta", float),
            rms_norm_eps=need("rms_norm_eps", float),
            sparse_block_size=need_sparse("sparse_block_size"),
            sparse_topk_blocks=need_sparse("sparse_topk_blocks"),
            sparse_init_blocks=need_sparse("sparse_init_block"),
            sparse_local_blocks=need_sparse("sparse_local_block"),
            num_index_heads=need_sparse("sparse_num_index_heads"),
            index_head_dim=need_sparse("sparse_index_dim"),
            num_experts=need("num_local_experts"),
            num_experts_per_tok=need("num_experts_per_tok"),
            routed_scaling_factor=get("routed_scaling_factor", 1.0, float),
            num_shared_experts=shared,
            moe_intermediate_size=need("intermediate_size"),
            shared_intermediate_size=get("shared_intermediate_size", need("intermediate_size"), int),
            dense_intermediate_size=get("dense_intermediate_size", need("intermediate_size"), int),
            swiglu_alpha=need("swiglu_alpha", float),
            swiglu_beta=get("swiglu_beta", 1.0, float),
            swiglu_limit=need("swiglu_limit", float),
            tie_word_embeddings=get("tie_word_embeddings", False, bool),
        )

    @classmethod
    def preset(cls, name: str) -> MiniMaxM3Config:
        presets = {"tiny": cls.tiny, "m3-1layer": cls.m3_1layer, "m3_1layer": cls.m3_1layer, "m3": cls.m3}
        if name not in presets:
            raise ValueError(f"unknown config preset {name!r}; expected one of tiny, m3-1layer, m3")
        return presets[name]()


def _layer_pattern(value, layers: int, key: str) -> list[bool]:
    """Per layer True/False from a 0/1 list (one entry per layer) or an int (``1``: every layer)."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"config: {key}: expected a list of 0/1 per layer or an int, got {value!r}")
    if isinstance(value, int):
        if value != 1:
            raise ValueError(f"config: {key} {value} is not supported; expected 1 (every layer) or a 0/1 list")
        return [True] * layers
    if not isinstance(value, list) or len(value) != layers or any(v not in (0, 1) for v in value):
        raise ValueError(f"config: {key}: expected {layers} entries of 0/1 (num_hidden_layers), got {value!r}")
    return [bool(v) for v in value]


def _typed(key: str, value, kind: type):
    """A config value of the JSON type ``kind`` (int: not a bool or a float; float: any number but a bool),
    refused by name otherwise, never coerced (``bool("false")`` is True)."""
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        bool: isinstance(value, bool),
        dict: isinstance(value, dict),
    }[kind]
    if not ok:
        raise ValueError(f"config: {key}: expected {kind.__name__}, got {value!r} ({type(value).__name__})")
    return float(value) if kind is float else value


def _check_quantization(quant) -> None:
    """Only MXFP8 with 1x32 blocks (or none: bf16 weights, quantized at load) is read by the loader."""
    if quant is None:
        return
    _typed("quantization_config", quant, dict)
    if quant.get("quant_method") != "mxfp8":
        raise ValueError(
            f"config: quantization_config.quant_method {quant.get('quant_method')!r} is not supported; expected 'mxfp8'"
        )
    if list(quant.get("weight_block_size", [1, MX_BLOCK_SIZE])) != [1, MX_BLOCK_SIZE]:
        raise ValueError(
            f"config: quantization_config.weight_block_size {quant['weight_block_size']} is not supported; expected [1, {MX_BLOCK_SIZE}]"
        )
