"""``mm3::kv_cache_write``: insert K/V rows into the paged main KV cache, in place.

The cache's storage dtype comes from ``resolve_cache_view`` (the dtype authority for the cache's
device), in the real implementation and in the fake alike, so a compiled caller resolves the FP8
flavour at trace time.  The op is declared as mutating ``kv_cache``: functionalization sees the
write, and the kernel writes through a view of the very tensor passed (never a copy).
"""

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from mm3_compile.contract import PAGE_SIZE
from mm3_compile.kernels._launch import eager_launches, require_kernel_device
from mm3_compile.kernels.kv_cache import write as kernels
from mm3_compile.ops._checks import (
    FLOAT_DTYPES,
    check_index_vector,
    check_last_dim_contiguous,
    check_same_device,
    check_scale_values,
    check_tensor,
    values_checked,
)
from mm3_compile.ops._kv import kv_scale_mode, resolve_cache_view

HEAD_DIMS = (16, 32, 64, 128, 256)  # the attention ops read D 64/128; the index-K cache is written as two halves


def _check_kv_write(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """Validate every argument; returns (typed cache view, FP8 format or None, scale mode)."""
    check_tensor("key", key, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("value", value, ndim=3)
    if value.dtype != key.dtype:
        raise TypeError(f"value: expected the dtype of key ({key.dtype}), got {value.dtype}")
    if value.shape != key.shape:
        raise ValueError(f"value: expected the shape of key {list(key.shape)}, got {list(value.shape)}")
    num_tokens, num_heads, head_dim = key.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"key: head dim D must be one of {HEAD_DIMS}, got {head_dim}")
    check_last_dim_contiguous("key", key)
    check_last_dim_contiguous("value", value)
    check_tensor("kv_cache", kv_cache, ndim=4)
    expected = ("num_blocks", num_heads, PAGE_SIZE, 2 * head_dim)
    if tuple(kv_cache.shape[1:]) != expected[1:]:
        raise ValueError(
            f"kv_cache: expected logical shape [num_blocks, Hkv, {PAGE_SIZE}, 2*D] = "
            f"[num_blocks, {num_heads}, {PAGE_SIZE}, {2 * head_dim}], got {list(kv_cache.shape)}"
        )
    check_last_dim_contiguous("kv_cache", kv_cache)
    if any(stride == 0 and guard_or_false(size > 1) for size, stride in zip(kv_cache.shape, kv_cache.stride())):
        raise ValueError(
            f"kv_cache: a dim of stride 0 makes entries share memory (an expanded tensor?), got strides "
            f"{tuple(kv_cache.stride())}; pass a writable cache"
        )
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), ndim=1)
    check_index_vector("slot_mapping", slot_mapping)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping: expected {num_tokens} slots (one per token), got {slot_mapping.shape[0]}")
    check_same_device("key", key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    cache, fmt = resolve_cache_view(kv_cache, kv_cache_dtype, key.dtype)
    if fmt is None and cache.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(
            f"kv_cache: a non-FP8 cache must be bfloat16 or float16 (what attention reads), got {cache.dtype}"
        )
    if fmt is None and cache.dtype != key.dtype:
        # A bf16 <-> fp16/fp32 conversion would round here but not where the model wrote K/V; refuse it.
        raise TypeError(
            f"key: kv_cache_dtype={kv_cache_dtype!r} stores {cache.dtype}; key/value must already be {cache.dtype}, "
            f"got {key.dtype}"
        )
    scale_mode = kv_scale_mode(k_scale, v_scale, num_heads, kv_cache.shape[0] * PAGE_SIZE, key.device)
    if k_scale is not None:
        if fmt is None:
            raise ValueError(
                f"k_scale/v_scale: scales are only applied when storing into an FP8 cache, got a {cache.dtype} cache"
            )
        if values_checked(k_scale, v_scale):
            check_scale_values("k_scale", k_scale)
            check_scale_values("v_scale", v_scale)
    if values_checked(slot_mapping):
        if (slot_mapping >= kv_cache.shape[0] * PAGE_SIZE).any():
            raise ValueError(
                f"slot_mapping: slot {int(slot_mapping.max())} is outside the cache's {kv_cache.shape[0]} pages of "
                f"{PAGE_SIZE} (negative slots mark padding)"
            )
        used = slot_mapping[slot_mapping >= 0]
        if used.unique().numel() != used.numel():  # two tokens into one slot: which one lands is a race
            values, counts = used.unique(return_counts=True)
            raise ValueError(f"slot_mapping: slot {int(values[counts > 1][0])} is written by more than one token")
    return cache, fmt, scale_mode


@torch.library.custom_op("mm3::kv_cache_write", mutates_args=("kv_cache",))
def kv_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """key/value [num_tokens, Hkv, D] -> kv_cache [num_blocks, Hkv, 128, 2D] at slot = page*128 + offset.

    Slots < 0 (padding) are skipped; a slot >= num_blocks*128 is an error where index values are
    checked (see ``mm3_compile.ops._checks``) and is never written.
    FP8 specs store ``x / scale`` (scalar or per (head, slot) ``[Hkv, num_blocks*128]``) rounded to
    nearest-even and saturated, in the flavour the authority gives for the cache's device.
    bf16/fp16 caches store key/value unchanged (same dtype required; scales are refused).

    Args:
        key, value: ``[T, Hkv, D]`` in the model dtype.
        kv_cache: ``[num_blocks, Hkv, 128, 2D]`` (HND, or an NHD buffer's permuted view), mutated in place:
            the model dtype, an FP8 dtype, or uint8 bytes of the FP8 dtype the spec resolves to.
        slot_mapping: ``[T]`` int64 cache slots, ``< 0`` skipped.
        kv_cache_dtype: ``"auto"`` (store as is), ``"bfloat16"``, ``"float16"``, ``"fp8"``, ``"fp8_e4m3"``,
            ``"fp8_e5m2"``.
        k_scale, v_scale: optional fp32 dequant scales, ``[1]`` or ``[Hkv, num_blocks * 128]`` (FP8 specs only).

    Returns:
        ``None`` (``kv_cache`` is written).

    Examples:
        >>> cache = torch.zeros(4, 2, 128, 128, dtype=torch.bfloat16)         # 4 pages, Hkv 2, D 64
        >>> k = v = torch.randn(3, 2, 64, dtype=torch.bfloat16)
        >>> torch.ops.mm3.kv_cache_write(k, v, cache, torch.tensor([0, 1, 130]))  # slot 130 = page 1, row 2
    """
    _, fmt, scale_mode = _check_kv_write(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    require_kernel_device("key", key)
    with eager_launches():
        kernels.kv_cache_write(key, value, kv_cache, slot_mapping, fmt, scale_mode, k_scale, v_scale)


@kv_cache_write.register_fake
def _(key, value, kv_cache, slot_mapping, kv_cache_dtype="auto", k_scale=None, v_scale=None):
    _check_kv_write(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
