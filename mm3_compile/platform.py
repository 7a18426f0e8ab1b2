"""The FP8 dtype authority: the only place that decides which FP8 encodings a device uses.

Every kernel, launcher, fake and reference asks this module; nothing else names an FP8
dtype or an FP8 maximum.  The answer is computed when asked (under ``torch.compile`` that is
trace time) from the device's properties:

* CUDA: OCP ``float8_e4m3fn`` / ``float8_e5m2``.
* ROCm gfx94x (MI300X/MI325X): FNUZ ``float8_e4m3fnuz`` / ``float8_e5m2fnuz``.
* ROCm gfx950 (MI350/MI355X) and gfx12: OCP.
* Other ROCm archs (e.g. gfx90a): no FP8; asking for an FP8 dtype raises.
* CPU: OCP.

The ROCm decision is made from ``gcnArchName``, never from the HIP version, because one HIP
build serves both FNUZ (gfx942) and OCP (gfx950) parts.

``emulate("gfx942")`` (or ``MM3_EMULATE=gfx942``) makes the authority answer for a named
target whatever the real device is, so every platform's numerics can be traced and tested on
a CPU.  Decisions are logged on the ``mm3_compile`` logger (``TORCH_LOGS=+mm3_compile``), each distinct
one once (:func:`forget_logged_decisions` starts over).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
from collections.abc import Iterator

import torch

log = logging.getLogger("mm3_compile")

try:  # make ``TORCH_LOGS=mm3_compile`` / ``torch._logging.set_logs(mm3_compile=...)`` work
    torch._logging._internal.register_log("mm3_compile", "mm3_compile")
except Exception:  # pragma: no cover - logging registry moved; plain logging still works
    log.debug("torch._logging registry unavailable; use logging.getLogger('mm3_compile')")

EMULATE_ENV = "MM3_EMULATE"

_logged_decisions: set[tuple] = set()
_logged_lock = threading.Lock()


def log_decision(level: int, msg: str, *args) -> None:
    """Log one decision once per process: ops ask the authority on every call (and again at trace time),
    and the log should say what was decided, not how often it was asked."""
    key = (level, msg, *map(str, args))
    with _logged_lock:
        if key in _logged_decisions:
            return
        _logged_decisions.add(key)
    log.log(level, msg, *args)


def forget_logged_decisions() -> None:
    """Log every decision again the next time it is made (e.g. before another compile)."""
    with _logged_lock:
        _logged_decisions.clear()


# The four FP8 storage dtypes torch knows; the only table of them in the package.
FP8_E4M3_OCP = torch.float8_e4m3fn
FP8_E4M3_FNUZ = torch.float8_e4m3fnuz
FP8_E5M2_OCP = torch.float8_e5m2
FP8_E5M2_FNUZ = torch.float8_e5m2fnuz
FP8_DTYPES = (FP8_E4M3_OCP, FP8_E4M3_FNUZ, FP8_E5M2_OCP, FP8_E5M2_FNUZ)
E8M0_DTYPE = torch.float8_e8m0fnu


@dataclasses.dataclass(frozen=True)
class FP8Format:
    """Encoding parameters of one FP8 dtype, as integer/float constants a kernel can bake in.

    ``finfo`` alone is not enough: torch reports ``finfo(float8_e5m2fnuz).eps == 0.125``
    although the format has 2 mantissa bits, so the table is explicit.
    """

    dtype: torch.dtype
    mantissa_bits: int
    exponent_bias: int
    max: float  # largest finite magnitude; casts saturate here
    fnuz: bool  # no infinities, no negative zero, NaN is the byte 0x80
    has_inf: bool  # OCP e5m2 keeps IEEE infinities

    @property
    def min_normal_exponent(self) -> int:
        return 1 - self.exponent_bias

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def nan_byte(self) -> int:
        """The NaN encoding (OCP formats also keep the sign bit of the NaN)."""
        return 0x80 if self.fnuz else 0x7F


_FORMATS = {
    FP8_E4M3_OCP: FP8Format(FP8_E4M3_OCP, 3, 7, torch.finfo(FP8_E4M3_OCP).max, False, False),
    FP8_E4M3_FNUZ: FP8Format(FP8_E4M3_FNUZ, 3, 8, torch.finfo(FP8_E4M3_FNUZ).max, True, False),
    FP8_E5M2_OCP: FP8Format(FP8_E5M2_OCP, 2, 15, torch.finfo(FP8_E5M2_OCP).max, False, True),
    FP8_E5M2_FNUZ: FP8Format(FP8_E5M2_FNUZ, 2, 16, torch.finfo(FP8_E5M2_FNUZ).max, True, False),
}


def fp8_format(dtype: torch.dtype) -> FP8Format:
    """Encoding parameters for one of the four FP8 dtypes."""
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise TypeError(f"expected one of the FP8 dtypes {[str(d) for d in FP8_DTYPES]}, got {dtype}") from None


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in _FORMATS


@dataclasses.dataclass(frozen=True)
class Platform:
    """What one device (real or emulated) answers to every FP8 question."""

    target: str  # "sm_90", "gfx942", "cpu", ...
    vendor: str  # "nvidia" | "amd" | "cpu"
    fp8_e4m3: torch.dtype | None  # None: the arch has no FP8
    fp8_e5m2: torch.dtype | None
    emulated: bool = False

    @property
    def supports_fp8(self) -> bool:
        return self.fp8_e4m3 is not None

    @property
    def fnuz(self) -> bool:
        return self.fp8_e4m3 == FP8_E4M3_FNUZ

    def _require_fp8(self, what: str) -> None:
        if not self.supports_fp8:
            raise RuntimeError(
                f"{what} asked for on {self.vendor} target {self.target!r}, which has no FP8 support; "
                "FP8 needs CUDA, ROCm gfx94x (FNUZ), gfx950 or gfx12 (OCP), or the CPU"
            )

    @property
    def kv_e4m3_dtype(self) -> torch.dtype:
        self._require_fp8("an e4m3 KV-cache dtype")
        return self.fp8_e4m3

    @property
    def kv_e5m2_dtype(self) -> torch.dtype:
        self._require_fp8("an e5m2 KV-cache dtype")
        return self.fp8_e5m2

    @property
    def mxfp8_value_dtype(self) -> torch.dtype:
        """MX element dtype: OCP e4m3fn, except FNUZ e4m3 on gfx94x (same values, E8M0 byte + 1)."""
        self._require_fp8("the MXFP8 value dtype")
        return self.fp8_e4m3

    @property
    def mxfp8_fp8_max(self) -> float:
        return fp8_format(self.mxfp8_value_dtype).max

    def describe(self) -> dict[str, str]:
        def name(d):
            return str(d).removeprefix("torch.") if d is not None else "unsupported"

        row = {"target": self.target, "vendor": self.vendor, "emulated": str(self.emulated)}
        row["kv fp8/fp8_e4m3"] = name(self.fp8_e4m3)
        row["kv fp8_e5m2"] = name(self.fp8_e5m2)
        row["mxfp8 values"] = name(self.fp8_e4m3)
        row["mxfp8 FP8_MAX"] = f"{fp8_format(self.fp8_e4m3).max:g}" if self.supports_fp8 else "unsupported"
        return row


def _ocp(target: str, vendor: str, emulated: bool = False) -> Platform:
    return Platform(target, vendor, FP8_E4M3_OCP, FP8_E5M2_OCP, emulated)


def _rocm(arch: str, emulated: bool = False) -> Platform:
    base = arch.split(":")[0]  # gcnArchName carries feature flags: "gfx942:sramecc+:xnack-"
    if base.startswith("gfx94"):
        return Platform(base, "amd", FP8_E4M3_FNUZ, FP8_E5M2_FNUZ, emulated)
    if base.startswith("gfx95") or base.startswith("gfx12"):
        return _ocp(base, "amd", emulated)
    return Platform(base, "amd", None, None, emulated)


EMULATION_TARGETS = ("sm_90", "sm_100", "gfx942", "gfx950", "cpu")


def _platform_for_target(target: str, emulated: bool) -> Platform:
    if re.fullmatch(r"sm_\d+a?", target):
        return _ocp(target, "nvidia", emulated)
    if re.fullmatch(r"gfx[0-9a-f]+(:.*)?", target):
        return _rocm(target, emulated)
    if target == "cpu":
        return _ocp("cpu", "cpu", emulated)
    raise ValueError(f"unknown platform target {target!r}; expected one of {EMULATION_TARGETS} (or any sm_XX / gfxNNN)")


_state = threading.local()


def _emulated_target() -> str | None:
    target = getattr(_state, "target", None)
    if target is not None:
        return target
    return os.environ.get(EMULATE_ENV) or None


@contextlib.contextmanager
def emulate(target: str) -> Iterator[Platform]:
    """Answer every FP8 question as ``target`` would, whatever the real device is."""
    platform = _platform_for_target(target, emulated=True)  # validates the name before changing state
    previous = getattr(_state, "target", None)
    _state.target = target
    log.info("emulating platform %s", target)
    try:
        yield platform
    finally:
        _state.target = previous


def _device_platform(device: torch.device) -> Platform:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        arch = getattr(props, "gcnArchName", "") or ""
        if arch.startswith("gfx"):
            return _rocm(arch)
        return _ocp(f"sm_{props.major}{props.minor}", "nvidia")
    if device.type in ("cpu", "meta"):
        return _ocp("cpu", "cpu")
    raise ValueError(f"device {device} is not supported by mm3_compile; expected a CUDA/ROCm GPU or the CPU")


def hardware_vendor(device: torch.device) -> str:
    """Who built the chip a kernel on ``device`` really runs on: "nvidia", "amd" or "cpu" (emulation
    changes FP8 answers, not this: memory ordering and Triton's pointer types follow the hardware)."""
    return _device_platform(torch.device(device)).vendor


def platform_for(device: torch.device | str | None = None) -> Platform:
    """The platform that decides FP8 dtypes for tensors on ``device`` (default: current GPU, else CPU)."""
    target = _emulated_target()
    if target is not None:
        try:
            platform = _platform_for_target(target, emulated=True)
        except ValueError as e:
            if getattr(_state, "target", None) is None:  # it came from the environment
                raise ValueError(f"{EMULATE_ENV}={target!r}: {e}") from None
            raise
    else:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        platform = _device_platform(torch.device(device))
    log_decision(logging.DEBUG, "platform for %s: %s", device, platform)
    return platform


def mxfp8_value_dtype(device: torch.device | str | None = None) -> torch.dtype:
    return platform_for(device).mxfp8_value_dtype


def mxfp8_fp8_max(device: torch.device | str | None = None) -> float:
    return platform_for(device).mxfp8_fp8_max


KV_CACHE_SPECS = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")


def resolve_kv_cache_dtype(spec: str, device: torch.device | str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a KV cache with ``spec`` stores (or is viewed) on ``device``."""
    if spec == "auto":
        dtype = model_dtype
    elif spec == "bfloat16":
        dtype = torch.bfloat16
    elif spec == "float16":
        dtype = torch.float16
    elif spec in ("fp8", "fp8_e4m3"):
        dtype = platform_for(device).kv_e4m3_dtype
    elif spec == "fp8_e5m2":
        dtype = platform_for(device).kv_e5m2_dtype
    else:
        raise ValueError(f"kv_cache_dtype: unknown spec {spec!r}; expected one of {', '.join(KV_CACHE_SPECS)}")
    log_decision(logging.INFO, "kv_cache_dtype %r on %s resolves to %s", spec, device, dtype)
    return dtype


def resolution_table() -> list[dict[str, str]]:
    """One row for this machine's device and one for each emulation target (for ``mm3-compile platform``)."""
    here = platform_for(None)  # an MM3_EMULATE naming no target raises here, rather than dropping the row
    rows = [here.describe() | {"target": f"this device ({here.target})"}]
    for target in EMULATION_TARGETS + ("gfx90a",):
        rows.append(_platform_for_target(target, emulated=True).describe())
    return rows


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_native_fp8(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a Triton kernel on ``device`` may load ``dtype`` typed and convert it in hardware.

    When not, kernels decode the raw bytes with integer arithmetic (exact for every format,
    any Triton version); that is the path for the interpreter and for emulated targets.
    """
    fmt = fp8_format(dtype)
    if interpreting() or _emulated_target() is not None or device.type != "cuda":
        return False
    arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "") or ""
    if arch.startswith("gfx94"):
        return True
    if arch.startswith("gfx"):
        return not fmt.fnuz
    major, minor = torch.cuda.get_device_capability(device)
    return not fmt.fnuz and (major, minor) >= (8, 9)


def triton_native_fp8_encode(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a Triton kernel on ``device`` may encode ``dtype`` with the hardware conversion.

    Only OCP formats on NVIDIA: ``cvt.rn.satfinite`` gives the same bytes as the integer encoder
    (round to nearest even, saturating, NaN kept) at a fraction of the instructions.  Elsewhere
    kernels build the byte with integer arithmetic.
    """
    if fp8_format(dtype).fnuz or not triton_native_fp8(dtype, device):
        return False
    return hardware_vendor(device) == "nvidia"
