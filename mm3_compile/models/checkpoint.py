"""Load MiniMax-M3 checkpoints in the Hugging Face release layout (safetensors) into :class:`MiniMaxM3ForCausalLM`.

The release (``MiniMaxAI/MiniMax-M3-MXFP8``, bf16 ``MiniMaxAI/MiniMax-M3``) names the text model's tensors
``language_model.model.*`` with the LM head at ``language_model.lm_head.weight`` (text-only checkpoints:
``model.*`` and ``lm_head.weight``); per layer::

    layers.{i}.input_layernorm / post_attention_layernorm                      -> input_norm / post_attn_norm
    layers.{i}.self_attn.{q,k,v}_proj (+ index_q_proj, index_k_proj: sparse)   -> attn.qkv (rows fused)
    layers.{i}.self_attn.o_proj                                                -> attn.o
    layers.{i}.self_attn.{q,k,index_q,index_k}_norm                            -> attn.*_norm
    layers.{i}.mlp.{gate,up,down}_proj (dense layers)                          -> mlp.gate_up (rows fused) / mlp.down
    layers.{i}.block_sparse_moe.gate / e_score_correction_bias (fp32)          -> mlp.gate_weight / correction_bias
    layers.{i}.block_sparse_moe.experts.{e}.w1 / w3 / w2 (gate / up / down)    -> mlp.experts.gate_up[e] / down[e]
    layers.{i}.block_sparse_moe.shared_experts.{gate,up,down}_proj             -> mlp.shared.gate_up / down

A linear stored MXFP8 has ``weight`` (OCP e4m3 ``[out, in]``) and ``weight_scale_inv`` (uint8
``[out, in/32]``: the E8M0 byte itself, the name notwithstanding); it is loaded as stored, never re-quantized.
On a platform whose MX element dtype is e4m3fnuz (gfx94x) the values are converted exactly
(:func:`ocp_mxfp8_to_platform`).  A linear without ``weight_scale_inv`` (the bf16 release, or a layer the
quantizer ignored) is quantized at load by ``mm3::mxfp8_quantize``, exactly as :func:`build_model` quantizes an
in-memory state.  MTP (``model.mtp.*``) and, in the VL form, everything outside ``language_model.`` (vision) are
skipped.  Under tensor parallelism each rank reads only its rows/columns (``safe_open(...).get_slice``), never a
full sharded tensor; tensors are read layer by layer, so host memory stays at about one layer's slices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import types

import torch
from safetensors import safe_open

from mm3_compile import platform
from mm3_compile.contract import E8M0_BIAS, MX_BLOCK_SIZE
from mm3_compile.models.config import MiniMaxM3Config
from mm3_compile.models.model import MiniMaxM3ForCausalLM
from mm3_compile.models.mxfp8 import MXFP8Weight
from mm3_compile.models.tp import TPInfo

log = logging.getLogger("mm3_compile")

INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = ".weight_scale_inv"
# E8M0: bytes 0..254 are 2^(byte - 127), 255 is NaN
E8M0_MAX_FINITE = 2 * E8M0_BIAS  # 254

_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E4M3": platform.FP8_E4M3_OCP,
    "F8_E5M2": platform.FP8_E5M2_OCP,
    "F8_E8M0": platform.E8M0_DTYPE,
}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: missing/unexpected tensors, or a wrong dtype or shape."""


@dataclasses.dataclass
class LoadReport:
    """What a load read: checkpoint tensor names loaded, skipped (MTP, vision, and with ``truncate_layers`` the
    layers past the model's ``num_hidden_layers``) and unexpected (only when ``strict=False``; otherwise they
    raise)."""

    loaded: list[str]
    skipped: list[str]
    unexpected: list[str]
    stored_mxfp8: int  # linears loaded as stored MXFP8
    quantized: int  # linears quantized at load (bf16 in the checkpoint)

    def summary(self) -> str:
        return (
            f"{len(self.loaded)} tensors loaded ({self.stored_mxfp8} MXFP8 linears as stored, {self.quantized} "
            f"quantized at load), {len(self.skipped)} skipped (MTP/vision/truncated layers), {len(self.unexpected)} unexpected"
        )


def _names(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def ocp_mxfp8_to_platform(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = "values"
) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP e4m3fn MXFP8 ``values [..., K]`` + E8M0 bytes ``scales [..., K/32]`` -> the same numbers with
    values in ``dtype`` (the platform's MX element dtype, from the authority).

    OCP to FNUZ e4m3 (exponent bias 7 -> 8): the same byte read as FNUZ is half the OCP value (normals and
    subnormals alike), so the bytes stay and each block's E8M0 byte goes up by one.  Bytes without an FNUZ
    meaning are mapped: -0 (0x80, FNUZ's NaN) -> +0, NaN (0x7F/0xFF) -> FNUZ NaN (0x80).  A block at the
    largest finite scale (254) cannot be bumped: its values are re-encoded at twice the code instead (exact up
    to the FNUZ maximum; a larger value there is refused: it would be beyond fp32 anyway).  A NaN scale (255)
    stays NaN.

    Args:
        values: ``[..., K]`` OCP e4m3, as the checkpoint stores them.
        scales: ``[..., K/32]`` uint8 E8M0 bytes.
        dtype: the target MX element dtype (``platform.mxfp8_value_dtype(device)``).
        name: the tensor's name for error messages.
    Returns:
        ``(values [..., K] dtype, scales [..., K/32] uint8)``.
    Examples:
        >>> with platform.emulate("gfx942"):
        ...     v, s = ocp_mxfp8_to_platform(values, scales, platform.mxfp8_value_dtype("cpu"))
    """
    ocp = platform.FP8_E4M3_OCP
    if values.dtype != ocp:
        raise CheckpointError(f"{name}: expected {ocp} MXFP8 values, got {values.dtype}")
    if scales.dtype not in (torch.uint8, platform.E8M0_DTYPE):
        raise CheckpointError(f"{name}: expected uint8 or {platform.E8M0_DTYPE} scales, got {scales.dtype}")
    k = values.shape[-1]
    expected = (*values.shape[:-1], k // MX_BLOCK_SIZE)
    if k % MX_BLOCK_SIZE or tuple(scales.shape) != expected:
        raise CheckpointError(
            f"{name}: expected scales of shape {list(expected)} (one per {MX_BLOCK_SIZE} values, K a multiple of "
            f"{MX_BLOCK_SIZE}), got {list(scales.shape)} for values {list(values.shape)}"
        )
    scales = scales.view(torch.uint8)
    if dtype == ocp:
        return values, scales
    src, dst = platform.fp8_format(ocp), platform.fp8_format(dtype)
    if not (dst.fnuz and dst.mantissa_bits == src.mantissa_bits and dst.exponent_bias == src.exponent_bias + 1):
        raise CheckpointError(f"{name}: no exact conversion of {ocp} MXFP8 values to {dtype}")
    b = values.view(torch.uint8)
    out = torch.where(b == 0x80, 0, b)  # OCP -0; FNUZ has one zero
    out = torch.where((b & 0x7F) == 0x7F, dst.nan_byte, out).to(torch.uint8)  # OCP NaN, both signs
    full = scales == E8M0_MAX_FINITE  # [..., K/32]
    new_scales = torch.where(scales < E8M0_MAX_FINITE, scales + 1, scales).to(torch.uint8)
    if bool(full.any()):
        # keep the scale, re-encode the OCP value itself (twice the plain byte's FNUZ reading)
        full_values = full.repeat_interleave(MX_BLOCK_SIZE, dim=-1)  # [..., K]
        exact = values.float()
        recoded = exact.to(dtype)
        bad = full_values & ~torch.isnan(exact) & (recoded.float() != exact)
        if bool(bad.any()):
            raise CheckpointError(
                f"{name}: {int(bad.sum())} values in blocks at the largest E8M0 scale exceed {dtype}'s max "
                f"{dst.max:g} and cannot be converted exactly"
            )
        out = torch.where(full_values, recoded.view(torch.uint8), out)
    return out.view(dtype), new_scales


class _Reader:
    """Lazy access to the tensors of a checkpoint directory (sharded with an index json, or one file)."""

    def __init__(self, path: str | os.PathLike, stack: contextlib.ExitStack):
        self.path, self._stack, self._handles, self._names = os.fspath(path), stack, {}, {}
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                try:
                    weight_map = json.load(f)
                except json.JSONDecodeError as e:
                    raise CheckpointError(f"{index}: not valid JSON ({e})") from None
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: expected a 'weight_map' dict")
            self.files = {name: os.path.join(self.path, file) for name, file in weight_map.items()}
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"path: no {INDEX_FILE} and no *.safetensors file in {self.path!r}")
            self.files = {}
            for file in files:
                for name in self._handle(os.path.join(self.path, file)).keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    self.files[name] = os.path.join(self.path, file)

    def _handle(self, file: str):
        if file not in self._handles:
            if not os.path.isfile(file):
                raise CheckpointError(f"{INDEX_FILE} names {os.path.basename(file)!r}, which is not in {self.path!r}")
            try:
                self._handles[file] = self._stack.enter_context(safe_open(file, framework="pt"))
            except Exception as e:  # noqa: BLE001 (safetensors raises its own error types for a damaged file)
                raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
        return self._handles[file]

    def slice(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"checkpoint {self.path!r}: missing tensor {name}")
        file = self.files[name]
        handle = self._handle(file)
        if file not in self._names:
            self._names[file] = set(handle.keys())
        if name not in self._names[file]:
            raise CheckpointError(
                f"{INDEX_FILE} maps {name} to {os.path.basename(self.files[name])!r}, which does not hold it"
            )
        return handle.get_slice(name)


class _Loader:
    def __init__(self, model: MiniMaxM3ForCausalLM, reader: _Reader, prefix: str, lm_head: str):
        self.model, self.reader, self.prefix, self.lm_head_name = model, reader, prefix, lm_head
        self.cfg, self.tp = model.config, model.tp
        self.value_dtype = platform.mxfp8_value_dtype(model.device)
        self.loaded: list[str] = []
        self.stored = self.quantized = 0

    def _meta(self, name: str):
        s = self.reader.slice(name)
        dtype = s.get_dtype()
        return s, _SAFETENSORS_DTYPES.get(dtype, dtype), list(s.get_shape())

    def _read(self, name: str, shape: list[int], dtypes, dim: int | None = None, start: int = 0, count: int = 0):
        """Rows (dim 0) or columns (dim 1) ``[start, start + count)`` of ``name`` (all of it: dim None)."""
        s, dtype, got = self._meta(name)
        if dtype not in dtypes:
            raise CheckpointError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {dtype}")
        if got != list(shape):
            raise CheckpointError(f"{name}: expected shape {list(shape)}, got {got}")
        self.loaded.append(name)
        if dim is None:
            return s[:]
        if dim == 0:
            return s[start : start + count]
        return s[:, start : start + count]

    def plain(self, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """Norms, embeddings, the router: in ``dtype`` (bf16 for an fp32 tensor: an exact upcast only)."""
        allowed = (dtype, torch.bfloat16) if dtype == torch.float32 else (dtype,)
        return self._read(self.prefix + name, shape, allowed).to(self.model.device, dtype)

    def linear(self, base: str, out: int, inp: int, dim: int | None = None, start: int = 0, count: int = 0):
        """(values, E8M0 bytes) of this rank's slice of linear ``base`` in the platform's MX element dtype."""
        name, scale_name = self.prefix + base + ".weight", self.prefix + base + SCALE_SUFFIX
        if inp % MX_BLOCK_SIZE or (dim == 1 and (start % MX_BLOCK_SIZE or count % MX_BLOCK_SIZE)):
            raise CheckpointError(f"{name}: input width {inp} (slice {start}+{count}) is not in whole MXFP8 blocks")
        device = self.model.device
        if scale_name in self.reader.files:
            values = self._read(name, [out, inp], (platform.FP8_E4M3_OCP,), dim, start, count)
            sdim_start, sdim_count = (start // MX_BLOCK_SIZE, count // MX_BLOCK_SIZE) if dim == 1 else (start, count)
            scale_dtypes = (torch.uint8, platform.E8M0_DTYPE)
            scales = self._read(scale_name, [out, inp // MX_BLOCK_SIZE], scale_dtypes, dim, sdim_start, sdim_count)
            self.stored += 1
            values, scales = ocp_mxfp8_to_platform(values.to(device), scales.to(device), self.value_dtype, name)
            return values, scales.view(torch.uint8)
        if self._meta(name)[1] == platform.FP8_E4M3_OCP:
            raise CheckpointError(f"{name}: an MXFP8 weight without its scales {scale_name}")
        w = self._read(name, [out, inp], (torch.bfloat16, torch.float16, torch.float32), dim, start, count)
        self.quantized += 1
        values, scales = torch.ops.mm3.mxfp8_quantize(w.to(device).contiguous())
        return values, scales.view(torch.uint8)

    def fused(self, target: MXFP8Weight, pieces, index: int | None = None, dim: int = 0) -> None:
        parts = [self.linear(*p) for p in pieces]
        target.load_stored(torch.cat([v for v, _ in parts], dim), torch.cat([s for _, s in parts], dim), index)

    def gate_up_down(self, gate_up: MXFP8Weight, down: MXFP8Weight, names, inter: int, index: int | None = None):
        """SwiGLU MLP: this rank's gate rows then up rows (split layout), its down columns."""
        H = self.cfg.hidden_size
        local = inter // self.tp.size
        start = self.tp.rank * local
        g, u, d = names
        self.fused(gate_up, [(g, inter, H, 0, start, local), (u, inter, H, 0, start, local)], index)
        self.fused(down, [(d, H, inter, 1, start, local)], index)

    @torch.no_grad()
    def layer(self, i: int) -> None:
        cfg, layer, p = self.cfg, self.model.layers[i], f"layers.{i}."
        H, D, Didx = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
        Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        dt = self.model.dtype
        layer.input_norm.weight.copy_(self.plain(p + "input_layernorm.weight", [H], dt))
        layer.post_attn_norm.weight.copy_(self.plain(p + "post_attention_layernorm.weight", [H], dt))
        attn, h, a = layer.attn, layer.attn.heads, p + "self_attn."
        pieces = [
            (a + "q_proj", Hq * D, H, 0, h.q_start * D, h.num_q_heads * D),
            (a + "k_proj", Hkv * D, H, 0, h.kv_start * D, h.num_kv_heads * D),
            (a + "v_proj", Hkv * D, H, 0, h.kv_start * D, h.num_kv_heads * D),
        ]
        if layer.sparse:  # index heads follow the KV heads; the one index-K head is replicated
            pieces += [(a + "index_q_proj", Hkv * Didx, H, 0, h.kv_start * Didx, h.num_kv_heads * Didx)]
            pieces += [(a + "index_k_proj", Didx, H)]
        self.fused(attn.qkv, pieces)
        self.fused(attn.o, [(a + "o_proj", H, Hq * D, 1, h.q_start * D, h.num_q_heads * D)])
        norms = [("q_norm", D), ("k_norm", D)] + (
            [("index_q_norm", Didx), ("index_k_norm", Didx)] if layer.sparse else []
        )
        for name, width in norms:
            getattr(attn, name).weight.copy_(self.plain(a + name + ".weight", [width], dt))
        if not layer.sparse:
            m = p + "mlp."
            names = (m + "gate_proj", m + "up_proj", m + "down_proj")
            self.gate_up_down(layer.mlp.gate_up, layer.mlp.down, names, cfg.dense_intermediate_size)
            return
        moe, m = layer.mlp, p + "block_sparse_moe."
        E = cfg.num_experts
        moe.gate_weight.copy_(self.plain(m + "gate.weight", [E, H], torch.float32))
        moe.correction_bias.copy_(self.plain(m + "e_score_correction_bias", [E], torch.float32))
        for e in range(E):
            x = f"{m}experts.{e}."
            names = (x + "w1", x + "w3", x + "w2")
            self.gate_up_down(moe.experts.gate_up, moe.experts.down, names, cfg.moe_intermediate_size, index=e)
        if moe.shared is not None:
            s = m + "shared_experts."
            names = (s + "gate_proj", s + "up_proj", s + "down_proj")
            self.gate_up_down(moe.shared.gate_up, moe.shared.down, names, cfg.shared_intermediate_size)

    @torch.no_grad()
    def outer(self) -> None:
        cfg, dt = self.cfg, self.model.dtype
        V, H = cfg.vocab_size, cfg.hidden_size
        self.model.embed.copy_(self.plain("embed_tokens.weight", [V, H], dt))
        self.model.final_norm.weight.copy_(self.plain("norm.weight", [H], dt))
        if cfg.tie_word_embeddings:
            self.model.lm_head.copy_(self.model.embed)
        else:
            self.model.lm_head.copy_(self._read(self.lm_head_name, [V, H], (dt,)).to(self.model.device))


def expected_names(
    config: MiniMaxM3Config, prefix: str = "language_model.model.", lm_head: str = "language_model.lm_head.weight"
):
    """Every tensor name the model needs from a release checkpoint (linears by their ``.weight``; their
    ``.weight_scale_inv`` is read when present)."""
    names = [prefix + "embed_tokens.weight", prefix + "norm.weight"]
    if not config.tie_word_embeddings:
        names.append(lm_head)
    for i in range(config.num_hidden_layers):
        p = f"{prefix}layers.{i}."
        sparse = config.is_sparse_layer(i)
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        attn = ["q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"]
        if sparse:
            attn += ["index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm"]
        names += [f"{p}self_attn.{n}.weight" for n in attn]
        if not sparse:
            names += [f"{p}mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
            continue
        m = p + "block_sparse_moe."
        names += [m + "gate.weight", m + "e_score_correction_bias"]
        names += [f"{m}experts.{e}.{w}.weight" for e in range(config.num_experts) for w in ("w1", "w3", "w2")]
        if config.num_shared_experts:
            names += [f"{m}shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    return names


def _layout(names) -> tuple[str, str]:
    """(prefix, LM-head name) of the VL form or the text-only form."""
    if any(n.startswith("language_model.") for n in names):
        return "language_model.model.", "language_model.lm_head.weight"
    return "model.", "lm_head.weight"


def _skipped(name: str, prefix: str) -> bool:
    """MTP modules and vision weights (outside ``language_model.`` in the VL form)."""
    if re.match(r"(language_model\.)?model\.mtp\.|mtp\.", name):
        return True
    return prefix.startswith("language_model.") and not name.startswith("language_model.")


def _layer_past(name: str, prefix: str, num_layers: int) -> int | None:
    """The decoder layer a tensor belongs to when it is past the model's ``num_layers``, else None."""
    m = re.match(re.escape(prefix) + r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m is not None and int(m.group(1)) >= num_layers else None


def _refuse_unexpected(path, unexpected: list[str], strict: bool) -> None:
    if unexpected and strict:
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r}: {len(unexpected)} unexpected tensors: {_names(unexpected)} "
            "(strict=False loads anyway)"
        )


def load_checkpoint(
    model_or_config: MiniMaxM3ForCausalLM | MiniMaxM3Config,
    path: str | os.PathLike,
    group=None,
    *,
    device=None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    truncate_layers: bool = False,
) -> MiniMaxM3ForCausalLM:
    """Load a release-layout checkpoint directory into a model (this rank's shard under TP).

    Args:
        model_or_config: a :class:`MiniMaxM3ForCausalLM` to fill, or a config to build one for (``device``,
            default CPU, ``dtype``, default bf16, and ``group`` then apply; with a model they must be its own).
        path: the checkpoint directory (``config.json``, ``*.safetensors``, ``model.safetensors.index.json``).
        group: the tensor-parallel process group (None: no parallelism); with a model, it must be the model's.
        strict: tensors the model does not use (other than MTP/vision) raise; False lists them in the report.
        truncate_layers: load the first ``num_hidden_layers`` decoder layers of a checkpoint that has more (the
            CLI's ``--layers``); otherwise layers past the config's are an error, never silently dropped.
    Returns:
        The model (eval mode), with the :class:`LoadReport` as ``model.checkpoint_report``.
    Raises:
        CheckpointError: missing tensors, unexpected ones (strict), a wrong dtype or shape, naming the tensors.
    Examples:
        >>> config = MiniMaxM3Config.from_pretrained(path)
        >>> model = load_checkpoint(config, path, device="cuda")
    """
    if isinstance(model_or_config, MiniMaxM3Config):
        model = MiniMaxM3ForCausalLM(
            model_or_config, TPInfo.from_group(group), dtype or torch.bfloat16, device if device is not None else "cpu"
        )
    else:
        model = model_or_config
        if group is not None and model.tp.group is not group:
            raise ValueError("group: the model was built for another tensor-parallel group")
        if device is not None:
            wanted, have = torch.device(device), model.device
            same_index = None in (wanted.index, have.index) or wanted.index == have.index
            if wanted.type != have.type or not same_index:
                raise ValueError(f"device: the model to fill is on {have}, got {device} (it is not moved)")
        if dtype is not None and dtype != model.dtype:
            raise ValueError(f"dtype: the model to fill holds {model.dtype}, got {dtype} (it is not converted)")
    cfg = model.config
    with contextlib.ExitStack() as stack:
        reader = _Reader(path, stack)
        prefix, lm_head = _layout(reader.files)
        expected = set(expected_names(cfg, prefix, lm_head))
        available = set(reader.files)
        missing = expected - available
        if missing:
            raise CheckpointError(f"checkpoint {os.fspath(path)!r}: missing {len(missing)} tensors: {_names(missing)}")
        past = {n: _layer_past(n, prefix, cfg.num_hidden_layers) for n in available - expected}
        past = {n: i for n, i in past.items() if i is not None}
        if past and not truncate_layers:
            layers = sorted(set(past.values()))
            raise CheckpointError(
                f"checkpoint {os.fspath(path)!r}: tensors of decoder layers {layers[0]}..{layers[-1]}, past the "
                f"config's num_hidden_layers={cfg.num_hidden_layers} (truncate_layers=True loads the first "
                f"{cfg.num_hidden_layers}), e.g. {_names(past, 3)}"
            )
        skipped = sorted(set(past) | {n for n in available - expected if _skipped(n, prefix)})
        scales = {n for n in available if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] + ".weight" in expected}
        unexpected = sorted(available - expected - scales - set(skipped))
        _refuse_unexpected(path, unexpected, strict)
        loader = _Loader(model, reader, prefix, lm_head)
        loader.outer()
        for i in range(cfg.num_hidden_layers):
            loader.layer(i)
        # a scale beside a weight the model reads unquantized (a norm, the embedding, the router) is not used
        unused = sorted(scales - set(loader.loaded))
        _refuse_unexpected(path, unused, strict)
        unexpected += unused
    model.checkpoint_report = LoadReport(loader.loaded, skipped, unexpected, loader.stored, loader.quantized)
    log.info("loaded %s: %s", os.fspath(path), model.checkpoint_report.summary())
    return model.eval()


def full_state_from_checkpoint(path: str | os.PathLike, config: MiniMaxM3Config, dtype=torch.bfloat16) -> dict:
    """The unsharded weights of a checkpoint under :func:`~mm3_compile.models.weights.random_full_state`'s names
    (what the reference model and ``build_model(state=...)`` take), MXFP8 linears dequantized exactly to
    ``dtype`` (an E4M3 value times a power of two is a bf16 number).  Holds the whole model: tiny models only."""
    H, D, Didx = config.hidden_size, config.head_dim, config.index_head_dim
    Hq, Hkv, E = config.num_attention_heads, config.num_key_value_heads, config.num_experts
    with contextlib.ExitStack() as stack:
        reader = _Reader(path, stack)
        prefix, lm_head = _layout(reader.files)

        # the loader reads through a model's device, dtype and TP place: a TP1 view on the CPU
        view = types.SimpleNamespace(device=torch.device("cpu"), config=config, tp=TPInfo(), dtype=dtype)
        loader = _Loader(view, reader, prefix, lm_head)
        loader.value_dtype = platform.FP8_E4M3_OCP  # stored bytes as they are, dequantized below

        def weight(base, out, inp):
            name, scale = prefix + base + ".weight", prefix + base + SCALE_SUFFIX
            if scale in reader.files:
                v = loader._read(name, [out, inp], (platform.FP8_E4M3_OCP,))
                s = loader._read(scale, [out, inp // MX_BLOCK_SIZE], (torch.uint8, platform.E8M0_DTYPE))
                factor = torch.exp2(s.view(torch.uint8).double() - E8M0_BIAS).repeat_interleave(MX_BLOCK_SIZE, dim=-1)
                return (v.double() * factor).to(dtype)
            return loader._read(name, [out, inp], (torch.bfloat16, torch.float16, torch.float32)).to(dtype)

        V = config.vocab_size
        state = {"embed.weight": loader.plain("embed_tokens.weight", [V, H], dtype)}
        state["final_norm.weight"] = loader.plain("norm.weight", [H], dtype)
        tied = config.tie_word_embeddings
        state["lm_head.weight"] = state["embed.weight"] if tied else loader._read(lm_head, [V, H], (dtype,))
        for i in range(config.num_hidden_layers):
            p, q = f"layers.{i}.", f"layers.{i}.self_attn."
            sparse = config.is_sparse_layer(i)
            state[p + "input_norm.weight"] = loader.plain(p + "input_layernorm.weight", [H], dtype)
            state[p + "post_attn_norm.weight"] = loader.plain(p + "post_attention_layernorm.weight", [H], dtype)
            rows = [weight(q + "q_proj", Hq * D, H), weight(q + "k_proj", Hkv * D, H), weight(q + "v_proj", Hkv * D, H)]
            if sparse:
                rows += [weight(q + "index_q_proj", Hkv * Didx, H), weight(q + "index_k_proj", Didx, H)]
            state[p + "attn.qkv_proj.weight"] = torch.cat(rows)
            state[p + "attn.o_proj.weight"] = weight(q + "o_proj", H, Hq * D)
            norms = [("q_norm", D), ("k_norm", D)] + (
                [("index_q_norm", Didx), ("index_k_norm", Didx)] if sparse else []
            )
            for name, width in norms:
                state[p + f"attn.{name}.weight"] = loader.plain(q + name + ".weight", [width], dtype)

            def mlp(ours, g, u, d, inter):
                state[ours + "gate_up.weight"] = torch.cat([weight(g, inter, H), weight(u, inter, H)])
                state[ours + "down.weight"] = weight(d, H, inter)

            if not sparse:
                m = p + "mlp."
                mlp(m, m + "gate_proj", m + "up_proj", m + "down_proj", config.dense_intermediate_size)
                continue
            m = p + "block_sparse_moe."
            state[p + "moe.gate.weight"] = loader.plain(m + "gate.weight", [E, H], torch.float32)
            state[p + "moe.e_score_correction_bias"] = loader.plain(m + "e_score_correction_bias", [E], torch.float32)
            I = config.moe_intermediate_size
            experts = [
                (
                    weight(f"{m}experts.{e}.w1", I, H),
                    weight(f"{m}experts.{e}.w3", I, H),
                    weight(f"{m}experts.{e}.w2", H, I),
                )
                for e in range(E)
            ]
            state[p + "moe.experts.gate_up.weight"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
            state[p + "moe.experts.down.weight"] = torch.stack([d for _, _, d in experts])
            if config.num_shared_experts:
                s = m + "shared_experts."
                mlp(p + "moe.shared.", s + "gate_proj", s + "up_proj", s + "down_proj", config.shared_intermediate_size)
    return state
