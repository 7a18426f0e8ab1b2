"""Release checkpoints: HF config forms, names -> fused/stacked layout, MXFP8 as stored, TP slices, FNUZ conversion.

A tiny synthetic checkpoint with the release's names and layout (tests/models/release_checkpoint.py) is loaded and
compared bit for bit with the same weights loaded through the in-memory path (``build_model(state=...)``).
"""

import dataclasses
import json
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mm3_compile import platform
from mm3_compile.contract import E8M0_BIAS, MX_BLOCK_SIZE
from mm3_compile.models import MiniMaxM3Config, build_model, checkpoint, random_full_state
from mm3_compile.models.checkpoint import CheckpointError, full_state_from_checkpoint, load_checkpoint
from mm3_compile.models.mxfp8 import mxfp8_dequantize
from mm3_compile.models.reference import mx_quant_dequant
from tests.models.release_checkpoint import hf_config, write_checkpoint

CONFIG = MiniMaxM3Config.tiny()


@pytest.fixture(scope="module")
def state():
    return random_full_state(CONFIG, seed=0)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.uint8)


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and sa[name].shape == sb[name].shape, name
        assert torch.equal(_bytes(sa[name]), _bytes(sb[name])), name


# ---- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("vl", [True, False])
@pytest.mark.parametrize("config", [CONFIG, MiniMaxM3Config.m3()], ids=["tiny", "m3"])
def test_hf_config_round_trips(config, vl, tmp_path):
    assert MiniMaxM3Config.from_hf_config(hf_config(config, vl)) == config
    (tmp_path / "config.json").write_text(json.dumps(hf_config(config, vl)))
    assert MiniMaxM3Config.from_pretrained(tmp_path) == config


def test_hf_config_takes_rotary_dim_and_defaults_beta():
    hf = hf_config(CONFIG, vl=False)
    del hf["partial_rotary_factor"]
    hf["rotary_dim"] = 16
    cfg = MiniMaxM3Config.from_hf_config(hf)
    assert cfg.rotary_dim == 16 and cfg.swiglu_beta == 1.0  # swiglu_beta is absent from the release


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(hidden_act="silu"), r"hidden_act 'silu' is not supported; expected 'swigluoai'"),
        (lambda c: c.update(scoring_func="softmax"), r"scoring_func 'softmax' is not supported"),
        (lambda c: c.update(use_gemma_norm=False), r"use_gemma_norm False is not supported"),
        (lambda c: c["sparse_attention_config"].update(sparse_score_type="mean"), r"sparse_score_type 'mean'"),
        (
            lambda c: c["sparse_attention_config"].pop("sparse_local_block"),
            r"missing key 'sparse_attention_config\.sparse_local_block'",
        ),
        (
            lambda c: c.update(moe_layer_freq=[1, 0]),
            r"moe_layer_freq and sparse_attention_config\.sparse_attention_freq",
        ),
        (lambda c: c.update(moe_layer_freq=[0, 1, 1]), r"moe_layer_freq: expected 2 entries"),
        (lambda c: c.pop("num_local_experts"), r"missing key 'num_local_experts'"),
        (lambda c: c.update(quantization_config={"quant_method": "fp8"}), r"quant_method 'fp8' is not supported"),
        (lambda c: c.update(model_type="llama"), r"model_type 'llama' is not supported"),
        (lambda c: c.update(head_dim=96), r"head_dim must be 64 or 128"),
        # JSON types are checked, never coerced (bool("false") is True)
        (lambda c: c.update(tie_word_embeddings="false"), r"tie_word_embeddings: expected bool, got 'false'"),
        (lambda c: c.update(n_shared_experts=True), r"n_shared_experts: expected int, got True"),
        (lambda c: c.update(hidden_size="128"), r"hidden_size: expected int, got '128'"),
        (lambda c: c.update(num_hidden_layers=2.0), r"num_hidden_layers: expected int, got 2\.0"),
        (lambda c: c.update(quantization_config="mxfp8"), r"quantization_config: expected dict, got 'mxfp8'"),
        (lambda c: c.update(sparse_attention_config=[]), r"sparse_attention_config: expected dict, got \[\]"),
        (
            lambda c: c["sparse_attention_config"].update(sparse_topk_blocks=4.5),
            r"sparse_attention_config\.sparse_topk_blocks: expected int, got 4\.5",
        ),
        (lambda c: c.update(rotary_dim=16), r"rotary_dim 16 and partial_rotary_factor .* disagree"),
    ],
)
def test_hf_config_names_unsupported_values(edit, message):
    hf = hf_config(CONFIG, vl=False)
    edit(hf)
    with pytest.raises(ValueError, match=message):
        MiniMaxM3Config.from_hf_config(hf)


# ---- loading -----------------------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("vl, mxfp8", [(True, True), (False, False)], ids=["vl-mxfp8", "text-bf16"])
def test_checkpoint_loads_bit_for_bit_like_the_in_memory_path(state, vl, mxfp8, tmp_path):
    write_checkpoint(tmp_path, state, CONFIG, vl=vl, mxfp8=mxfp8)
    config = MiniMaxM3Config.from_pretrained(tmp_path)
    assert config == CONFIG
    loaded = load_checkpoint(config, tmp_path)
    assert_same_weights(loaded, build_model(CONFIG, state=state))
    report = loaded.checkpoint_report
    linears = (4 + 3) + (
        6 + 3 * CONFIG.num_experts + 3
    )  # dense layer: q/k/v/o, MLP; sparse: + index q/k, experts, shared
    assert (report.stored_mxfp8, report.quantized) == ((linears, 0) if mxfp8 else (0, linears))
    assert report.skipped == (
        ["model.mtp.0.enorm.weight", "vision_tower.patch_embed.proj.weight"] if vl else ["model.mtp.0.enorm.weight"]
    )
    assert not report.unexpected
    # what the reference reads from the checkpoint: the MXFP8 values exactly (bf16 as stored)
    full = full_state_from_checkpoint(tmp_path, config)
    assert full.keys() == state.keys()
    for name, w in state.items():
        want = (
            mx_quant_dequant(w.float(), torch.device("cpu"))
            if mxfp8
            and name.endswith("weight")
            and w.dim() > 1
            and "embed" not in name
            and "lm_head" not in name
            and ".gate." not in name
            else w
        )
        assert torch.equal(full[name].float(), want.float()), name


@pytest.mark.interpreter
def test_mixed_checkpoint_quantizes_only_the_bf16_linears(state, tmp_path):
    """A linear without weight_scale_inv (a layer the quantizer ignored) is quantized at load."""
    tensors = write_checkpoint(tmp_path / "mx", state, CONFIG)
    name = "language_model.model.layers.1.self_attn.index_q_proj"
    bf16 = state["layers.1.attn.qkv_proj.weight"].split([256, 128, 128, 128, 64])[3]
    extra = {name + ".weight": bf16.contiguous()}
    write_checkpoint(tmp_path / "mixed", state, CONFIG, extra=extra, drop=[name + ".weight_scale_inv"])
    assert name + ".weight" in tensors
    loaded = load_checkpoint(CONFIG, tmp_path / "mixed")
    assert loaded.checkpoint_report.quantized == 1
    assert_same_weights(loaded, build_model(CONFIG, state=state))


@pytest.mark.interpreter
def test_mxfp8_bytes_are_loaded_as_stored_not_requantized(state, tmp_path):
    """Bytes no quantizer would produce (random codes, scales off the block maxima) come through unchanged:
    dequantizing and re-quantizing would renormalise them."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (128, 128), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x01  # no NaNs
    scales = torch.randint(100, 130, (128, 4), generator=gen, dtype=torch.uint8)
    name = "language_model.model.layers.0.mlp.down_proj"
    extra = {name + ".weight": codes.view(platform.FP8_E4M3_OCP), name + ".weight_scale_inv": scales}
    write_checkpoint(tmp_path, state, CONFIG, extra=extra)
    down = load_checkpoint(CONFIG, tmp_path).layers[0].mlp.down
    assert torch.equal(down.values.view(torch.uint8), codes) and torch.equal(down.scales, scales)
    requantized = torch.ops.mm3.mxfp8_quantize(down.dequantize(torch.float32))[1].view(torch.uint8)
    assert not torch.equal(requantized, scales)  # the control: a round trip would have changed them


@pytest.mark.interpreter
def test_tied_embeddings_need_no_lm_head(state, tmp_path):
    config = MiniMaxM3Config.tiny(tie_word_embeddings=True)
    write_checkpoint(tmp_path, state, config, vl=False, drop=["lm_head.weight"])
    assert MiniMaxM3Config.from_pretrained(tmp_path) == config
    loaded = load_checkpoint(config, tmp_path)
    assert torch.equal(loaded.lm_head, loaded.embed) and torch.equal(loaded.embed, state["embed.weight"])
    assert_same_weights(loaded, build_model(config, state=state | {"lm_head.weight": state["embed.weight"]}))


def test_missing_unexpected_and_mistyped_tensors_are_named(state, tmp_path):
    gate = "language_model.model.layers.1.block_sparse_moe.experts.3.w1"
    write_checkpoint(tmp_path / "missing", state, CONFIG, drop=[gate + ".weight", "language_model.model.norm.weight"])
    with pytest.raises(
        CheckpointError, match=rf"missing 2 tensors: {gate}\.weight, language_model\.model\.norm\.weight"
    ):
        load_checkpoint(CONFIG, tmp_path / "missing")
    stray = {"language_model.model.layers.0.self_attn.q_proj.input_scale": torch.ones(1)}
    write_checkpoint(tmp_path / "extra", state, CONFIG, extra=stray)
    with pytest.raises(
        CheckpointError, match=r"1 unexpected tensors: language_model\.model\.layers\.0\.self_attn\.q_proj\.input_scale"
    ):
        load_checkpoint(CONFIG, tmp_path / "extra")
    scale = "language_model.model.layers.0.self_attn.o_proj.weight_scale_inv"
    write_checkpoint(tmp_path / "dtype", state, CONFIG, extra={scale: torch.zeros(128, 8, dtype=torch.int32)})
    with pytest.raises(
        CheckpointError, match=rf"{scale}: expected dtype torch\.uint8 or torch\.float8_e8m0fnu, got torch\.int32"
    ):
        load_checkpoint(CONFIG, tmp_path / "dtype")
    write_checkpoint(tmp_path / "noscale", state, CONFIG, drop=[scale])
    with pytest.raises(CheckpointError, match=rf"o_proj\.weight: an MXFP8 weight without its scales {scale}"):
        load_checkpoint(CONFIG, tmp_path / "noscale")
    k = "language_model.model.layers.0.self_attn.k_proj.weight"
    write_checkpoint(tmp_path / "shape", state, CONFIG, extra={k: torch.zeros(64, 128, dtype=platform.FP8_E4M3_OCP)})
    with pytest.raises(CheckpointError, match=rf"{k}: expected shape \[128, 128\], got \[64, 128\]"):
        load_checkpoint(CONFIG, tmp_path / "shape")


def test_damaged_files_are_named(state, tmp_path):
    """A truncated shard, an index that is not JSON and an index that maps a tensor to the wrong shard each
    raise a CheckpointError naming the file; a tensor missing from a direct read is named too."""
    write_checkpoint(tmp_path / "ok", state, CONFIG)
    shards = sorted(f for f in os.listdir(tmp_path / "ok") if f.endswith(".safetensors"))
    index = tmp_path / "ok" / checkpoint.INDEX_FILE
    for case in ("truncated", "json", "wrong_shard"):
        d = tmp_path / case
        d.mkdir()
        for f in os.listdir(tmp_path / "ok"):
            (d / f).write_bytes((tmp_path / "ok" / f).read_bytes())
    (tmp_path / "truncated" / shards[0]).write_bytes((tmp_path / "ok" / shards[0]).read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{shards[0]}: not a readable safetensors file"):
        load_checkpoint(CONFIG, tmp_path / "truncated")
    (tmp_path / "json" / checkpoint.INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"{checkpoint.INDEX_FILE}: not valid JSON"):
        load_checkpoint(CONFIG, tmp_path / "json")
    assert len(shards) == 3  # the writer's default: move one tensor's entry to another shard
    weight_map = json.loads(index.read_text())["weight_map"]
    name = next(n for n, f in weight_map.items() if f == shards[0] and "norm" in n)
    weight_map[name] = shards[1]
    (tmp_path / "wrong_shard" / checkpoint.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"maps {re.escape(name)} to '{shards[1]}', which does not hold"):
        load_checkpoint(CONFIG, tmp_path / "wrong_shard")
    write_checkpoint(tmp_path / "nonorm", state, CONFIG, drop=["language_model.model.norm.weight"])
    with pytest.raises(CheckpointError, match=r"missing tensor language_model\.model\.norm\.weight"):
        full_state_from_checkpoint(tmp_path / "nonorm", CONFIG)


def test_layers_past_the_config_raise_unless_truncated(state, tmp_path):
    """A checkpoint with more decoder layers than its config is an error (it was loaded short and the layers
    reported as MTP/vision); ``truncate_layers`` (the CLI's ``--layers``) loads the first ones."""
    write_checkpoint(tmp_path, state, CONFIG)
    fewer = dataclasses.replace(CONFIG, num_hidden_layers=CONFIG.num_hidden_layers - 1)
    last = CONFIG.num_hidden_layers - 1
    with pytest.raises(CheckpointError, match=rf"decoder layers {last}\.\.{last}, past the config's num_hidden_layers"):
        load_checkpoint(fewer, tmp_path)
    report = load_checkpoint(fewer, tmp_path, truncate_layers=True).checkpoint_report
    in_last = f"model.layers.{last}."
    assert any(in_last in n for n in report.skipped) and not any(in_last in n for n in report.loaded)
    assert not report.unexpected


def test_a_model_to_fill_keeps_its_device_and_dtype(state, tmp_path):
    """With a model, ``device`` and ``dtype`` must be the model's own: they were silently ignored."""
    write_checkpoint(tmp_path, state, CONFIG)
    model = build_model(CONFIG, state=state)
    with pytest.raises(ValueError, match="device: the model to fill is on cpu, got meta"):
        load_checkpoint(model, tmp_path, device="meta")
    with pytest.raises(ValueError, match="dtype: the model to fill holds torch.bfloat16, got torch.float16"):
        load_checkpoint(model, tmp_path, dtype=torch.float16)
    assert load_checkpoint(model, tmp_path, device="cpu", dtype=torch.bfloat16) is model


def test_scales_beside_unquantized_weights_are_unexpected(state, tmp_path):
    """A ``weight_scale_inv`` beside a weight the model reads unquantized (a norm) is not used: unexpected."""
    stray = {"language_model.model.layers.0.input_layernorm.weight_scale_inv": torch.zeros(1, dtype=torch.uint8)}
    write_checkpoint(tmp_path, state, CONFIG, extra=stray)
    with pytest.raises(CheckpointError, match=r"1 unexpected tensors: .*input_layernorm\.weight_scale_inv"):
        load_checkpoint(CONFIG, tmp_path)
    assert load_checkpoint(CONFIG, tmp_path, strict=False).checkpoint_report.unexpected == list(stray)


@pytest.mark.interpreter
def test_unexpected_tensors_listed_when_not_strict(state, tmp_path):
    stray = {"language_model.model.layers.0.self_attn.q_proj.input_scale": torch.ones(1)}
    write_checkpoint(tmp_path, state, CONFIG, extra=stray)
    model = load_checkpoint(CONFIG, tmp_path, strict=False)
    assert model.checkpoint_report.unexpected == list(stray)


# ---- FNUZ platforms ----------------------------------------------------------------------------


def _ocp_dequant(values, scales) -> torch.Tensor:
    """OCP MXFP8 -> fp32, computed independently of the model code (float64 then one rounding)."""
    factor = torch.exp2(scales.view(torch.uint8).double() - E8M0_BIAS).repeat_interleave(MX_BLOCK_SIZE, dim=-1)
    return (values.double() * factor).float()


def _same_numbers(a, b) -> bool:
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def test_ocp_to_fnuz_conversion_is_exact_for_every_byte_and_scale():
    """Every e4m3fn byte at E8M0 scales 0 (underflow edge), 1, 120, 127, 253, 255 (NaN) and, for the values
    FNUZ can hold at twice the code, 254; dequantized under emulated gfx942 equal to the OCP numbers."""
    ocp_bytes = torch.arange(256, dtype=torch.uint8).view(1, 256)
    scale_bytes = [0, 1, 120, 127, 253, 255]
    values = ocp_bytes.expand(len(scale_bytes), 256).contiguous().view(platform.FP8_E4M3_OCP)
    scales = torch.tensor(scale_bytes, dtype=torch.uint8)[:, None].expand(-1, 256 // MX_BLOCK_SIZE).contiguous()
    small = values.float().abs() <= 240  # FNUZ's max: what a block at scale 254 can hold exactly
    top = torch.where(small[0], values[0].view(torch.uint8), 0).view(1, 256).view(platform.FP8_E4M3_OCP)
    values = torch.cat([values, top])
    scales = torch.cat([scales, torch.full((1, 256 // MX_BLOCK_SIZE), 254, dtype=torch.uint8)])
    want = _ocp_dequant(values, scales)
    with platform.emulate("gfx942"):
        dtype = platform.mxfp8_value_dtype("cpu")
        assert dtype == platform.FP8_E4M3_FNUZ
        got_values, got_scales = checkpoint.ocp_mxfp8_to_platform(values, scales, dtype)
        assert got_values.dtype == dtype
        finite_scale = scales != 255  # E8M0 NaN: the dequantizers disagree on 0 x 2^128 (a NaN block either way)
        rows = finite_scale.all(-1)
        got = mxfp8_dequantize(got_values, got_scales, torch.float32)
        assert _same_numbers(got[rows], want[rows])
        nan_row = scale_bytes.index(255)  # its bytes are mapped like any other block's, its scale stays NaN
        assert not rows[nan_row] and torch.equal(got_values[nan_row].view(torch.uint8), got_values[0].view(torch.uint8))
        assert (got_scales.int() - scales.int()).tolist() == [[1] * 8] * 5 + [[0] * 8] * 2  # 255 and 254 stay
        # negative control: the OCP bytes read as FNUZ without the conversion are other numbers
        raw = mxfp8_dequantize(values.view(torch.uint8).view(dtype), scales, torch.float32)
        assert not _same_numbers(raw, want)
        finite = torch.isfinite(want) & (want != 0)
        assert (raw[finite] / want[finite] == 0.5).float().mean() > 0.9  # the read-as-FNUZ error is a factor 2
        big = torch.tensor([[448.0] * 32]).to(platform.FP8_E4M3_OCP)
        with pytest.raises(CheckpointError, match="w: 32 values in blocks at the largest E8M0 scale exceed"):
            checkpoint.ocp_mxfp8_to_platform(big, torch.tensor([[254]], dtype=torch.uint8), dtype, "w")
        # scales of another dtype or shape are refused, never reinterpreted (int32 [1, 1] read as 4 bytes)
        with pytest.raises(CheckpointError, match="w: expected uint8 or torch.float8_e8m0fnu scales, got torch.int32"):
            checkpoint.ocp_mxfp8_to_platform(big, torch.tensor([[127]], dtype=torch.int32), dtype, "w")
        with pytest.raises(CheckpointError, match=r"w: expected scales of shape \[1, 1\]"):
            checkpoint.ocp_mxfp8_to_platform(big, torch.tensor([[127, 127]], dtype=torch.uint8), dtype, "w")


@pytest.mark.interpreter
def test_checkpoint_under_emulated_gfx942_dequantizes_to_the_ocp_values(state, tmp_path):
    """The loader converts the release's OCP bytes on a FNUZ platform: every MXFP8 weight holds FNUZ values
    whose numbers are the checkpoint's; the same bytes viewed as FNUZ (the seed bug) would not be."""
    write_checkpoint(tmp_path, state, CONFIG)
    ocp = load_checkpoint(CONFIG, tmp_path)
    with platform.emulate("gfx942"):
        fnuz = load_checkpoint(CONFIG, tmp_path)
        weights = [n.removesuffix(".values") for n, _ in fnuz.named_buffers() if n.endswith(".values")]
        assert len(weights) == 2 * 2 + 2 * 2 + 1 * 2  # qkv, o per layer; dense MLP, experts, shared expert
        for name in weights:
            a, b = fnuz.get_submodule(name), ocp.get_submodule(name)
            assert a.values.dtype == platform.FP8_E4M3_FNUZ and b.values.dtype == platform.FP8_E4M3_OCP
            want = _ocp_dequant(b.values, b.scales)
            assert _same_numbers(a.dequantize(torch.float32), want), name
            unconverted = mxfp8_dequantize(b.values.view(torch.uint8).view(a.values.dtype), b.scales, torch.float32)
            assert not _same_numbers(unconverted, want), name


# ---- tensor parallelism ------------------------------------------------------------------------


class _RecordingSlice:
    def __init__(self, inner, name, log):
        self.inner, self.name, self.log = inner, name, log

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, key):
        out = self.inner[key]
        self.log.append((self.name, list(self.inner.get_shape()), list(out.shape), str(key)))
        return out


class _RecordingHandle:
    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name):
        return _RecordingSlice(self.inner.get_slice(name), name, self.log)

    def get_tensor(self, name):
        raise AssertionError(f"read whole tensor {name}: the loader must go through get_slice")


def _tp_rank(rank, world, init_file, directory, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        reads = []
        real_open = checkpoint.safe_open
        checkpoint.safe_open = lambda *a, **k: _RecordingHandle(real_open(*a, **k), reads)
        loaded = load_checkpoint(CONFIG, directory, group=dist.group.WORLD)
        in_memory = build_model(CONFIG, state=random_full_state(CONFIG, seed=0), group=dist.group.WORLD)
        assert_same_weights(loaded, in_memory)
        torch.save(reads, out_file.format(rank))
    finally:
        dist.destroy_process_group()


@pytest.mark.interpreter
def test_tp2_each_rank_reads_only_its_shard(state):
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(os.path.join(tmp, "ckpt"), state, CONFIG)
        out = os.path.join(tmp, "reads{}.pt")
        mp.spawn(_tp_rank, args=(2, os.path.join(tmp, "init"), os.path.join(tmp, "ckpt"), out), nprocs=2, join=True)
        reads = [torch.load(out.format(r)) for r in range(2)]
    replicated = (
        "norm",
        "embed_tokens",
        "lm_head",
        "block_sparse_moe.gate.",
        "e_score_correction_bias",
        "index_k_proj",
    )
    for rank, log in enumerate(reads):
        by_name = {name: (full, got, key) for name, full, got, key in log}
        assert len(by_name) == len(log)  # every tensor read once
        for name, (full, got, key) in by_name.items():
            if any(r in name for r in replicated):
                assert got == full, name
                continue
            # sharded: half of one dim, this rank's half
            dim = 1 if any(s in name for s in ("o_proj", "down_proj", ".w2")) else 0
            half = full[dim] // 2
            assert got[dim] == half and got[1 - dim] == full[1 - dim], (name, full, got)
            assert f"slice({rank * half}, {(rank + 1) * half}, None)" in key, (name, key)
