"""Properties of mm3::kv_cache_write against kernels/kv_cache/naive.py: the whole cache, byte for byte.

Every spec and FP8 flavour under emulated sm_90 / gfx942 / gfx950, typed and uint8 caches, HND and
NHD (a permuted view), all three scale modes with scales 2^-30..2^30, K/V with NaN, +-Inf, zeros,
subnormals and magnitudes 2^-30..2^30, padding slots (-1), slots past the cache (skipped with
``MM3_VALIDATE=0``) and the last slot of the cache.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mm3_compile import platform
from mm3_compile.contract import PAGE_SIZE
from mm3_compile.kernels.kv_cache.naive import kv_cache_write_ref
from tests.properties.strategies import (
    DEVICE,
    FLOAT_DTYPES,
    SCALE,
    adversarial,
    device_mark,
    examples,
    on_device,
    targets,
)

pytestmark = device_mark()

FP8_SPECS = ("fp8", "fp8_e4m3", "fp8_e5m2")


@pytest.fixture(autouse=True)
def unchecked_values(monkeypatch):
    """Slots past the cache on purpose: with value checks off (the GPU default) the kernel must skip them."""
    monkeypatch.setenv("MM3_VALIDATE", "0")


@st.composite
def write_problems(draw):
    """(key, value, cache, slot_mapping, spec, k_scale, v_scale) for the current (emulated) platform."""
    spec = draw(st.sampled_from(("auto", "bfloat16", "float16", *FP8_SPECS)))
    if spec in FP8_SPECS:
        key_dtype = draw(st.sampled_from(FLOAT_DTYPES))
    else:
        key_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(spec) or draw(
            st.sampled_from((torch.bfloat16, torch.float16))
        )
    num_blocks, heads = draw(st.integers(1, 3 * SCALE)), draw(st.integers(1, 4))
    D = draw(st.sampled_from((16, 64, 128)))
    num_slots = num_blocks * PAGE_SIZE
    num_tokens = draw(st.integers(1, min(40 * SCALE, num_slots)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    if draw(st.booleans()):
        slots[0] = num_slots - 1 if (slots != num_slots - 1).all() else slots[0]  # the very last slot
    kinds = torch.randint(0, 8, (num_tokens,), generator=g)
    slots = torch.where(kinds == 0, -1, slots)  # padding
    slots = torch.where(kinds == 1, num_slots + torch.randint(0, 1000, (num_tokens,), generator=g), slots)
    key = draw(adversarial((num_tokens, heads, D), key_dtype))
    value = draw(adversarial((num_tokens, heads, D), key_dtype))
    storage = platform.resolve_kv_cache_dtype(spec, DEVICE, key_dtype)
    fp8 = platform.is_fp8(storage)
    typed = fp8 and draw(st.booleans())
    layout = draw(st.sampled_from(("HND", "NHD")))
    physical = (num_blocks, heads, PAGE_SIZE, 2 * D) if layout == "HND" else (num_blocks, PAGE_SIZE, heads, 2 * D)
    raw = torch.randint(0, 256, (*physical[:-1], 2 * D * storage.itemsize), generator=g, dtype=torch.uint8)
    raw = raw.view(storage) if (typed or not fp8) else raw
    cache = raw if layout == "HND" else raw.permute(0, 2, 1, 3)
    # scales only with FP8 caches (a half cache refuses them)
    mode = draw(st.sampled_from(("none", "scalar", "per_token_head"))) if fp8 else "none"
    k_scale = v_scale = None
    if mode != "none":
        shape = (1,) if mode == "scalar" else (heads, num_slots)
        lo = draw(st.integers(-30, 30))
        k_scale = torch.exp2(torch.randint(lo, min(lo + 8, 30) + 1, shape, generator=g).float()) * (
            1 + torch.rand(shape, generator=g)
        )
        v_scale = k_scale.flip(-1) * 0.75
    return key, value, cache, slots.to(torch.int64), spec, k_scale, v_scale


def fmt_for(cache, spec, key_dtype):
    storage = platform.resolve_kv_cache_dtype(spec, DEVICE, key_dtype)
    return platform.fp8_format(storage) if platform.is_fp8(storage) else None


@settings(max_examples=examples(16))
@given(target=targets(), data=st.data())
def test_kv_cache_write_matches_reference(target, data):
    with platform.emulate(target):
        key, value, cache, slots, spec, k_scale, v_scale = data.draw(write_problems())
        fmt = fmt_for(cache, spec, key.dtype)
        expected = kv_cache_write_ref(key, value, cache, slots, fmt, k_scale, v_scale)
        key, value, cache, slots, k_scale, v_scale = on_device(key, value, cache, slots, k_scale, v_scale)
        storage_before = cache.untyped_storage().data_ptr()
        assert torch.ops.mm3.kv_cache_write(key, value, cache, slots, spec, k_scale, v_scale) is None
    assert cache.untyped_storage().data_ptr() == storage_before
    a, e = cache.view(torch.uint8).cpu(), expected.view(torch.uint8)
    bad = (a != e).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[:4].tolist()}"


@settings(max_examples=examples(2))
@given(target=targets(), data=st.data())
def test_compiled_matches_eager(target, data):
    def write(key, value, cache, slots, k_scale, v_scale):
        torch.ops.mm3.kv_cache_write(key, value, cache, slots, spec, k_scale, v_scale)

    with platform.emulate(target):
        key, value, cache, slots, spec, k_scale, v_scale = data.draw(write_problems())
        key, value, cache, slots, k_scale, v_scale = on_device(key, value, cache, slots, k_scale, v_scale)
        eager = cache.clone()
        write(key, value, eager, slots, k_scale, v_scale)
        torch._dynamo.reset()
        torch.compile(write, backend="aot_eager", fullgraph=True)(key, value, cache, slots, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), eager.view(torch.uint8))
