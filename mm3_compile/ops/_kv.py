"""KV-cache dtype and scale handling shared by the cache writer and the attention ops.

The cache is stored either typed (bf16/fp16/an FP8 dtype) or as raw uint8 bytes; for FP8
specs the flavour is always the authority's answer for the cache's device, never assumed.
"""

import torch

from mm3_compile import platform
from mm3_compile.contract import SCALE_NONE, SCALE_PER_TOKEN_HEAD, SCALE_SCALAR
from mm3_compile.platform import FP8Format


def resolve_cache_view(
    kv_cache: torch.Tensor, kv_cache_dtype: str, model_dtype: torch.dtype
) -> tuple[torch.Tensor, FP8Format | None]:
    """The cache viewed in its storage dtype, and the FP8 format when the spec is an FP8 one.

    uint8 caches are bit-cast (``.view``) to the authority's flavour; a typed FP8 cache of a
    different flavour is refused (decoding it with the wrong flavour is upstream #45562).
    """
    wanted = platform.resolve_kv_cache_dtype(kv_cache_dtype, kv_cache.device, model_dtype)
    if not platform.is_fp8(wanted):
        if kv_cache.dtype != wanted:
            raise TypeError(
                f"kv_cache: kv_cache_dtype={kv_cache_dtype!r} with model dtype {model_dtype} needs a {wanted} "
                f"cache, got {kv_cache.dtype}"
            )
        return kv_cache, None
    fmt = platform.fp8_format(wanted)
    if kv_cache.dtype == torch.uint8:
        return kv_cache.view(wanted), fmt
    if kv_cache.dtype != wanted:
        target = platform.platform_for(kv_cache.device).target
        raise TypeError(
            f"kv_cache: kv_cache_dtype={kv_cache_dtype!r} on platform {target} stores {wanted}, but the cache is "
            f"typed {kv_cache.dtype}; pass the uint8 bytes or a {wanted} cache (reading one flavour as the other "
            "corrupts every value)"
        )
    return kv_cache, fmt


def kv_scale_mode(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, num_kv_heads: int, num_slots: int, device: torch.device
) -> int:
    """Validate the K/V dequant scales: none, one scalar each, or per (KV head, slot) ``[Hkv, num_slots]``."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale/v_scale: pass both or neither")
    if k_scale is None:
        return SCALE_NONE
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
            raise TypeError(f"{name}: expected a float32 tensor, got {getattr(s, 'dtype', type(s).__name__)}")
        if s.device != device:
            raise ValueError(f"{name}: expected a tensor on {device}, got {s.device}")
    if k_scale.numel() == 1 and v_scale.numel() == 1:
        return SCALE_SCALAR
    if (k_scale.numel() == 1) != (v_scale.numel() == 1):
        raise ValueError(
            f"k_scale/v_scale: both must be one element (scalar mode) or both [Hkv, num_blocks*128] = "
            f"{[num_kv_heads, num_slots]}; got {list(k_scale.shape)} and {list(v_scale.shape)}"
        )
    expected = (num_kv_heads, num_slots)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tuple(s.shape) != expected:
            raise ValueError(
                f"{name}: expected one element (scalar mode) or shape [Hkv, num_blocks*128] = {list(expected)}, "
                f"got {list(s.shape)}"
            )
    return SCALE_PER_TOKEN_HEAD
