"""Where the time of the indexer, a compiled MoE block and a compiled decode layer step goes, kernel by kernel.

``python bench/kernel_profile.py [--tokens 1,32,128] [--no-layer]``: ``mm3::index_topk`` (decode B1/B32 at 32768 tokens,
prefill 1x8192, Hidx 4, bf16 index cache), the M3 MoE block at the real widths
(``bench/moe.py``'s seeded weights) compiled with ``fullgraph=True`` for each token count, and the
``m3_1layer`` decode step (``--layer-batches``, default B32 and B1, after 2048-token prompts, ``bench/layer.py``'s
workload) compiled as the demo compiles it, afresh per batch. Each is launched (not graph-replayed) under
``torch.profiler`` for ``--iters`` calls after warm-up; per kernel name: launches per call, mean GPU µs per launch, µs per call. The sum of kernel times
against the CUDA-graph replay time of the same call says how much of a replay is launch gaps (a graph still
pays ~2 µs between dependent kernels). Prints markdown tables and writes them to ``$OUT/profile.md``.
"""

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch.profiler import ProfilerActivity, profile

from bench.timing import Timer


def kernel_table(fn, iters: int):
    """Per kernel name: (name, launches per call, µs per call) sorted by time; the launches of one call in
    order with their mean µs; total kernel µs per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for event in events:
        entry = per_name[event.name[:90]]
        entry[0] += 1
        entry[1] += event.device_time
    rows = sorted(((n, c / iters, t / iters) for n, (c, t) in per_name.items()), key=lambda r: -r[2])
    per_call = len(events) // iters
    sequence = [
        (events[i].name[:90], sum(events[j * per_call + i].device_time for j in range(iters)) / iters)
        for i in range(per_call)
    ]
    return rows, sequence, sum(r[2] for r in rows)


def report(title: str, fn, iters: int, lines: list[str]) -> None:
    rows, sequence, total = kernel_table(fn, iters)
    replay = Timer(torch.device("cuda"), quick=True).graph([fn]) * 1e3  # µs per call, calls replayed in one graph
    start = len(lines)
    lines += [
        f"### {title}",
        "",
        f"{len(sequence)} kernels per call, {total:.1f} µs of kernel time; CUDA-graph replay {replay:.1f} µs "
        f"(gaps {replay - total:.1f} µs)",
        "",
        "| kernel | launches/call | µs/launch | µs/call |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{n}` | {c:g} | {t / c:.2f} | {t:.2f} |" for n, c, t in rows[:25]]
    lines += ["", "Launch order (µs):", "", "| # | kernel | µs |", "|---|---|---|"]
    lines += [f"| {i} | `{n[:60]}` | {t:.2f} |" for i, (n, t) in enumerate(sequence)]
    lines.append("")
    print("\n".join(lines[start:]), flush=True)


def moe_rows(tokens: list[int], iters: int, lines: list[str]) -> None:
    from bench.moe import build_block
    from mm3_compile.models import MiniMaxM3Config

    config = MiniMaxM3Config.m3_1layer()
    moe = build_block(torch.device("cuda"), config)
    compiled = torch.compile(moe, fullgraph=True, dynamic=False)
    for T in tokens:
        x = torch.randn(T, config.hidden_size, device="cuda").to(torch.bfloat16)
        with torch.no_grad():
            report(f"MoE block T{T} (compiled)", lambda x=x: compiled(x), iters, lines)
    torch._dynamo.reset()  # the block's weights go with its graphs


def indexer_rows(iters: int, lines: list[str]) -> None:
    """``mm3::index_topk`` on a bf16 index cache: decode B1 / B32 at 32768 tokens and prefill 1x8192, Hidx 4."""
    from mm3_compile.contract import PAGE_SIZE

    gen = torch.Generator(device="cuda").manual_seed(0)
    for B, q_len, seq in ((1, 1, 32768), (32, 1, 32768), (1, 8192, 8192)):
        blocks = seq // PAGE_SIZE
        k = torch.randn(B * blocks, PAGE_SIZE, 128, device="cuda", generator=gen).to(torch.bfloat16)
        q = torch.randn(B * q_len, 4, 128, device="cuda", generator=gen).to(torch.bfloat16)
        table = torch.randperm(B * blocks, device="cuda", generator=gen).view(B, blocks).to(torch.int32)
        cu = torch.arange(B + 1, dtype=torch.int32, device="cuda") * q_len
        seq_lens = torch.full((B,), seq, dtype=torch.int32, device="cuda")

        def call(q=q, k=k, table=table, cu=cu, seq_lens=seq_lens):
            return torch.ops.mm3.index_topk(q, k, table, cu, seq_lens, 16, 0, 1)

        report(f"index_topk B{B} q_len {q_len} seq {seq} Hidx 4 (eager op)", call, iters, lines)


def layer_rows(iters: int, lines: list[str], batches: list[int]) -> None:
    """The compiled decode step per batch size, each compiled afresh with that batch traced first (the kernels'
    schedules follow the traced sizes)."""
    from bench.layer import _workload
    from mm3_compile.contract import PAGE_SIZE

    class _Ctx:
        cuda, device = True, torch.device("cuda")

    config, model, _, _, prompt, steps = _workload(_Ctx)
    blocks = -(-(prompt + steps) // PAGE_SIZE) + 1
    for batch in batches:
        _layer_step(model, config, prompt, blocks, batch, iters, lines)


def _layer_step(model, config, prompt: int, blocks: int, batch: int, iters: int, lines: list[str]) -> None:
    """One batch size's decode step, plus the host time of the static-buffer write that precedes each replay in
    :class:`GraphedDecode` (the layer bench's graph rows include it)."""
    import time

    from mm3_compile.models import PagedKVRuntime, compile_model
    from mm3_compile.models.graphs import GraphedDecode
    from mm3_compile.models.runtime import workload_tokens

    runtime = PagedKVRuntime(model, num_blocks=batch * blocks, max_blocks_per_request=blocks)
    torch._dynamo.reset()
    fns = compile_model(model)
    lens = [prompt] * batch
    prompts, decode_tokens = workload_tokens(config.vocab_size, lens, 1, seed=0)  # the demo's random tokens
    runtime.reset()
    with torch.no_grad():
        fns[0](torch.cat(prompts).to(runtime.device), runtime.add_prompts(lens), runtime.caches)
        graphed = GraphedDecode(model, runtime, decode_fn=fns[1], batch_sizes=(batch,))
        runtime.advance([1] * batch)

        def write():
            graphed.buffers.write(batch, decode_tokens[0], runtime.seq_lens, runtime.block_tables)

        write()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(iters):
            write()
        torch.cuda.synchronize()
        host_us = (time.perf_counter() - started) / iters * 1e6
        report(f"m3-1layer decode step B{batch} after {prompt} (compiled)", lambda: graphed._run(batch), iters, lines)
    lines += [f"Host write of the static buffers before a replay: {host_us:.1f} µs", ""]
    print(lines[-2], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,32,128")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-layer", action="store_true")
    parser.add_argument("--layer-batches", default="32,1", help="decode step batch sizes")
    args = parser.parse_args()
    lines: list[str] = [f"# Kernel profile ({torch.cuda.get_device_name()}, torch {torch.__version__})", ""]
    import mm3_compile  # noqa: F401 (registers the ops)

    indexer_rows(args.iters, lines)
    moe_rows([int(t) for t in args.tokens.split(",") if t], args.iters, lines)
    if not args.no_layer:
        layer_rows(args.iters, lines, [int(b) for b in args.layer_batches.split(",") if b])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
