"""Launcher of split-K block-sparse decode attention (uniform batches, speculative verify included).

Each (token, KV head) walks at most T (16) blocks, too little work to fill the GPU at small
batches, so the top-k list is split over ``num_splits`` programs; each writes a normalised
partial and its log2-sum-exp, and the last split of a (token, KV head) to finish merges them
(§5.5), counted by an arrival counter: one launch per decode step, not two.  ``num_splits``
depends only on shapes and the device's SM count, never on data, so a captured CUDA graph stays
valid; it is computed with ``torch.sym_*`` so a symbolic batch size stays symbolic instead of
being guarded.

Arrival counters must be zero when the kernel starts; the merging program zeroes its counter
again.  Eager calls therefore reuse one zeroed buffer (no memset per step): one per device for the
default stream and for CUDA-graph captures, one per stream for calls on other streams.  Graphs
captured with it must not be replayed concurrently on two streams.  A body traced for Inductor, a
capture before any eager call on the device, and a grid larger than the buffer get a fresh
``torch.zeros`` (a memset in the graph).
"""

import functools
import threading

import torch
import triton

from mm3_compile.kernels._launch import launches_traced
from mm3_compile.kernels.sparse_attn.common import launch_sparse_attn
from mm3_compile.platform import FP8Format, interpreting

# Programs per SM the split-K grid aims for: enough (token, KV head, split) programs in flight to
# hide the dependent top-k -> block-table -> page loads.
PROGRAMS_PER_SM = 2
# Under the interpreter programs run one at a time: split only the tiniest batches (still enough to
# exercise the merge).
INTERPRETER_TARGET_PROGRAMS = 8
# Reused arrival counters: splitting happens only below the target program count, so a few
# thousand (tile, KV head) counters cover every shape-derived plan.
ARRIVAL_COUNTERS = 4096
_arrivals = threading.local()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _target_programs(device: torch.device) -> int:
    if device.type != "cuda" or interpreting():
        return INTERPRETER_TARGET_PROGRAMS
    return PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split_plan(total_q, num_kv_heads: int, topk, device: torch.device):
    """(num_splits, blocks_per_split) from shapes: split the T blocks until the grid fills the GPU."""
    work = torch.sym_max(1, total_q * num_kv_heads)
    wanted = torch.sym_max(1, torch.sym_min(topk, _target_programs(device) // work))
    blocks_per_split = (topk + wanted - 1) // wanted
    return (topk + blocks_per_split - 1) // blocks_per_split, blocks_per_split


def _arrival_counters(count, device: torch.device) -> torch.Tensor:
    """``count`` zeroed int32 counters (see the module docstring for when they are reused)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    key = device
    if device.type == "cuda" and not capturing and torch.cuda.current_stream(device) != torch.cuda.default_stream(device):
        key = (device, torch.cuda.current_stream(device).cuda_stream)  # concurrent streams must not share counters
    buffers = _arrivals.__dict__.setdefault("buffers", {})
    if launches_traced() or not isinstance(count, int) or count > ARRIVAL_COUNTERS or (capturing and key not in buffers):
        return torch.zeros((count,), dtype=torch.int32, device=device)
    if key not in buffers:
        buffers[key] = torch.zeros((ARRIVAL_COUNTERS,), dtype=torch.int32, device=device)
    return buffers[key]


def sparse_attn_decode(
    q: torch.Tensor,  # [total_q, Hq, D] bf16/fp16, total_q = num_reqs * q_per_req
    kv_cache: torch.Tensor,  # [num_blocks, Hkv, 128, 2D] storage-dtype view (typed FP8 for FP8 caches)
    fmt: FP8Format | None,
    topk_idx: torch.Tensor,  # [Hkv, total_q, T] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, 0 for CUDA-graph padding requests
    sm_scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    scale_mode: int,
    num_splits: int | None = None,  # override of the shape-derived plan (tests, tuning)
    block_q: int = 1,  # tokens per program; > 1 lets a request's speculative tokens share K/V loads
) -> torch.Tensor:
    total_q, Hq, D = q.shape
    Hkv = kv_cache.shape[1]
    T = topk_idx.shape[2]
    q_per_req = total_q // seq_lens.shape[0]
    if num_splits is None:
        num_splits, blocks_per_split = split_plan(total_q, Hkv, T, q.device)
    else:
        blocks_per_split = triton.cdiv(T, num_splits)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [total_q, Hq, D]
    o_partial = torch.empty((num_splits, total_q, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((num_splits, total_q, Hq), dtype=torch.float32, device=q.device)
    arrivals = _arrival_counters(triton.cdiv(total_q, block_q) * Hkv, q.device)  # one per (tile, KV head)
    launch_sparse_attn(
        q, kv_cache, fmt, topk_idx, block_table, None, seq_lens, sm_scale, k_scale, v_scale, scale_mode,
        out, (o_partial, lse, arrivals), q_per_req=q_per_req, num_splits=num_splits, blocks_per_split=blocks_per_split,
        block_q=block_q,
    )  # fmt: skip
    return out
