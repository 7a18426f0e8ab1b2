"""Pure-PyTorch reference for the KV-cache insert, written from the contract, not from the kernel.

FP8 values are ``x / scale`` in fp32, clamped to the format's finite range and converted by torch's
own round-to-nearest-even cast; bf16/fp16 caches get the values unchanged.  Works on a copy.
"""

import torch

from mm3_compile.contract import PAGE_SIZE
from mm3_compile.platform import FP8Format


def _encode(x: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, cache_dtype, fmt: FP8Format | None):
    """x [n, Hkv, D] -> the bytes/elements to store, in the cache's storage dtype (uint8 for FP8)."""
    if fmt is None:
        return x.to(cache_dtype)
    x = x.float()
    if scale is not None:
        if scale.numel() == 1:
            x = x / scale.reshape(())
        else:
            x = x / scale[:, slots].transpose(0, 1).unsqueeze(-1)  # scale [Hkv, num_slots] -> [n, Hkv, 1]
    return x.clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)


def kv_cache_write_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: FP8Format | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A copy of ``kv_cache`` [nb, Hkv, 128, 2D] (storage dtype; uint8 bytes for FP8) after the insert.

    Tokens with a negative slot or a slot >= nb * 128 are not written.
    """
    D = key.shape[-1]
    out = kv_cache.clone()
    storage = out.view(torch.uint8) if fmt is not None else out
    num_slots = kv_cache.shape[0] * PAGE_SIZE
    keep = (slot_mapping >= 0) & (slot_mapping < num_slots)
    slots = slot_mapping[keep]
    pages, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE
    # Advanced indices on dims 0 and 2 around a slice: the indexed view is [n, Hkv, D].
    storage[pages, :, offsets, :D] = _encode(key[keep], k_scale, slots, out.dtype, fmt)
    storage[pages, :, offsets, D:] = _encode(value[keep], v_scale, slots, out.dtype, fmt)
    return out
