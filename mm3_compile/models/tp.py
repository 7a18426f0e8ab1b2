"""Tensor parallelism for the M3 layers: how each weight is sharded and how partial sums are reduced.

Sharding follows the real deployment:

* attention: q heads split ``Hq/tp`` per rank; KV heads split ``Hkv/tp`` per rank, or **replicated** when
  ``tp > Hkv`` (rank r holds KV head ``r * Hkv // tp``, the one its q heads use); index heads follow the KV
  heads; the single shared index-K head is replicated; ``o_proj`` is row-parallel (sum over ranks).
* MLPs and MoE experts: column/row split of the intermediate dimension (gate and up columns, down rows) on
  every rank; the router (fp32 gate + correction bias) is replicated so every rank routes identically; one
  all-reduce after ``down`` sums the routed experts and the shared expert together.
* embedding, final norm and LM head are replicated.

Partial sums are reduced with ``torch.distributed._functional_collectives.all_reduce``: a functional op that
Dynamo traces, so a ``torch.compile(fullgraph=True)`` graph contains the collective (no graph break) and
Inductor schedules its wait.

Running on GPUs with NCCL (one process per GPU, e.g. ``torchrun --nproc-per-node 8 script.py``)::

    import os, torch, torch.distributed as dist
    from mm3_compile.models import MiniMaxM3Config, build_model, PagedKVRuntime, run_demo_workload

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # the GPU of this process on its node
    config = MiniMaxM3Config.m3_1layer()
    # every rank builds the same full random weights from the seed and keeps its shard
    model = build_model(config, seed=0, device="cuda", dtype=torch.bfloat16, group=dist.group.WORLD)
    runtime = PagedKVRuntime(model, num_blocks=512, max_blocks_per_request=64, kv_cache_dtype="fp8")
    result = run_demo_workload(model, runtime, batch=4, prompt_lens=2048, steps=8, compiled=True)
    dist.destroy_process_group()

With NCCL leave NVLink multicast (``NCCL_NVLS_ENABLE``) at the machine's default off; plain ring/tree
all-reduce is what these sizes need.  The CPU tests run the same code with the gloo backend.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


@dataclasses.dataclass(frozen=True)
class TPInfo:
    """This rank's place in the tensor-parallel group (``group=None``: no parallelism)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None) -> TPInfo:
        if group is None:
            return cls()
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the group (identity without a group); traceable by Dynamo."""
        if self.group is None or self.size == 1:
            return x
        return funcol.all_reduce(x, "sum", self.group)


def split_count(total: int, tp: TPInfo, what: str, multiple: int = 1) -> int:
    """This rank's share of ``total``; it must come out a multiple of ``multiple`` (MXFP8 blocks: 32)."""
    if total % (tp.size * multiple):
        raise ValueError(
            f"{what} ({total}) must split into tensor-parallel shares ({tp.size}) that are multiples of {multiple}"
            if multiple > 1
            else f"{what} ({total}) must be divisible by the tensor-parallel size ({tp.size})"
        )
    return total // tp.size


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """Per-rank attention head counts and the global head ranges this rank keeps."""

    num_q_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @classmethod
    def for_rank(cls, num_q_heads: int, num_kv_heads: int, tp: TPInfo) -> HeadShard:
        q_local = split_count(num_q_heads, tp, "num_attention_heads")
        if tp.size <= num_kv_heads:
            kv_local = split_count(num_kv_heads, tp, "num_key_value_heads")
            kv_start = tp.rank * kv_local
        else:
            # more ranks than KV heads: each rank keeps a copy of the one KV head its q heads belong to
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor-parallel size {tp.size} must be a multiple of num_key_value_heads")
            kv_local = 1
            kv_start = tp.rank * num_kv_heads // tp.size
        return cls(q_local, kv_local, tp.rank * q_local, kv_start)


def shard_rows(w: torch.Tensor, start: int, count: int, dim: int = 0) -> torch.Tensor:
    return w.narrow(dim, start, count)


def shard_heads(w: torch.Tensor, head_dim: int, start: int, count: int, dim: int = 0) -> torch.Tensor:
    """Rows (or columns) of heads ``[start, start+count)`` of a weight laid out head-major along ``dim``."""
    return w.narrow(dim, start * head_dim, count * head_dim)


def shard_gate_up(w: torch.Tensor, tp: TPInfo, dim: int) -> torch.Tensor:
    """Column split of a split-layout ``[gate | up]`` weight: this rank's gate columns then its up columns."""
    gate, up = w.chunk(2, dim=dim)
    local = split_count(gate.shape[dim], tp, "intermediate size")
    return torch.cat([gate.narrow(dim, tp.rank * local, local), up.narrow(dim, tp.rank * local, local)], dim=dim)


def shard_down(w: torch.Tensor, tp: TPInfo, dim: int) -> torch.Tensor:
    """Row-parallel split of a down projection along its input (intermediate) dimension."""
    local = split_count(w.shape[dim], tp, "intermediate size")
    return w.narrow(dim, tp.rank * local, local)
