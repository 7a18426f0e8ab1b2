"""A small paged-KV runtime: cache allocation, block allocation, per-step metadata, the demo workload.

Host-side bookkeeping (which pages a request owns) is plain Python, like a serving scheduler; everything the
model sees is a device tensor (:class:`AttentionMetadata`), so the compiled graphs do not depend on batch
size, prompt lengths or positions.  Pages are handed out in a seeded shuffled order so block tables really
indirect (logical block i of a request is rarely page i).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from mm3_compile import dynamic_shapes, platform
from mm3_compile.contract import PAGE_SIZE
from mm3_compile.models.attention import AttentionMetadata, check_uniform_decode, write_index_cache
from mm3_compile.models.model import MiniMaxM3ForCausalLM


def write_block_table(
    table: np.ndarray, block_tables: Sequence[Sequence[int]], counts: np.ndarray | None = None
) -> None:
    """Rows ``0 .. R-1`` of ``table`` ([>= R, max_blocks], zero past each row's pages on entry) take
    ``block_tables[r]``, in one masked write: host work that precedes every decode step, where per-row torch
    calls were the step's bottleneck.  ``counts``: the rows' lengths, where the caller has them already."""
    rows = len(block_tables)
    if counts is None:
        counts = np.fromiter(map(len, block_tables), dtype=np.int64, count=rows)
    filled = np.arange(table.shape[1]) < counts[:, None]  # row-major, like the chained rows
    table[:rows][filled] = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=table.dtype)


class PagedKVRuntime:
    """Paged caches for every attention layer of ``model`` and the block tables of a batch of requests.

    * main cache per layer: ``[num_blocks, Hkv_local, 128, 2*D]`` in the dtype the authority resolves for
      ``kv_cache_dtype`` on the model's device, FP8 caches typed in the authority's flavour (so the ops
      refuse them where the authority answers another flavour, e.g. after switching emulation targets).
    * index-K cache per sparse layer: ``[num_blocks, 1, 128, Didx]`` (one shared head) in the dtype the authority
      resolves for ``index_cache_dtype`` (default: the config's; "auto" = model dtype, "fp8" = its e4m3 flavour).
    Both caches of a layer use the same pages (one block table, one slot mapping).

    Args:
        model: the model whose layers get caches (its device, dtype and TP shard decide their shapes).
        num_blocks: pages per cache (128 tokens each); max_blocks_per_request: the block table's width.
        kv_cache_dtype: ``"auto"`` (model dtype), ``"fp8"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
        seed: seeds the random page assignment (pages are handed out in a shuffled order, like a real pool).
        index_cache_dtype: ``"auto"`` or ``"fp8"``; default: ``model.config.index_cache_dtype``.

    Examples:
        >>> model = build_model(MiniMaxM3Config.tiny(), seed=0)
        >>> runtime = PagedKVRuntime(model, num_blocks=16, max_blocks_per_request=4, kv_cache_dtype="fp8")
        >>> kv, index = runtime.caches[1]  # layer 1 is sparse: [16, Hkv, 128, 2D] fp8, [16, 1, 128, Didx]
    """

    def __init__(
        self,
        model: MiniMaxM3ForCausalLM,
        num_blocks: int,
        max_blocks_per_request: int,
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        index_cache_dtype: str | None = None,
    ):
        cfg = model.config
        self.index_cache_dtype = cfg.index_cache_dtype if index_cache_dtype is None else index_cache_dtype
        index_dtype = platform.resolve_kv_cache_dtype(self.index_cache_dtype, model.device, model.dtype)
        self.model_dtype, self.device = model.dtype, model.device
        self.kv_cache_dtype = kv_cache_dtype
        self.storage_dtype = platform.resolve_kv_cache_dtype(kv_cache_dtype, self.device, model.dtype)
        self.num_blocks, self.max_blocks_per_request = num_blocks, max_blocks_per_request
        self.caches: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for layer in model.layers:
            hkv = layer.attn.heads.num_kv_heads
            # typed in the authority's FP8 flavour (not bytes): the ops then refuse a cache of another flavour
            kv = torch.zeros(num_blocks, hkv, PAGE_SIZE, 2 * cfg.head_dim, dtype=self.storage_dtype, device=self.device)
            index = None
            if layer.sparse:
                index_shape = (num_blocks, 1, PAGE_SIZE, cfg.index_head_dim)
                index = torch.zeros(index_shape, dtype=index_dtype, device=self.device)
            self.caches.append((kv, index))
        self._rng = random.Random(seed)
        self.reset()

    def reset(self) -> None:
        """Forget every request and zero the caches."""
        pages = list(range(self.num_blocks))
        self._rng.shuffle(pages)
        self.free_pages = pages
        self.block_tables: list[list[int]] = []
        self.seq_lens: list[int] = []
        for kv, index in self.caches:
            kv.zero_()
            if index is not None:
                index.zero_()

    def _grow(self, r: int, new_len: int) -> None:
        while len(self.block_tables[r]) < -(-new_len // PAGE_SIZE):
            self.block_tables[r].append(self.free_pages.pop())

    def _metadata(self, q_lens: Sequence[int]) -> AttentionMetadata:
        q = np.fromiter(q_lens, dtype=np.int64, count=len(q_lens))
        lens = np.fromiter(self.seq_lens, dtype=np.int64, count=len(self.seq_lens))
        table = np.zeros((len(q_lens), self.max_blocks_per_request), dtype=np.int32)
        write_block_table(table, self.block_tables)
        # the q_len[r] new tokens of request r sit at positions seq_len[r] - q_len[r] ... seq_len[r] - 1
        req = np.repeat(np.arange(len(q)), q)
        positions = np.arange(req.size) - np.repeat(np.cumsum(q) - q, q) + np.repeat(lens - q, q)
        slots = table[req, positions // PAGE_SIZE].astype(np.int64) * PAGE_SIZE + positions % PAGE_SIZE
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(q)]).astype(np.int32))
        meta = AttentionMetadata(
            positions=torch.from_numpy(positions).to(self.device),
            slot_mapping=torch.from_numpy(slots).to(self.device),
            block_table=torch.from_numpy(table).to(self.device),
            cu_seqlens_q=cu.to(self.device),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=self.device),
            kv_cache_dtype=self.kv_cache_dtype,
        )
        # token and request counts vary between steps: keep them symbolic in compiled graphs
        for t in (meta.positions, meta.slot_mapping, meta.block_table, meta.cu_seqlens_q, meta.seq_lens):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return meta

    def start_requests(self, num_requests: int) -> None:
        """Open ``num_requests`` empty requests (pages are allocated as they grow)."""
        if self.block_tables:
            raise RuntimeError("requests already running; call reset() first")
        self.block_tables = [[] for _ in range(num_requests)]
        self.seq_lens = [0] * num_requests

    def extend(self, q_lens: Sequence[int]) -> AttentionMetadata:
        """Append ``q_lens[r]`` tokens to request r (prefill chunk or decode); metadata for that step.

        Everything is checked before anything changes: a refused step leaves the runtime as it was."""
        self.advance(q_lens)
        return self._metadata(q_lens)

    def advance(self, q_lens: Sequence[int]) -> None:
        """The bookkeeping of :meth:`extend` without building device metadata (for callers that keep
        their own static buffers, e.g. :class:`mm3_compile.models.graphs.GraphedDecode`)."""
        if len(q_lens) != len(self.seq_lens):
            raise ValueError(
                f"q_lens: expected one entry per running request ({len(self.seq_lens)}), got {len(q_lens)}"
            )
        if any(q_len < 0 for q_len in q_lens):
            raise ValueError(f"q_lens: expected counts >= 0, got {list(q_lens)}")
        new_lens = [seq_len + q_len for seq_len, q_len in zip(self.seq_lens, q_lens)]
        new_pages = 0
        for r, new_len in enumerate(new_lens):
            needed = -(-new_len // PAGE_SIZE)
            if needed > self.max_blocks_per_request:
                raise ValueError(
                    f"request {r} needs {needed} blocks for {new_len} tokens, more than max_blocks_per_request="
                    f"{self.max_blocks_per_request}"
                )
            new_pages += max(0, needed - len(self.block_tables[r]))
        if new_pages > len(self.free_pages):
            raise RuntimeError(
                f"out of KV pages: the step needs {new_pages}, {len(self.free_pages)} are free "
                f"(num_blocks={self.num_blocks})"
            )
        for r, new_len in enumerate(new_lens):
            self.seq_lens[r] = new_len
            self._grow(r, new_len)

    def add_prompts(self, prompt_lens: Sequence[int]) -> AttentionMetadata:
        """Start one request per prompt; metadata for their prefill."""
        self.start_requests(len(prompt_lens))
        return self.extend(prompt_lens)

    def decode_step(self, tokens_per_request: int = 1) -> AttentionMetadata:
        """Extend every request by the same number of tokens (uniform decode); metadata for that step."""
        return self.extend([tokens_per_request] * len(self.seq_lens))

    @torch.no_grad()
    def load_prefix(self, model: MiniMaxM3ForCausalLM, history: Sequence[Sequence[dict]]) -> None:
        """Start requests whose first tokens are already cached, from full-head K/V histories.

        ``history[layer][r]`` holds ``k``/``v`` ``[L_r, Hkv, D]`` and (sparse layers) ``ik`` ``[L_r, Didx]``
        (e.g. :attr:`ReferenceModel.history`); this rank's KV heads are written through ``mm3::kv_cache_write``.
        Lets tests start a step with several blocks of context without paying for a long prefill.
        """
        lens = [0 if h["k"] is None else h["k"].shape[0] for h in history[0]]
        self.start_requests(len(lens))
        meta = self.extend(lens)
        for layer, (kv, index), per_request in zip(model.layers, self.caches, history):
            heads = layer.attn.heads
            k = torch.cat([h["k"] for h in per_request if h["k"] is not None])  # [sum L, Hkv, D]
            v = torch.cat([h["v"] for h in per_request if h["v"] is not None])
            k, v = (t.narrow(1, heads.kv_start, heads.num_kv_heads).to(self.device, self.model_dtype) for t in (k, v))
            torch.ops.mm3.kv_cache_write(k.contiguous(), v.contiguous(), kv, meta.slot_mapping, self.kv_cache_dtype)
            if index is not None:
                ik = torch.cat([h["ik"] for h in per_request if h["ik"] is not None])
                scale = layer.attn.index_k_scale(index.dtype) if platform.is_fp8(index.dtype) else None
                write_index_cache(index, ik.to(self.device, self.model_dtype)[:, None], meta.slot_mapping, scale)


@dataclasses.dataclass
class StepResult:
    kind: str  # "prefill" | "decode"
    q_lens: list[int]
    input_ids: torch.Tensor  # [T] int64 (CPU)
    logits: torch.Tensor  # [T, V] fp32 (CPU)
    hiddens: tuple[torch.Tensor, ...]  # residual stream at each sub-block boundary, [T, H] (CPU, model dtype)
    topk: tuple[torch.Tensor, ...]  # per sparse layer [Hkv, T, topk] int32 (CPU)
    seconds: float


@dataclasses.dataclass
class WorkloadResult:
    steps: list[StepResult]
    prompt_lens: list[int]

    @property
    def logits(self) -> list[torch.Tensor]:
        return [s.logits for s in self.steps]


def workload_tokens(vocab_size: int, prompt_lens: Sequence[int], steps: int, seed: int):
    """Seeded prompts and the tokens fed at each decode step (teacher forcing: eager, compiled and
    reference runs see identical inputs however their logits differ)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(vocab_size, (n,), generator=gen) for n in prompt_lens]
    decode = torch.randint(vocab_size, (steps, len(prompt_lens)), generator=gen)
    return prompts, decode


def compile_model(model: MiniMaxM3ForCausalLM, backend: str = "inductor", **kwargs):
    """(prefill, decode) callables compiled with ``fullgraph=True``: one graph each, no recompiles when token
    or request counts change (the token dim of ``input_ids`` is marked dynamic like the metadata's).

    Args:
        model: the model to compile (``model.prefill`` and ``model.decode``).
        backend: the ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, ...).
        **kwargs: more ``torch.compile`` arguments.

    Returns:
        ``(prefill, decode)``, each called as ``fn(input_ids, meta, caches)`` like the model's methods; they
        refuse a call under another (real or emulated) FP8 platform than their first.

    Examples:
        >>> prefill, decode = compile_model(model)  # doctest: +SKIP
        >>> logits, hiddens, topk = prefill(input_ids, meta, runtime.caches)  # doctest: +SKIP
    """

    def dynamic_tokens(compiled, check=None):
        traced_for = []

        def call(input_ids, meta, caches):
            # Graphs bake in the FP8 formats (MXFP8 activations) of the platform they were traced for,
            # and nothing guards on them: refuse a call under another (real or emulated) platform.
            current = platform.platform_for(input_ids.device)
            if traced_for and traced_for[0] != current:
                raise RuntimeError(
                    f"compiled model: traced for platform {traced_for[0].target!r}, called under {current.target!r} "
                    "(platform.emulate changed); compile again for it"
                )
            traced_for[:] = [current]
            if check is not None:
                check(meta)
            torch._dynamo.maybe_mark_dynamic(input_ids, 0)
            # batch 1 / 1-token prefills share the graph too (no 0/1 specialisation), and can be traced first
            with dynamic_shapes(input_ids.shape[0]):
                return compiled(input_ids, meta, caches)

        return call

    options = dict(fullgraph=True, backend=backend, **kwargs)
    prefill = torch.compile(model.prefill, **options)
    decode = torch.compile(model.decode, **options)
    return dynamic_tokens(prefill), dynamic_tokens(decode, check_uniform_decode)


def run_demo_workload(
    model: MiniMaxM3ForCausalLM,
    runtime: PagedKVRuntime,
    batch: int,
    prompt_lens: int | Sequence[int],
    steps: int,
    compiled: bool | tuple[Callable, Callable] = False,
    *,
    seed: int = 0,
    backend: str = "inductor",
    on_step: Callable[[StepResult], None] | None = None,
) -> WorkloadResult:
    """Prefill ``batch`` prompts then ``steps`` uniform decode steps (1 token per request).

    ``prompt_lens``: one length for all or one per request.  ``compiled``: False (eager), True (compile here
    with ``backend``) or a ``(prefill, decode)`` pair from :func:`compile_model` (to reuse compiled code).
    The runtime is reset first.  ``on_step`` sees each :class:`StepResult` (progress bars).
    """
    lens = [prompt_lens] * batch if isinstance(prompt_lens, int) else list(prompt_lens)
    if len(lens) != batch:
        raise ValueError(f"prompt_lens: expected {batch} lengths, got {len(lens)}")
    if compiled is True:
        prefill_fn, decode_fn = compile_model(model, backend)
    elif compiled:
        prefill_fn, decode_fn = compiled
    else:
        prefill_fn, decode_fn = model.prefill, model.decode
    prompts, decode_tokens = workload_tokens(model.config.vocab_size, lens, steps, seed)
    runtime.reset()
    results = []
    with torch.no_grad():
        for step in range(steps + 1):
            if step == 0:
                kind, ids, meta, fn = "prefill", torch.cat(prompts), runtime.add_prompts(lens), prefill_fn
            else:
                kind, ids, meta, fn = "decode", decode_tokens[step - 1], runtime.decode_step(), decode_fn
            ids_dev = ids.to(runtime.device)
            _sync(runtime.device)
            start = time.perf_counter()
            logits, hiddens, topk = fn(ids_dev, meta, runtime.caches)
            _sync(runtime.device)
            seconds = time.perf_counter() - start
            q_lens = lens if step == 0 else [1] * batch
            result = StepResult(
                kind, q_lens, ids, logits.cpu(), tuple(h.cpu() for h in hiddens), tuple(t.cpu() for t in topk), seconds
            )
            results.append(result)
            if on_step is not None:
                on_step(result)
    return WorkloadResult(results, lens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
