"""Hypothesis strategies shared by the property tests: adversarial float tensors, platforms, cache layouts.

Values are built as ``mantissa * 2^exponent`` with exponents spanning 2^-30..2^30, sprinkled with
zeros, NaN, +-Inf and subnormals of the tensor's dtype, then cast (the cast itself is exact or
rounds the way torch does; the references see the same tensor the kernel sees).
"""

import os

import torch
from hypothesis import strategies as st

from mm3_compile import platform

TARGETS = ("sm_90", "gfx942", "gfx950")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_EXP, MAX_EXP = -30, 30


def examples(ci: int) -> int:
    """``ci`` examples under the ci profile, 25x as many under ``long`` (per-test budgets differ by cost)."""
    return ci if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else 25 * ci


def subnormals(dtype: torch.dtype) -> tuple[float, float]:
    """The smallest and the largest subnormal magnitude of ``dtype``."""
    info = torch.finfo(dtype)
    mantissa_bits = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[dtype]
    smallest = info.smallest_normal * 2.0**-mantissa_bits
    return smallest, info.smallest_normal - smallest


@st.composite
def adversarial(draw, shape, dtype, *, specials=True, min_exp=MIN_EXP, max_exp=MAX_EXP, subnormal=True):
    """A tensor of ``shape``: random normals times per-row-chunk powers of two, with specials planted.

    ``specials``: plant zeros, NaN and +-Inf; ``subnormal``: plant subnormals of ``dtype``.
    """
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for n in shape:
        numel *= n
    lo = draw(st.integers(min_exp, max_exp))
    hi = draw(st.integers(lo, max_exp))
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(lo, hi + 1, (numel,), generator=g).double())
    kinds = []
    if specials:
        kinds += [0.0, float("nan"), float("inf"), -float("inf"), -0.0]
    if subnormal and dtype != torch.float32:
        smallest, largest = subnormals(dtype)
        kinds += [smallest, -largest, 3 * smallest]
    elif subnormal:
        kinds += [1e-40, -1e-44]
    if kinds and numel:
        count = draw(st.integers(0, max(1, numel // 8)))
        where = torch.randint(0, numel, (count,), generator=g)
        picks = torch.tensor(kinds, dtype=torch.float64)[torch.randint(0, len(kinds), (count,), generator=g)]
        x[where] = picks
        if draw(st.booleans()):  # a whole run of one special (all-zero / all-NaN / all-subnormal blocks)
            start = draw(st.integers(0, max(0, numel - 32)))
            x[start : start + 32] = kinds[draw(st.integers(0, len(kinds) - 1))]
    return x.reshape(shape).to(dtype)


def targets():
    return st.sampled_from(TARGETS)


def fp8_format(target: str, spec: str, model_dtype: torch.dtype):
    """The authority's FP8 format for ``spec`` under ``target`` (call inside ``platform.emulate``)."""
    return platform.fp8_format(platform.resolve_kv_cache_dtype(spec, "cpu", model_dtype))


# Where the ops run: the interpreter on CPU tensors (CI), or CUDA (``bash scripts/gpu_check.sh props``) with
# shapes MM3_PROPS_SCALE times larger.  References always run on the CPU copies.
DEVICE = torch.device(os.environ.get("MM3_PROPS_DEVICE", "cpu"))
SCALE = int(os.environ.get("MM3_PROPS_SCALE", "1"))


def device_mark():
    """The property modules' pytestmark: interpreter tests on CPU, GPU tests with MM3_PROPS_DEVICE=cuda."""
    import pytest

    return pytest.mark.gpu if DEVICE.type == "cuda" else pytest.mark.interpreter


def on_device(*tensors):
    """The tensors (None passes) on DEVICE, strides kept (``.to`` preserves a permuted dense layout)."""
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)
