"""mm3::kv_cache_write: byte-exact against the torch-cast reference, in place, for every layout and flavour.

FP8 flavours come from the dtype authority under emulated sm_90 (OCP), gfx942 (FNUZ) and gfx950
(OCP); the reference is ``x / scale -> clamp(+-max) -> torch cast`` and the whole cache is
compared, so untouched slots (padding, out-of-range) are checked too.
"""

import contextlib

import pytest
import torch

from mm3_compile import platform
from mm3_compile.kernels.kv_cache.naive import kv_cache_write_ref

TARGETS = ("sm_90", "gfx942", "gfx950")
SCALE_MODES = ("none", "scalar", "per_token_head")
LAYOUTS = ("HND", "NHD")


@pytest.fixture(autouse=True)
def kernel_skips_bad_slots(monkeypatch):
    """make_slots puts slots past the cache on purpose: with value checks off (the GPU default) the
    kernel must skip them; test_slot_past_the_cache_is_refused covers the checks themselves."""
    monkeypatch.setenv("MM3_VALIDATE", "0")


def make_cache(num_blocks, num_heads, head_dim, layout, dtype, device, seed=0):
    """Random contents; NHD is physical [nb, 128, Hkv, 2D] exposed as the logical [nb, Hkv, 128, 2D] view."""
    g = torch.Generator().manual_seed(seed)
    physical = (
        (num_blocks, num_heads, 128, 2 * head_dim) if layout == "HND" else (num_blocks, 128, num_heads, 2 * head_dim)
    )
    if dtype == torch.uint8 or platform.is_fp8(dtype):
        raw = torch.randint(0, 256, physical, generator=g, dtype=torch.uint8).view(dtype)
    else:
        raw = torch.randn(physical, generator=g).to(dtype)
    raw = raw.to(device)
    return raw if layout == "HND" else raw.permute(0, 2, 1, 3)


def wide_values(shape, dtype, device, seed):
    """Magnitudes from FP8-subnormal to beyond every FP8 max, plus NaN and +-inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-14, 18, shape, generator=g).float())
    flat = x.view(-1)
    flat[:3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    return x.to(dtype).to(device)


def make_slots(num_tokens, num_blocks, device, seed):
    """Distinct slots, a few padding (-1) and a few past the cache (must be skipped)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * 128, generator=g)[:num_tokens].to(torch.int64)
    slots[1::7] = -1
    slots[3::11] = num_blocks * 128 + torch.arange(slots[3::11].numel())
    return slots.to(device)


def make_scales(mode, num_heads, num_slots, device, seed):
    g = torch.Generator().manual_seed(seed)
    if mode == "none":
        return None, None
    if mode == "scalar":
        return torch.tensor([0.37]).to(device), torch.tensor([2.5]).to(device)
    k = torch.rand(num_heads, num_slots, generator=g) * 4 + 0.05
    v = torch.rand(num_heads, num_slots, generator=g) * 4 + 0.05
    return k.to(device), v.to(device)


def assert_same_bits(actual, expected):
    a, e = actual.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu()
    mismatch = (a != e).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} bytes differ, first at {mismatch[:4].tolist()}"


def run_and_check(key, value, cache, slots, spec, k_scale, v_scale, fmt):
    expected = kv_cache_write_ref(
        key.cpu(),
        value.cpu(),
        cache.cpu(),
        slots.cpu(),
        fmt,
        None if k_scale is None else k_scale.cpu(),
        None if v_scale is None else v_scale.cpu(),
    )
    storage_before = cache.untyped_storage().data_ptr()
    result = torch.ops.mm3.kv_cache_write(key, value, cache, slots, spec, k_scale, v_scale)
    assert result is None
    assert cache.untyped_storage().data_ptr() == storage_before  # written in place
    assert_same_bits(cache, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("spec", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("target", TARGETS)
def test_fp8_bytes_cache_matches_reference(target, spec, scale_mode, layout, device):
    num_blocks, num_heads, head_dim, num_tokens = 3, 2, 64, 45
    with platform.emulate(target):
        fmt = platform.fp8_format(platform.resolve_kv_cache_dtype(spec, device, torch.bfloat16))
        seed = 100 * TARGETS.index(target) + 10 * SCALE_MODES.index(scale_mode) + LAYOUTS.index(layout) + len(spec)
        key = wide_values((num_tokens, num_heads, head_dim), torch.bfloat16, device, seed)
        value = wide_values((num_tokens, num_heads, head_dim), torch.bfloat16, device, seed + 1)
        cache = make_cache(num_blocks, num_heads, head_dim, layout, torch.uint8, device, seed)
        slots = make_slots(num_tokens, num_blocks, device, seed)
        k_scale, v_scale = make_scales(scale_mode, num_heads, num_blocks * 128, device, seed)
        run_and_check(key, value, cache, slots, spec, k_scale, v_scale, fmt)


@pytest.mark.parametrize("key_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("spec", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("target", TARGETS)
def test_fp8_typed_cache_matches_reference(target, spec, key_dtype, device):
    """An already-typed cache of the authority's flavour is written like the bytes; D = 128."""
    num_blocks, num_heads, head_dim, num_tokens = 2, 1, 128, 30
    with platform.emulate(target):
        dtype = platform.resolve_kv_cache_dtype(spec, device, key_dtype)
        key = wide_values((num_tokens, num_heads, head_dim), key_dtype, device, 5)
        value = wide_values((num_tokens, num_heads, head_dim), key_dtype, device, 6)
        cache = make_cache(num_blocks, num_heads, head_dim, "NHD", dtype, device)
        k_scale, v_scale = make_scales("per_token_head", num_heads, num_blocks * 128, device, 7)
        run_and_check(
            key,
            value,
            cache,
            make_slots(num_tokens, num_blocks, device, 8),
            spec,
            k_scale,
            v_scale,
            platform.fp8_format(dtype),
        )
        assert cache.dtype == dtype


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_cache_matches_reference(dtype, layout, head_dim, device):
    num_blocks, num_heads, num_tokens = 3, 2, 50
    key = wide_values((num_tokens, num_heads, head_dim), dtype, device, 1)
    value = wide_values((num_tokens, num_heads, head_dim), dtype, device, 2)
    cache = make_cache(num_blocks, num_heads, head_dim, layout, dtype, device)
    slots = make_slots(num_tokens, num_blocks, device, 3)
    run_and_check(key, value, cache, slots, "auto", None, None, None)  # stored as they are
    # scales only apply to FP8 caches: given with a half cache they are refused, not silently ignored
    k_scale, v_scale = make_scales("scalar", num_heads, num_blocks * 128, device, 0)
    with pytest.raises(ValueError, match="k_scale/v_scale: scales are only applied when storing into an FP8 cache"):
        torch.ops.mm3.kv_cache_write(key, value, cache, slots, "auto", k_scale, v_scale)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("inf"), float("nan")])
def test_write_scales_must_be_positive_finite(bad, device, monkeypatch):
    """A cache write stores key / scale: a zero, negative or non-finite scale is refused (a zero saturated every
    stored value, a negative one flipped signs), where index values are checked."""
    monkeypatch.setenv("MM3_VALIDATE", "1")
    with platform.emulate("sm_90"):
        cache = make_cache(2, 2, 64, "HND", torch.uint8, device)
        key = torch.randn(3, 2, 64, device=device, dtype=torch.bfloat16)
        slots = torch.tensor([0, 1, 2], dtype=torch.int64, device=device)
        good = torch.tensor([0.5], device=device)
        with pytest.raises(ValueError, match="v_scale: expected positive finite scales"):
            torch.ops.mm3.kv_cache_write(key, key, cache, slots, "fp8", good, torch.tensor([bad], device=device))


def test_a_slot_written_twice_is_refused(device, monkeypatch):
    """Two tokens into one slot race on a GPU (which lands is timing): refused where index values are checked."""
    monkeypatch.setenv("MM3_VALIDATE", "1")
    cache = make_cache(2, 2, 64, "HND", torch.bfloat16, device)
    key = torch.randn(4, 2, 64, device=device, dtype=torch.bfloat16)
    slots = torch.tensor([5, -1, 7, 5], dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="slot_mapping: slot 5 is written by more than one token"):
        torch.ops.mm3.kv_cache_write(key, key, cache, slots)
    torch.ops.mm3.kv_cache_write(key, key, cache, torch.tensor([5, -1, 7, -1], dtype=torch.int64, device=device))


def test_all_padding_leaves_cache_untouched(device):
    with platform.emulate("gfx942"):
        cache = make_cache(2, 2, 64, "HND", torch.uint8, device)
        before = cache.clone()
        key = torch.randn(9, 2, 64, device=device, dtype=torch.bfloat16)
        slots = torch.tensor([-1] * 5 + [256, 257, 10**9, -(10**9)], dtype=torch.int64, device=device)
        torch.ops.mm3.kv_cache_write(key, key, cache, slots, "fp8")
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    "target, typed, wanted",
    [
        ("gfx942", platform.FP8_E4M3_OCP, "float8_e4m3fnuz"),
        ("sm_90", platform.FP8_E4M3_FNUZ, "float8_e4m3fn"),
        ("gfx950", platform.FP8_E5M2_FNUZ, "float8_e5m2"),
    ],
)
def test_typed_cache_of_wrong_flavour_refused(target, typed, wanted, device):
    spec = "fp8_e5m2" if "e5m2" in wanted else "fp8"
    key = torch.randn(4, 1, 64, device=device, dtype=torch.bfloat16)
    cache = make_cache(1, 1, 64, "HND", typed, device)
    slots = torch.arange(4, device=device)
    with platform.emulate(target), pytest.raises(TypeError) as info:
        torch.ops.mm3.kv_cache_write(key, key, cache, slots, spec)
    message = str(info.value)
    assert wanted in message and str(typed).removeprefix("torch.") in message and target in message


def test_compiled_caller_sees_the_write(device):
    """Functionalization must keep the mutation: the compiled caller reads back what was written."""

    def write_then_read(key, value, cache, slots):
        torch.ops.mm3.kv_cache_write(key, value, cache, slots, "auto")
        return cache[0, :, :4, :].float().sum()

    torch._dynamo.reset()
    compiled = torch.compile(write_then_read, backend="aot_eager", fullgraph=True)
    key = torch.randn(6, 2, 64, device=device, dtype=torch.bfloat16)
    value = torch.randn(6, 2, 64, device=device, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1, 2, 3, -1, 200], dtype=torch.int64, device=device)
    cache = torch.zeros(2, 2, 128, 128, device=device, dtype=torch.bfloat16)
    expected_cache = kv_cache_write_ref(key.cpu(), value.cpu(), cache.cpu(), slots.cpu(), None)
    total = compiled(key, value, cache, slots)
    assert_same_bits(cache, expected_cache)
    torch.testing.assert_close(total.cpu(), expected_cache[0, :, :4, :].float().sum())


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_opcheck(target, device):
    op = torch.ops.mm3.kv_cache_write.default
    key = torch.randn(17, 2, 64, device=device, dtype=torch.bfloat16)
    value = torch.randn(17, 2, 64, device=device, dtype=torch.bfloat16)
    slots = make_slots(17, 2, device, 0)
    with platform.emulate(target):
        torch.library.opcheck(op, (key, value, make_cache(2, 2, 64, "HND", torch.bfloat16, device), slots))
        k_scale, v_scale = make_scales("per_token_head", 2, 256, device, 0)
        cache = make_cache(2, 2, 64, "NHD", torch.uint8, device)
        torch.library.opcheck(op, (key, value, cache, slots, "fp8", k_scale, v_scale))
        # uint8 bytes only: opcheck's schema check cannot compare typed FP8 tensors on the CPU.
        k_scale, v_scale = make_scales("scalar", 2, 256, device, 0)
        cache = make_cache(2, 2, 64, "HND", torch.uint8, device)
        torch.library.opcheck(op, (key, value, cache, slots, "fp8_e5m2", k_scale, v_scale))


def _bad(**overrides):
    """Valid bf16 arguments (2 tokens, Hkv 2, D 64, 2 pages) with some replaced."""

    def make(device):
        args = dict(
            key=torch.zeros(2, 2, 64, dtype=torch.bfloat16, device=device),
            value=torch.zeros(2, 2, 64, dtype=torch.bfloat16, device=device),
            kv_cache=torch.zeros(2, 2, 128, 128, dtype=torch.bfloat16, device=device),
            slot_mapping=torch.tensor([0, 1], dtype=torch.int64, device=device),
            kv_cache_dtype="auto",
            k_scale=None,
            v_scale=None,
        )
        args.update({name: (f(device) if callable(f) else f) for name, f in overrides.items()})
        return args

    return make


BAD_INPUTS = [
    (_bad(key=lambda d: torch.zeros(2, 64, dtype=torch.bfloat16, device=d)), ValueError, "key: expected a 3-D"),
    (
        _bad(value=lambda d: torch.zeros(2, 2, 32, dtype=torch.bfloat16, device=d)),
        ValueError,
        "value: expected the shape",
    ),
    (
        _bad(value=lambda d: torch.zeros(2, 2, 64, dtype=torch.float16, device=d)),
        TypeError,
        "value: expected the dtype",
    ),
    (
        _bad(
            key=lambda d: torch.zeros(2, 2, 96, dtype=torch.bfloat16, device=d),
            value=lambda d: torch.zeros(2, 2, 96, dtype=torch.bfloat16, device=d),
        ),
        ValueError,
        "head dim D must be one of",
    ),
    (
        _bad(
            key=lambda d: torch.zeros(2, 2, 64, dtype=torch.float16, device=d),
            value=lambda d: torch.zeros(2, 2, 64, dtype=torch.float16, device=d),
        ),
        TypeError,
        "kv_cache: .*needs a torch.float16",
    ),
    (
        _bad(
            kv_cache_dtype="bfloat16",
            key=lambda d: torch.zeros(2, 2, 64, dtype=torch.float16, device=d),
            value=lambda d: torch.zeros(2, 2, 64, dtype=torch.float16, device=d),
        ),
        TypeError,
        "key/value must already be",
    ),
    (
        _bad(kv_cache=lambda d: torch.zeros(2, 3, 128, 128, dtype=torch.bfloat16, device=d)),
        ValueError,
        "kv_cache: expected logical",
    ),
    (
        _bad(kv_cache=lambda d: torch.zeros(2, 2, 64, 128, dtype=torch.bfloat16, device=d)),
        ValueError,
        "kv_cache: expected logical",
    ),
    (
        _bad(kv_cache=lambda d: torch.zeros(2, 2, 128, dtype=torch.bfloat16, device=d)),
        ValueError,
        "kv_cache: expected a 4-D",
    ),
    (
        _bad(kv_cache=lambda d: torch.zeros(2, 2, 128, 256, dtype=torch.bfloat16, device=d)[..., ::2]),
        ValueError,
        "kv_cache: the last dim",
    ),
    (
        _bad(slot_mapping=lambda d: torch.tensor([0, 1], dtype=torch.int32, device=d)),
        TypeError,
        "slot_mapping: expected dtype",
    ),
    (
        _bad(slot_mapping=lambda d: torch.tensor([0, 1, 2], dtype=torch.int64, device=d)),
        ValueError,
        "slot_mapping: expected 2 slots",
    ),
    (_bad(kv_cache_dtype="fp4"), ValueError, "kv_cache_dtype: unknown spec"),
    (
        _bad(
            kv_cache_dtype="fp8",
            kv_cache=lambda d: torch.zeros(2, 2, 128, 128, dtype=torch.uint8, device=d),
            k_scale=lambda d: torch.ones(1, device=d),
        ),
        ValueError,
        "pass both or neither",
    ),
    (
        _bad(
            kv_cache_dtype="fp8",
            kv_cache=lambda d: torch.zeros(2, 2, 128, 128, dtype=torch.uint8, device=d),
            k_scale=lambda d: torch.ones(2, 128, device=d),
            v_scale=lambda d: torch.ones(2, 128, device=d),
        ),
        ValueError,
        r"k_scale: expected one element .*\[2, 256\]",
    ),
    (
        _bad(
            kv_cache_dtype="fp8",
            kv_cache=lambda d: torch.zeros(2, 2, 128, 128, dtype=torch.uint8, device=d),
            k_scale=lambda d: torch.ones(1, dtype=torch.float64, device=d),
            v_scale=lambda d: torch.ones(1, device=d),
        ),
        TypeError,
        "k_scale: expected a float32",
    ),
    (
        _bad(
            kv_cache_dtype="fp8",
            kv_cache=lambda d: torch.zeros(2, 2, 128, 128, dtype=torch.uint8, device=d),
            k_scale=lambda d: torch.ones(1, device=d),
            v_scale=lambda d: torch.ones(2, 256, device=d),
        ),
        ValueError,
        r"k_scale/v_scale: both must be one element .* got \[1\] and \[2, 256\]",
    ),
    (
        _bad(slot_mapping=lambda d: torch.tensor([0, 9, 1, 9], dtype=torch.int64, device=d)[::2]),
        ValueError,
        r"slot_mapping: expected a contiguous 1-D tensor \(stride 1\), got strides \(2,\)",
    ),
    (
        _bad(kv_cache=lambda d: torch.zeros(1, 2, 128, 128, dtype=torch.bfloat16, device=d).expand(3, -1, -1, -1)),
        ValueError,
        "kv_cache: a dim of stride 0 makes entries share memory",
    ),
    (
        _bad(
            key=lambda d: torch.zeros(2, 2, 64, device=d),
            value=lambda d: torch.zeros(2, 2, 64, device=d),
            kv_cache=lambda d: torch.zeros(2, 2, 128, 128, device=d),
        ),
        TypeError,
        "kv_cache: a non-FP8 cache must be bfloat16 or float16",
    ),
]


def test_slot_past_the_cache_is_refused(device, monkeypatch):
    """Where index values are checked (CPU by default, GPU with MM3_VALIDATE=1) a slot past the cache is an error."""
    monkeypatch.setenv("MM3_VALIDATE", "1")
    key = torch.zeros(2, 1, 64, dtype=torch.bfloat16, device=device)
    cache = torch.zeros(2, 1, 128, 128, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="slot_mapping: slot 256 is outside the cache's 2 pages of 128"):
        torch.ops.mm3.kv_cache_write(key, key, cache, torch.tensor([-1, 256], device=device))
    assert not cache.any()


@pytest.mark.parametrize("make, error, match", BAD_INPUTS)
def test_bad_input(make, error, match, device):
    args = make(device)
    with pytest.raises(error, match=match):
        torch.ops.mm3.kv_cache_write(**args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(error, match=match):  # the fake validates too
        torch.ops.mm3.kv_cache_write(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("spec, target", [("auto", None), ("fp8", "sm_90"), ("fp8", "gfx942"), ("fp8_e5m2", "gfx950")])
def test_gpu_large(spec, target, layout, device):
    num_blocks, num_heads, head_dim, num_tokens = 96, 4, 128, 8000
    with platform.emulate(target) if target else contextlib.nullcontext():
        fmt = None
        if spec != "auto":
            fmt = platform.fp8_format(platform.resolve_kv_cache_dtype(spec, device, torch.bfloat16))
        key = wide_values((num_tokens, num_heads, head_dim), torch.bfloat16, device, 1)
        value = wide_values((num_tokens, num_heads, head_dim), torch.bfloat16, device, 2)
        cache = make_cache(
            num_blocks, num_heads, head_dim, layout, torch.bfloat16 if fmt is None else torch.uint8, device
        )
        k_scale, v_scale = make_scales("per_token_head" if fmt else "none", num_heads, num_blocks * 128, device, 3)
        run_and_check(key, value, cache, make_slots(num_tokens, num_blocks, device, 4), spec, k_scale, v_scale, fmt)


@pytest.mark.gpu
def test_gpu_launcher_traces_symbolically(device):
    """The launcher is make_fx-traceable with symbolic shapes and records one mutating kernel node."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mm3_compile.kernels.kv_cache import write as kernels

    with platform.emulate("gfx942"):
        fmt = platform.fp8_format(platform.resolve_kv_cache_dtype("fp8", device, torch.bfloat16))
        key = wide_values((40, 2, 64), torch.bfloat16, device, 0)
        cache = make_cache(3, 2, 64, "NHD", torch.uint8, device)
        slots = make_slots(40, 3, device, 0)
        k_scale, v_scale = make_scales("per_token_head", 2, 3 * 128, device, 0)
        expected = kv_cache_write_ref(key.cpu(), key.cpu(), cache.cpu(), slots.cpu(), fmt, k_scale.cpu(), v_scale.cpu())

        def write(k, v, c, s, ks, vs):
            kernels.kv_cache_write(k, v, c.view(fmt.dtype), s, fmt, 2, ks, vs)
            return c

        graph = make_fx(write, tracing_mode="symbolic")(key, key, cache.clone(), slots, k_scale, v_scale)
        assert (
            graph.code.count("torch.ops.higher_order.triton_kernel_wrapper_mutation(") == 1 and "item" not in graph.code
        )
        graph(key, key, cache, slots, k_scale, v_scale)
    assert_same_bits(cache, expected)


def test_compiled_caller_no_recompiles(device):
    """The token count is a symbolic size: new batch sizes reuse the compiled graph."""
    import torch._dynamo.testing

    def write(key, value, cache, slots):
        torch.ops.mm3.kv_cache_write(key * 1, value, cache, slots, "fp8")

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(write, backend=counter, fullgraph=True, dynamic=True)
    with platform.emulate("gfx942"):
        fmt = platform.fp8_format(platform.resolve_kv_cache_dtype("fp8", device, torch.bfloat16))
        for step, num_tokens in enumerate((9, 3, 40, 17)):
            key = wide_values((num_tokens, 2, 64), torch.bfloat16, device, step)
            cache = make_cache(2, 2, 64, "NHD", torch.uint8, device, step)
            slots = make_slots(num_tokens, 2, device, step)
            expected = kv_cache_write_ref(key.cpu(), key.cpu(), cache.cpu(), slots.cpu(), fmt)
            if step == 0:
                compiled(key, key, cache, slots)
                frames = counter.frame_count
                continue
            with torch.compiler.set_stance("fail_on_recompile"):
                compiled(key, key, cache, slots)
            assert_same_bits(cache, expected)
    assert counter.frame_count == frames


@pytest.mark.parametrize("spec", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("target", TARGETS)
def test_bf16_subnormal_keys_exact(target, spec, device):
    """bf16 subnormal K/V (every m * 2^-133) divided by a scalar 2^-126 land on normal and
    subnormal FP8 codes; the interpreter's bf16 -> fp32 cast got them wrong, the kernel widens the bits."""
    m = torch.arange(1, 128, dtype=torch.float64)
    rows = torch.cat([m, -m]) * 2.0**-133  # [254], exact in bf16
    key = rows[:128].reshape(2, 1, 64).to(torch.bfloat16).to(device)
    value = rows[-128:].reshape(2, 1, 64).to(torch.bfloat16).to(device)
    with platform.emulate(target):
        fmt = platform.fp8_format(platform.resolve_kv_cache_dtype(spec, device, torch.bfloat16))
        cache = make_cache(1, 1, 64, "HND", torch.uint8, device)
        scale = torch.tensor([2.0**-126], device=device)
        run_and_check(key, value, cache, torch.tensor([5, 127], device=device), spec, scale, scale, fmt)
        stored = cache.view(fmt.dtype)[0, 0, 5, :64].float().cpu()
    assert torch.equal(stored, (key[0, 0].double().cpu() * 2.0**126).to(fmt.dtype).float())
