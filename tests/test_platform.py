"""The FP8 dtype authority: resolution tables for every target and spec, emulation, logging."""

import logging
import types

import pytest
import torch

from mm3_compile import platform
from tests.python_process import run_python

OCP = (platform.FP8_E4M3_OCP, platform.FP8_E5M2_OCP)
FNUZ = (platform.FP8_E4M3_FNUZ, platform.FP8_E5M2_FNUZ)

EXPECTED = {  # target -> (e4m3, e5m2, mxfp8 values, FP8_MAX)
    "sm_90": (*OCP, platform.FP8_E4M3_OCP, 448.0),
    "sm_100": (*OCP, platform.FP8_E4M3_OCP, 448.0),
    "gfx942": (*FNUZ, platform.FP8_E4M3_FNUZ, 240.0),
    "gfx950": (*OCP, platform.FP8_E4M3_OCP, 448.0),
    "cpu": (*OCP, platform.FP8_E4M3_OCP, 448.0),
}


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_emulated_targets(target):
    e4m3, e5m2, values, fp8_max = EXPECTED[target]
    with platform.emulate(target) as p:
        assert p.emulated and platform.platform_for("cpu") == p
        assert (p.kv_e4m3_dtype, p.kv_e5m2_dtype) == (e4m3, e5m2)
        assert platform.mxfp8_value_dtype("cpu") == values
        assert platform.mxfp8_fp8_max("cpu") == fp8_max == torch.finfo(values).max


@pytest.mark.parametrize("target", sorted(EXPECTED))
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_resolve_kv_cache_dtype_table(target, model_dtype):
    e4m3, e5m2, _, _ = EXPECTED[target]
    with platform.emulate(target):
        resolve = lambda spec: platform.resolve_kv_cache_dtype(spec, "cpu", model_dtype)  # noqa: E731
        assert resolve("auto") == model_dtype
        assert resolve("bfloat16") == torch.bfloat16
        assert resolve("float16") == torch.float16
        assert resolve("fp8") == resolve("fp8_e4m3") == e4m3
        assert resolve("fp8_e5m2") == e5m2


def test_unknown_spec_lists_valid_ones():
    with pytest.raises(
        ValueError, match="kv_cache_dtype.*'fp8_e4m3fn'.*auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2"
    ):
        platform.resolve_kv_cache_dtype("fp8_e4m3fn", "cpu", torch.bfloat16)


def test_arch_without_fp8_raises_only_when_fp8_is_asked_for():
    with platform.emulate("gfx90a") as p:
        assert not p.supports_fp8
        assert platform.resolve_kv_cache_dtype("auto", "cpu", torch.bfloat16) == torch.bfloat16
        for spec in ("fp8", "fp8_e5m2"):
            with pytest.raises(RuntimeError, match="gfx90a.*no FP8 support"):
                platform.resolve_kv_cache_dtype(spec, "cpu", torch.bfloat16)
        with pytest.raises(RuntimeError, match="no FP8"):
            platform.mxfp8_value_dtype("cpu")


def test_emulation_restores_state_on_exit_and_on_error():
    before = platform.platform_for("cpu")
    assert not before.emulated
    with platform.emulate("gfx942"):
        with platform.emulate("sm_90"):
            assert platform.platform_for("cpu").target == "sm_90"
        assert platform.platform_for("cpu").target == "gfx942"
    assert platform.platform_for("cpu") == before
    with pytest.raises(KeyboardInterrupt), platform.emulate("gfx942"):
        raise KeyboardInterrupt
    assert platform.platform_for("cpu") == before


def test_unknown_emulation_target_rejected_without_changing_state():
    with pytest.raises(ValueError, match="unknown platform target 'mi300'"):
        with platform.emulate("mi300"):
            pass
    assert not platform.platform_for("cpu").emulated


@pytest.mark.parametrize("target", ["sm_banana", "sm_", "gfxzz", "", "mi300"])
def test_emulation_target_names_are_checked(target, monkeypatch):
    """Target names are sm_<digits>, gfx<hex> or cpu; an environment variable naming none is refused
    (naming the variable), not read as some NVIDIA or AMD target nor dropped."""
    with pytest.raises(ValueError, match="unknown platform target"):
        with platform.emulate(target):
            pass
    if target:
        monkeypatch.setenv(platform.EMULATE_ENV, target)
        with pytest.raises(ValueError, match=f"{platform.EMULATE_ENV}='{target}': unknown platform target"):
            platform.resolution_table()


def test_env_var_emulation(monkeypatch):
    monkeypatch.setenv(platform.EMULATE_ENV, "gfx942")
    assert platform.platform_for("cpu").fp8_e4m3 == platform.FP8_E4M3_FNUZ
    with platform.emulate("gfx950"):  # the context manager wins over the environment
        assert platform.platform_for("cpu").fp8_e4m3 == platform.FP8_E4M3_OCP


@pytest.mark.parametrize(
    "arch, expected",
    [
        ("gfx942:sramecc+:xnack-", FNUZ),
        ("gfx941", FNUZ),
        ("gfx950:sramecc+:xnack-", OCP),
        ("gfx1201", OCP),
        ("gfx90a:sramecc+:xnack-", (None, None)),
    ],
)
def test_rocm_decided_by_gcn_arch_name_not_hip_version(monkeypatch, arch, expected):
    props = types.SimpleNamespace(gcnArchName=arch, major=9, minor=4)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    # A HIP version says nothing about the FP8 flavour: gfx942 and gfx950 share ROCm releases.
    monkeypatch.setattr(torch.version, "hip", "7.0.0", raising=False)
    p = platform.platform_for(torch.device("cuda", 0))
    assert (p.fp8_e4m3, p.fp8_e5m2) == expected and p.vendor == "amd"


def test_cuda_is_ocp(monkeypatch):
    props = types.SimpleNamespace(gcnArchName="", major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)  # ignored for NVIDIA devices too
    p = platform.platform_for(torch.device("cuda", 0))
    assert (p.target, p.vendor, p.fp8_e4m3, p.fp8_e5m2) == ("sm_90", "nvidia", *OCP)


def test_fp8_formats_match_torch():
    for dtype in platform.FP8_DTYPES:
        fmt = platform.fp8_format(dtype)
        assert fmt.max == torch.finfo(dtype).max
        assert 2.0**fmt.min_normal_exponent == torch.finfo(dtype).smallest_normal
        # the largest code below max differs from it by one mantissa step
        grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        finite = grid[torch.isfinite(grid)].unique()
        assert finite.max() == fmt.max
        assert finite[finite > 0].min() == 2.0 ** (fmt.min_normal_exponent - fmt.mantissa_bits)
        nan_code = torch.tensor([fmt.nan_byte], dtype=torch.uint8).view(dtype).float()
        assert torch.isnan(nan_code).all()
    with pytest.raises(TypeError, match="FP8 dtypes"):
        platform.fp8_format(torch.bfloat16)


def test_decisions_are_logged_once_each(caplog):
    platform.forget_logged_decisions()
    with caplog.at_level(logging.INFO, logger="mm3_compile"), platform.emulate("gfx942"):
        for _ in range(3):  # ops ask on every call: the decision is logged once
            platform.resolve_kv_cache_dtype("fp8", "cpu", torch.bfloat16)
        platform.resolve_kv_cache_dtype("fp8_e5m2", "cpu", torch.bfloat16)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("'fp8' on cpu resolves to torch.float8_e4m3fnuz" in m for m in messages) == 1, messages
    assert sum("'fp8_e5m2' on cpu resolves to torch.float8_e5m2fnuz" in m for m in messages) == 1, messages
    assert any("emulating platform gfx942" in m for m in messages)
    platform.forget_logged_decisions()
    with caplog.at_level(logging.INFO, logger="mm3_compile"), platform.emulate("gfx942"):
        platform.resolve_kv_cache_dtype("fp8", "cpu", torch.bfloat16)
    assert sum("'fp8' on cpu resolves" in r.getMessage() for r in caplog.records) == 2


def test_torch_logs_shows_decisions():
    script = "import torch, mm3_compile; mm3_compile.platform.resolve_kv_cache_dtype('fp8', 'cpu', torch.bfloat16)"
    result = run_python(script, env_add={"TORCH_LOGS": "+mm3_compile"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kv_cache_dtype 'fp8' on cpu resolves to torch.float8_e4m3fn" in result.stderr


def test_resolution_table_has_every_target():
    rows = platform.resolution_table()
    targets = [row["target"] for row in rows]
    assert targets[0].startswith("this device")
    assert set(platform.EMULATION_TARGETS) <= set(targets)
    gfx942 = next(row for row in rows if row["target"] == "gfx942")
    assert gfx942["kv fp8/fp8_e4m3"] == "float8_e4m3fnuz" and gfx942["mxfp8 FP8_MAX"] == "240"


def test_hardware_vendor_ignores_emulation():
    """Memory-ordering and pointer-type choices follow the real chip, FP8 answers follow the emulation."""
    with platform.emulate("gfx942"):
        assert platform.platform_for("cpu").vendor == "amd"
        assert platform.hardware_vendor(torch.device("cpu")) == "cpu"
