"""Shared cases, builders and tolerances of the sparse-attention tests (see ``test_numerics.py``)."""

import dataclasses
import math

import pytest
import torch

from mm3_compile import platform
from mm3_compile.kernels._launch import eager_launches
from mm3_compile.kernels.sparse_attn import decode as decode_kernels
from mm3_compile.kernels.sparse_attn.naive import sparse_attn_ref
from mm3_compile.ops._kv import resolve_cache_view

PAGE = 128


TOLERANCE = {torch.bfloat16: (2e-2, 1.5e-3), torch.float16: (2e-3, 1.5e-4)}  # (max abs, mean abs)


FP8_ROUND_TRIP_TOLERANCE = (0.1, 0.01)


FP8_CASES = [  # (target, spec, layout, scale mode): every flavour, rotating the other axes
    ("sm_90", "fp8", "HND", "scalar"),
    ("sm_90", "fp8_e5m2", "NHD", "per_token_head"),
    ("gfx942", "fp8", "NHD", "none"),
    ("gfx942", "fp8_e5m2", "HND", "per_token_head"),
    ("gfx950", "fp8", "HND", "per_token_head"),
    ("gfx950", "fp8_e5m2", "NHD", "scalar"),
]


@dataclasses.dataclass
class Case:
    q: torch.Tensor  # [total_q, Hq, D]
    kv_cache: torch.Tensor  # op argument: typed or uint8 [num_blocks, Hkv, 128, 2D]
    topk_idx: torch.Tensor  # [Hkv, total_q, T]
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs]
    sm_scale: float
    kv_cache_dtype: str
    storage_dtype: torch.dtype
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    values: torch.Tensor  # [num_blocks, Hkv, 128, 2D] fp32 K/V the cache was made from

    def prefill_args(self):
        return (
            self.q,
            self.kv_cache,
            self.topk_idx,
            self.block_table,
            self.cu_seqlens_q,
            self.seq_lens,
            self.sm_scale,
            self.kv_cache_dtype,
            self.k_scale,
            self.v_scale,
        )

    def decode_args(self):
        return (
            self.q,
            self.kv_cache,
            self.topk_idx,
            self.block_table,
            self.seq_lens,
            self.sm_scale,
            self.kv_cache_dtype,
            self.k_scale,
            self.v_scale,
        )

    def split_decode(self, num_splits, scale_mode=0, q=None, **options):
        """The decode kernel launched directly with ``num_splits`` (and ``options``, e.g. ``block_q``): the op
        picks its split count from the device.  ``scale_mode`` 0 passes no scales, else the case's."""
        view, fmt = resolve_cache_view(self.kv_cache, self.kv_cache_dtype, self.q.dtype)
        scales = (self.k_scale, self.v_scale) if scale_mode else (None, None)
        with eager_launches():
            return decode_kernels.sparse_attn_decode(
                self.q if q is None else q,
                view,
                fmt,
                self.topk_idx,
                self.block_table,
                self.seq_lens,
                self.sm_scale,
                *scales,
                scale_mode,
                num_splits=num_splits,
                **options,
            )

    def reference(self, storage_dtype=None):
        return sparse_attn_ref(
            self.q,
            self.kv_cache,
            self.topk_idx,
            self.block_table,
            self.cu_seqlens_q,
            self.seq_lens,
            self.sm_scale,
            storage_dtype or self.storage_dtype,
            self.k_scale,
            self.v_scale,
        )


def fill_cache(values, storage_dtype, nan_fill, layout):
    """values [nb, Hkv, 128, 2D] -> cache view in ``layout`` inside a buffer with a NaN page either side."""
    nb, Hkv, _, width = values.shape
    physical = (nb + 2, Hkv, PAGE, width) if layout == "HND" else (nb + 2, PAGE, Hkv, width)
    buffer = torch.full(physical, nan_fill, dtype=storage_dtype, device=values.device)
    cache = buffer[1:-1] if layout == "HND" else buffer[1:-1].permute(0, 2, 1, 3)  # logical [nb, Hkv, 128, 2D]
    cache.copy_(values.to(storage_dtype) if storage_dtype != torch.uint8 else values)
    return cache


def build(
    device,
    reqs,  # [(seq_len, q_len)]
    *,
    D=64,
    Hkv=1,
    G=4,
    T=4,
    model_dtype=torch.bfloat16,
    spec="auto",
    layout="HND",
    scale="none",
    corrupt=False,
    typed_fp8=False,
    seed=0,
):
    """A random paged-attention problem; FP8 specs must be built under the platform being tested."""
    gen = torch.Generator().manual_seed(seed)
    Hq = Hkv * G
    blocks_per_req = [math.ceil(s / PAGE) for s, _ in reqs]
    num_blocks = sum(blocks_per_req) + 1
    max_blocks = max(blocks_per_req + [1])
    pages = torch.randperm(num_blocks, generator=gen)  # logical -> physical is scrambled
    # Hidden columns past max_blocks hold a real page: reading them would change the result.
    table = torch.zeros(len(reqs), max_blocks + 2, dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks_per_req):
        table[r, :n] = pages[start : start + n].to(torch.int32)
        start += n
    if corrupt:
        # A truncated table (request 0's last block is not addressable) and pages outside the cache,
        # which sit on the NaN pages around the cache view: all must be skipped.
        max_blocks = max(1, blocks_per_req[0] - 1)
        table[0, 1] = num_blocks
        table[1, 0] = -1
    block_table = table.to(device)[:, :max_blocks]

    total_q = sum(q for _, q in reqs)
    cu = torch.tensor([0] + [q for _, q in reqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    q_full = torch.randn(total_q, Hq + 2, D, generator=gen)
    q = q_full.to(model_dtype).to(device)[:, :Hq]  # a strided view, as when q is sliced out of qkv

    topk = torch.full((total_q, Hkv, T), 0, dtype=torch.int32)  # token-major, as allocated on CUDA
    for r, (seq_len, q_len) in enumerate(reqs):
        for i in range(q_len):
            t, p = int(cu[r]) + i, seq_len - q_len + i
            if p < 0:
                continue
            own = p // PAGE
            n = min(T, own + 1)
            for h in range(Hkv):
                others = torch.randperm(own, generator=gen)[: n - 1].to(torch.int32)
                topk[t, h, :n] = torch.cat([torch.tensor([own], dtype=torch.int32), others])
                if corrupt and n > 1:
                    junk = torch.tensor([-1, own + 1, -5, 10**6, own + 40, own], dtype=torch.int32)  # own: a repeat
                    slot = int(torch.randint(1, n, (1,), generator=gen))
                    topk[t, h, slot] = junk[int(torch.randint(0, len(junk), (1,), generator=gen))]
                    if i == 0 and h == Hkv - 1 and n >= 4:  # block 0 listed twice (next to block 1) counts once
                        topk[t, h, n - 3 :] = torch.tensor([1, 0, 0], dtype=torch.int32)
    if corrupt:
        topk[0, 0, :] = -1  # a row with no valid slot at all: zeros, not NaN
    topk_idx = topk.to(device).transpose(0, 1)  # [Hkv, total_q, T] view

    values = torch.randn(num_blocks, Hkv, PAGE, 2 * D, generator=gen).to(device)
    k_scale = v_scale = None
    storage = platform.resolve_kv_cache_dtype(spec, device, model_dtype)
    if platform.is_fp8(storage):
        fmt = platform.fp8_format(storage)
        if scale == "scalar":
            k_scale = torch.tensor([0.5], device=device)
            v_scale = torch.tensor([0.25], device=device)
            k_div, v_div = k_scale, v_scale
        elif scale == "per_token_head":
            k_scale = (0.25 + 2 * torch.rand(Hkv, num_blocks * PAGE, generator=gen)).to(device)
            v_scale = (0.25 + 2 * torch.rand(Hkv, num_blocks * PAGE, generator=gen)).to(device)
            # scale[h, page * 128 + offset] -> [nb, Hkv, 128, 1]
            k_div = k_scale.reshape(Hkv, num_blocks, PAGE).transpose(0, 1)[..., None]
            v_div = v_scale.reshape(Hkv, num_blocks, PAGE).transpose(0, 1)[..., None]
        else:
            k_div = v_div = torch.ones((), device=device)
        scaled = torch.cat([values[..., :D] / k_div, values[..., D:] / v_div], dim=-1)
        codes = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)
        cache = fill_cache(codes, torch.uint8, fmt.nan_byte, layout)
        if typed_fp8:
            cache = cache.view(fmt.dtype)
    else:
        cache = fill_cache(values, storage, float("nan"), layout)
    return Case(
        q,
        cache,
        topk_idx,
        block_table,
        cu.to(device),
        torch.tensor([s for s, _ in reqs], dtype=torch.int32, device=device),
        D**-0.5,
        spec,
        storage,
        k_scale,
        v_scale,
        values,
    )


def assert_close(out, ref, dtype, what=""):
    max_tol, mean_tol = TOLERANCE[dtype]
    assert out.dtype == dtype and not out.isnan().any(), what
    err = (out.float() - ref.float()).abs()
    assert err.max() < max_tol and err.mean() < mean_tol, f"{what}: max err {err.max():.3g}, mean {err.mean():.3g}"


SCHEDULES = pytest.mark.parametrize("schedule", ["union", "kv_centric"], indirect=True)


OP_SCHEDULES = pytest.mark.parametrize(
    "op, schedule", [("prefill", "union"), ("prefill", "kv_centric"), ("decode", None)], indirect=["schedule"]
)


# Ragged prefill batch: a long prefix straddling block boundaries, a request with no new tokens,
# a chunk starting mid-block, and a short request with fewer visible blocks than T.
PREFILL_REQS = [(300, 9), (140, 0), (263, 6), (40, 5)]


DECODE_REQS = [(300, 2), (0, 2), (129, 2)]  # (seq_len, q_per_req); seq_len 0 = CUDA-graph padding


PREFILL_NAMES = (
    "q",
    "kv_cache",
    "topk_idx",
    "block_table",
    "cu_seqlens_q",
    "seq_lens",
    "sm_scale",
    "kv_cache_dtype",
    "k_scale",
    "v_scale",
)
