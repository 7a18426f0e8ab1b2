"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket, over static metadata buffers.

Serving runs decode as graph replays: the launch cost of a step's ~100 kernels is paid once at capture.
A graph replays fixed addresses and fixed shapes, so everything a step reads must live in buffers
that never move, and everything that varies must be a value inside them:

* **Capture sizes** (``batch_sizes``, default 1, 2, 4, 8, 16, 32, ...): a batch of B requests
  replays the graph of the smallest bucket >= B; the rows past B are padding requests (``seq_len``
  0: the attention kernels return zeros for them; slot -1: the cache writes skip them; position 0,
  token 0, block-table row of zeros).  Their outputs are computed and ignored.
* **Static buffers** (allocated once, for the largest bucket; a bucket's metadata are views of their
  first rows): ``input_ids``, ``positions``, ``slot_mapping`` (int64) and ``seq_lens``,
  ``cu_seqlens_q``, ``block_table`` (int32).  Each step the host writes the new values (from
  :class:`~mm3_compile.models.runtime.PagedKVRuntime`'s bookkeeping) into a pinned mirror; the
  copies into the device buffers are nodes of each captured graph (six host copy calls per step were
  most of a single-request step's host time), so a step is numpy writes and one replay.  While a
  step runs on the device, the host stages the next step's metadata (the runtime as it is, one token
  more per request); that step then writes only its token ids, unless the runtime changed otherwise
  in between (a new page, other requests, a row's pages changed: it stages afresh).  No device tensor
  is created per step.  The host runs at most one step ahead of the device: before overwriting the
  pinned mirror it waits, through an external event that the graph records after its copies, for a
  replay's copies to have left it, and those copies follow the previous step's kernels in stream order.  ``cu_seqlens_q`` (one token per row) is constant.  The KV
  and index caches are the runtime's own tensors (fixed addresses; reallocating them invalidates the
  graphs).  The top-k block lists are
  intermediate buffers of the graph, rewritten by every replay; the outputs returned by
  :meth:`GraphedDecode.step` are views of the graph's static outputs, overwritten by the next
  replay (copy what you keep).
* **Shape-derived choices stay valid**: the decode split count and pipeline depth depend only on
  shapes and the SM count (``kernels/sparse_attn/decode.py``), so a bucket's graph is right for
  every batch it serves.  The compiled step is traced once with dynamic token/request counts
  (:func:`~mm3_compile.models.runtime.compile_model`); each bucket runs it once on a side stream
  before its capture, so compilation and autotuning never happen inside a capture.
* **Arrival counters** (split-K decode): the kernels need them zero on entry and the merging
  program zeroes them again.  A compiled step allocates and zeroes its own counters inside the
  graph (one small memset node per replay), so graphs of compiled steps are independent.  Graphs
  of *eager* decode calls captured after an eager call on the default stream instead share the
  device's one counter buffer (no memset): such graphs must not replay concurrently with each
  other, or with an eager decode call on the default stream, on another stream.  This module
  captures compiled steps only.
* No host sync inside the step: ``check_uniform_decode`` reads values only on CPU tensors or with
  ``MM3_VALIDATE=1`` (a sync, which a capture refuses: leave it off for graphs).

On the CPU there are no CUDA graphs: :class:`GraphedDecode` runs the same step function on the same
static buffers (the bucket and buffer logic is tested there), without replays.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import torch

from mm3_compile.contract import PAGE_SIZE
from mm3_compile.models.attention import AttentionMetadata
from mm3_compile.models.model import MiniMaxM3ForCausalLM
from mm3_compile.models.runtime import PagedKVRuntime, write_block_table

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def bucket_for(batch: int, batch_sizes: Sequence[int]) -> int:
    """The smallest capture size (``batch_sizes`` sorted ascending) that holds ``batch`` requests."""
    i = bisect.bisect_left(batch_sizes, batch)
    if batch < 1 or i == len(batch_sizes):
        raise ValueError(f"batch: expected 1..{batch_sizes[-1]} requests (the largest capture size), got {batch}")
    return batch_sizes[i]


class StaticDecodeBuffers:
    """The device buffers a captured decode step reads, sized for ``max_batch`` requests, and their pinned
    host mirror.  ``views(bucket)`` are views of their first rows: fixed addresses for every step.

    One tensor per field (not one packed buffer): inputs that alias each other would make the compiled
    step guard on, and be traced for, their overlap."""

    FIELDS: ClassVar[dict[str, torch.dtype]] = {
        "input_ids": torch.int64,
        "positions": torch.int64,
        "slot_mapping": torch.int64,
        "seq_lens": torch.int32,
        "cu_seqlens_q": torch.int32,
        "block_table": torch.int32,
    }

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device, kv_cache_dtype: str):
        self.max_batch, self.max_blocks, self.device, self.kv_cache_dtype = (
            max_batch,
            max_blocks,
            device,
            kv_cache_dtype,
        )
        shapes = {name: (max_batch,) for name in self.FIELDS}
        shapes["cu_seqlens_q"], shapes["block_table"] = (max_batch + 1,), (max_batch, max_blocks)
        pin = device.type == "cuda"
        self.host = {n: torch.zeros(shapes[n], dtype=dt, pin_memory=pin) for n, dt in self.FIELDS.items()}
        # one token per row, padding rows included: every bucket's offsets are a prefix of the same range
        self.host["cu_seqlens_q"].copy_(torch.arange(max_batch + 1, dtype=torch.int32))
        self.dev = {n: torch.zeros(shapes[n], dtype=dt, device=device) for n, dt in self.FIELDS.items()}
        self.dev["cu_seqlens_q"].copy_(self.host["cu_seqlens_q"])  # constant: never uploaded again
        self._copied = torch.cuda.Event(external=True) if pin else None  # recorded after every upload
        self._views: dict[int, tuple[torch.Tensor, AttentionMetadata]] = {}
        self._host_views: dict[int, dict[str, np.ndarray]] = {}  # numpy views of the pinned mirror per bucket
        self.writes = 0  # counts the stage calls: a caller that staged ahead can tell whether it was overwritten

    def views(self, bucket: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """(input_ids [bucket], metadata of ``bucket`` requests), views of the static device buffers."""
        if bucket not in self._views:
            d = {n: t[: bucket + 1 if n == "cu_seqlens_q" else bucket] for n, t in self.dev.items()}
            for t in d.values():  # request counts vary between buckets: one symbolic graph for all
                torch._dynamo.maybe_mark_dynamic(t, 0)
            meta = AttentionMetadata(
                d["positions"],
                d["slot_mapping"],
                d["block_table"],
                d["cu_seqlens_q"],
                d["seq_lens"],
                self.kv_cache_dtype,
            )
            self._views[bucket] = d["input_ids"], meta
        return self._views[bucket]

    def write(
        self,
        bucket: int,
        input_ids: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> None:
        """One decode token per request: request r's values (``seq_lens[r]`` includes the new token,
        ``block_tables[r]`` its pages), rows past them padding; :meth:`stage` then :meth:`upload`."""
        self.stage(bucket, input_ids, seq_lens, block_tables)
        self.upload(bucket)

    def stage(
        self,
        bucket: int,
        input_ids: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> None:
        """The values of :meth:`write` into the pinned host mirror only (a captured graph uploads them itself)."""
        if len(input_ids) != len(seq_lens):
            raise ValueError(f"input_ids: expected one token per seq_len ({len(seq_lens)}), got {len(input_ids)}")
        self.stage_metadata(bucket, seq_lens, block_tables)
        self.stage_ids(bucket, input_ids)

    def stage_metadata(self, bucket: int, seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> None:
        """Everything of :meth:`stage` but the real rows' token ids (padding rows get token 0)."""
        batch = len(seq_lens)
        # numpy on views of the pinned mirror, a few vectorised writes: this host work precedes every replay
        # (per-request torch calls made it the replayed step's bottleneck: bench/NOTES.md)
        counts = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
        lens = np.fromiter(seq_lens, dtype=np.int64, count=batch)
        if len(block_tables) != batch or (batch and int(counts.max()) > self.max_blocks):
            raise ValueError(
                f"block_tables: expected {batch} rows (one per seq_len) of at most {self.max_blocks} pages, "
                f"got {len(block_tables)} rows of up to {int(counts.max()) if batch else 0}"
            )
        if batch and (counts * PAGE_SIZE < lens).any():
            r = int(np.argmax(counts * PAGE_SIZE < lens))
            raise ValueError(
                f"block_tables: request {r} has {int(counts[r])} pages for seq_len {int(lens[r])} "
                f"(needs {-(-int(lens[r]) // PAGE_SIZE)})"
            )
        if self._copied is not None:
            self._copied.synchronize()  # the last upload has left the pinned mirror
        h = self._host(bucket)
        pos = lens - 1  # the new token's position
        # the new token's page, straight from the rows (no fancy index into the table)
        pages = np.fromiter((t[p // PAGE_SIZE] for t, p in zip(block_tables, pos.tolist())), np.int64, batch)
        h["input_ids"][batch:] = 0
        for name, values in (("seq_lens", lens), ("positions", pos)):
            h[name][:batch] = values
            h[name][batch:] = 0
        slots = h["slot_mapping"]
        slots[:batch] = pages * PAGE_SIZE + pos % PAGE_SIZE
        slots[batch:] = -1  # padding rows write nothing
        table = h["block_table"]
        table.fill(0)
        write_block_table(table, block_tables, counts)
        self.writes += 1

    def stage_ids(self, bucket: int, input_ids: Sequence[int] | torch.Tensor) -> None:
        """The real rows' token ids into the mirror, after :meth:`stage_metadata` (which waited for the last
        upload): the rest of the bucket's rows as that call left them."""
        ids = input_ids.numpy() if isinstance(input_ids, torch.Tensor) else np.asarray(input_ids, dtype=np.int64)
        self._host(bucket)["input_ids"][: len(ids)] = ids
        self.writes += 1

    def _host(self, bucket: int) -> dict[str, np.ndarray]:
        h = self._host_views.get(bucket)
        if h is None:
            h = self._host_views[bucket] = {
                n: t[: bucket + 1 if n == "cu_seqlens_q" else bucket].numpy() for n, t in self.host.items()
            }
        return h

    def upload(self, bucket: int) -> None:
        """Copy the bucket's rows of the host mirror into the device buffers (non-blocking; captured into a
        graph, the copies run at each replay)."""
        views = self.views(bucket)
        for name, t in self.host.items():
            if name != "cu_seqlens_q":
                dst = views[0] if name == "input_ids" else getattr(views[1], name)
                dst.copy_(t[: dst.shape[0]], non_blocking=True)
        if self._copied is not None:
            self._copied.record()  # external: inside a capture, a node that each replay records


class GraphedDecode:
    """One-token decode steps of ``runtime``'s requests, replayed from a CUDA graph per batch bucket.

    Args:
        model: the model whose caches ``runtime`` holds.
        runtime: the paged-KV runtime (its requests are started and prefilled by the caller).
        decode_fn: the step function, ``compile_model(model)[1]`` by default (graphs of compiled steps
            zero their own arrival counters, see the module docstring).
        batch_sizes: capture sizes; batches above the largest are refused.
    Returns:
        ``step(input_ids)`` advances every request by one token and returns ``(logits [B, V],
        hiddens, topk)`` for the B running requests: views of the replayed graph's outputs.
    Examples:
        >>> runtime.add_prompts([2048] * 32); prefill(ids, meta, runtime.caches)  # doctest: +SKIP
        >>> graphed = GraphedDecode(model, runtime, batch_sizes=(8, 16, 32))       # doctest: +SKIP
        >>> logits, hiddens, topk = graphed.step(next_tokens)                      # doctest: +SKIP
    """

    def __init__(
        self,
        model: MiniMaxM3ForCausalLM,
        runtime: PagedKVRuntime,
        decode_fn: Callable | None = None,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    ):
        from mm3_compile.models.runtime import compile_model

        sizes = sorted(set(batch_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch_sizes: expected positive capture sizes, got {list(batch_sizes)}")
        self.model, self.runtime, self.batch_sizes = model, runtime, tuple(sizes)
        self.decode_fn = decode_fn if decode_fn is not None else compile_model(model)[1]
        self.buffers = StaticDecodeBuffers(
            sizes[-1], runtime.max_blocks_per_request, runtime.device, runtime.kv_cache_dtype
        )
        self.use_graphs = runtime.device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._pool = None
        self._ahead = None  # (bucket, seq_lens, block table rows, their lengths, mirror writes) staged ahead

    def _run(self, bucket: int):
        ids, meta = self.buffers.views(bucket)
        return self.decode_fn(ids, meta, self.runtime.caches)

    @torch.no_grad()
    def capture(self, buckets: Sequence[int] | None = None) -> None:
        """Capture the graphs of ``buckets`` (default: every capture size), largest first, sharing one
        memory pool.  The static buffers hold padding only while capturing: nothing is written to the
        caches, so capture may happen with requests running."""
        if not self.use_graphs:
            return
        for bucket in sorted(buckets or self.batch_sizes, reverse=True):
            if bucket not in self.batch_sizes:
                raise ValueError(f"buckets: {bucket} is not one of the capture sizes {self.batch_sizes}")
            if bucket in self.graphs:
                continue
            self._write_padding(bucket)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._run(bucket)  # compiles (first bucket) and autotunes outside any capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                # the metadata copies are graph nodes: a step's host work is the mirror's values and one replay
                self.buffers.upload(bucket)
                outputs = self._run(bucket)
            self._pool = graph.pool()
            self.graphs[bucket] = (graph, outputs)

    def _write_padding(self, bucket: int) -> None:
        self.buffers.write(bucket, [], [], [])  # no requests: every row is a padding row

    @torch.no_grad()
    def step(self, input_ids: Sequence[int] | torch.Tensor):
        """Advance every running request by one token (``input_ids[r]`` for request r) and run the step."""
        batch = len(self.runtime.seq_lens)
        if len(input_ids) != batch:
            raise ValueError(f"input_ids: expected one token per running request ({batch}), got {len(input_ids)}")
        bucket = bucket_for(batch, self.batch_sizes)
        if isinstance(input_ids, torch.Tensor) and input_ids.device.type != "cpu":
            raise ValueError(f"input_ids: expected host values (a list or CPU tensor), got a {input_ids.device} tensor")
        self.runtime.advance([1] * batch)
        if self.use_graphs and bucket not in self.graphs:
            self.capture([bucket])
        if self._staged_ahead(bucket):
            self.buffers.stage_ids(bucket, input_ids)
        else:
            self.buffers.stage(bucket, input_ids, self.runtime.seq_lens, self.runtime.block_tables)
        if self.use_graphs:
            graph, outputs = self.graphs[bucket]
            graph.replay()  # uploads the staged values first
        else:
            self.buffers.upload(bucket)
            outputs = self._run(bucket)
        self._stage_ahead(bucket)
        if batch == bucket:  # no padding rows: the outputs as they are (each slice is host time of the step)
            return outputs
        logits, hiddens, topk = outputs
        return logits[:batch], tuple(h[:batch] for h in hiddens), tuple(t[:, :batch] for t in topk)

    def _stage_ahead(self, bucket: int) -> None:
        """The next step's metadata into the mirror while this one runs on the device, for the runtime as
        it is now with one more token per request (that step then stages only its token ids).  Not when a
        request would need a new page (the runtime picks it in that step's ``advance``)."""
        self._ahead = None
        rt = self.runtime
        lens = [n + 1 for n in rt.seq_lens]
        tables = list(rt.block_tables)
        counts = [len(t) for t in tables]
        if any(n > c * PAGE_SIZE for n, c in zip(lens, counts)):
            return
        self.buffers.stage_metadata(bucket, lens, tables)  # waits for this step's uploads to have left the mirror
        # a copy of the rows: a page changed in place (same list, same length) must not pass as predicted
        self._ahead = (bucket, lens, [list(t) for t in tables], self.buffers.writes)

    def _staged_ahead(self, bucket: int) -> bool:
        """Whether the mirror holds this step's metadata: same bucket, nothing staged since, the runtime's
        lengths as predicted and its block-table rows equal to the copy taken when staging (one C-level list
        comparison per row)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return False
        ahead_bucket, lens, rows, writes = ahead
        rt = self.runtime
        return (
            ahead_bucket == bucket
            and writes == self.buffers.writes
            and rt.seq_lens == lens
            and len(rt.block_tables) == len(rows)
            and all(list(a) == b for a, b in zip(rt.block_tables, rows))
        )
