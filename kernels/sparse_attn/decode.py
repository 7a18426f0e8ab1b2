"""Launcher of split-K block-sparse decode attention (uniform batches, speculative verify included).

Each (token, KV head) walks at most T (16) blocks, too little work to fill the GPU at small
batches, so the top-k list is split over ``num_splits`` programs; each writes a normalised
partial and its log2-sum-exp, and the last split of a (token, KV head) to finish merges them
counted by an arrival counter: one attention launch per decode step.  Grids of at most
``schedule.DEPENDENT_MERGE_MAX_TILES`` (token, KV head) tiles launched with PDL (one or a few requests,
where every split ends at once and the last arrival's merge is a serial tail) merge in a second,
dependent launch instead (``union.split_merge_kernel``): a value of the grid (``schedule.merge_plan``),
so a graph traced at one batch launches no merge (grid 0) at larger ones.  ``num_splits``
depends only on shapes and the device's SM count, never on data, so a captured CUDA graph stays
valid; it is computed with ``torch.sym_*`` so a symbolic batch size stays symbolic instead of
being guarded.  With one split there are no partials and no counters.

Arrival counters must be zero when the kernel starts; the merging program zeroes its counter
again.  Eager calls on a CUDA device's default stream, and CUDA-graph captures once such a call has
happened, therefore share one zeroed buffer per device, kept for the life of the process (no
memset per step): calls on one stream run one after the other, whichever Python thread issues
them; graphs captured with it must not be replayed while another of them, or an eager decode call
on the default stream, is still running on another stream.  Everything else gets a fresh
``torch.zeros`` (a memset): calls on other streams (two of them may run at once), captures before
any eager call, grids larger than the buffer, bodies traced for a graph (so a compiled step zeroes
its own counters, ~1 us), and every CPU call: the interpreter runs a call's programs on the calling
thread, so calls from several Python threads interleave and one call's merge would fire on
another's arrivals.  A caller that owns a zeroed buffer passes it as ``counters`` (the op
``mm3::sparse_attn_decode_with_workspace``): no memset and no sharing rule, also in a compiled graph, whose
launch then depends on nothing but its inputs.

The merge's ordering argument is NVIDIA's (a CTA barrier, then one GPU-scope acq_rel atomic).
AMD's gfx94x release covers only the issuing wavefront's stores, so on ROCm decode never splits.
"""

import threading

import torch
import triton
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from mm3_compile import platform
from mm3_compile.kernels._launch import launches_traced
from mm3_compile.kernels.sparse_attn.schedule import sm_count
from mm3_compile.kernels.sparse_attn.union import launch_sparse_attn
from mm3_compile.platform import FP8Format, interpreting

# Programs per SM the split-K grid aims for.  One-token bf16 decode: one wave, which the launcher
# runs with 4 warps in 3 pipeline stages (schedule.launch_options).  FP8 and multi-token tiles: two per SM,
# enough programs in flight to hide the dependent top-k -> block-table -> page loads (timings:
# bench/NOTES.md).
BF16_PROGRAMS_PER_SM = 1
PROGRAMS_PER_SM = 2
# Under the interpreter programs run one at a time: split only the tiniest batches (still enough to
# exercise the merge).
INTERPRETER_TARGET_PROGRAMS = 8
# Reused arrival counters (the shared buffer, and the least a caller's workspace holds): a shape-derived plan
# splits only when the grid's (tile, KV head) count is at most half the target program count (2 per SM),
# so 4096 counters cover every NVIDIA device with up to 4096 SMs.
ARRIVAL_COUNTERS = 4096
_shared_counters: dict[tuple[str, int | None], torch.Tensor] = {}
_shared_counters_lock = threading.Lock()


def _target_programs(device: torch.device, per_sm: int) -> int:
    if device.type != "cuda" or interpreting():
        return INTERPRETER_TARGET_PROGRAMS
    return per_sm * sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _rocm(device: torch.device) -> bool:
    return device.type == "cuda" and platform.hardware_vendor(device) == "amd"


def split_plan(total_q, num_kv_heads: int, topk, device: torch.device, per_sm: int = PROGRAMS_PER_SM):
    """(num_splits, blocks_per_split) from shapes: split the T blocks until the grid has ``per_sm`` programs per SM."""
    if _rocm(device):
        return 1, topk
    work = torch.sym_max(1, total_q * num_kv_heads)
    wanted = torch.sym_max(1, torch.sym_min(topk, _target_programs(device, per_sm) // work))
    blocks_per_split = (topk + wanted - 1) // wanted
    return (topk + blocks_per_split - 1) // blocks_per_split, blocks_per_split


def _arrival_counters(count, like: torch.Tensor) -> torch.Tensor:
    """``count`` zeroed int32 counters on ``like``'s device (the module docstring says when they are shared)."""
    device = like.device
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    default_stream = device.type == "cuda" and torch.cuda.current_stream(device) == torch.cuda.default_stream(device)
    shareable = (
        device.type == "cuda"  # CPU calls (the interpreter) may run concurrently from threads: fresh counters each
        and type(like) is torch.Tensor  # not a fake or functional tensor
        and get_proxy_mode() is None
        and not launches_traced()
        and isinstance(count, int)
        and count <= ARRIVAL_COUNTERS
        and (default_stream or capturing)
    )
    if shareable:
        key = (device.type, device.index)
        with _shared_counters_lock:
            if key not in _shared_counters and not capturing:
                _shared_counters[key] = torch.zeros((ARRIVAL_COUNTERS,), dtype=torch.int32, device=device)
            shared = _shared_counters.get(key)
        if shared is not None:
            return shared
    return torch.zeros((count,), dtype=torch.int32, device=device)


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
    counters: torch.Tensor | None = None,  # [>= ARRIVAL_COUNTERS] int32 zeros the caller owns, left zero
    dependent_merge: bool | None = None,  # override (tests): may merge in a dependent launch (union.py)
) -> torch.Tensor:
    total_q, Hq, D = q.shape
    Hkv = kv_cache.shape[1]
    T = topk_idx.shape[2]
    q_per_req = total_q // seq_lens.shape[0]
    if num_splits is None:
        per_sm = BF16_PROGRAMS_PER_SM if fmt is None and block_q == 1 else PROGRAMS_PER_SM
        num_splits, blocks_per_split = split_plan(total_q, Hkv, T, q.device, per_sm)
    else:
        if num_splits > 1 and _rocm(q.device):
            raise ValueError(f"num_splits: decode does not split on ROCm (see the module docstring), got {num_splits}")
        blocks_per_split = triton.cdiv(T, num_splits)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [total_q, Hq, D]
    split_buffers = None
    if not (isinstance(num_splits, int) and num_splits == 1):  # a symbolic count may still be 1 at run time
        o_partial = torch.empty((num_splits, total_q, Hq, D), dtype=q.dtype, device=q.device)
        lse = torch.empty((num_splits, total_q, Hq), dtype=torch.float32, device=q.device)
        count = triton.cdiv(total_q, block_q) * Hkv  # one per (tile, KV head)
        if counters is None:
            arrivals = _arrival_counters(count, q)
        elif isinstance(count, int) and count > counters.shape[0]:  # only an override of the plan gets here
            raise ValueError(
                f"counters: {count} (tile, KV head) counters needed, the workspace has {counters.shape[0]}"
            )
        else:
            arrivals = counters
        split_buffers = (o_partial, lse, arrivals)
    launch_sparse_attn(
        q,
        kv_cache,
        fmt,
        topk_idx,
        block_table,
        None,
        seq_lens,
        sm_scale,
        k_scale,
        v_scale,
        scale_mode,
        out,
        split_buffers,
        q_per_req=q_per_req,
        num_splits=num_splits,
        blocks_per_split=blocks_per_split,
        block_q=block_q,
        dependent_merge=dependent_merge,
    )
    return out
