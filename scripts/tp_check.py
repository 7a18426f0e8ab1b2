"""Tensor-parallel check of the compiled M3 model: TP=N (this torchrun job) against TP=1 on the same weights.

    torchrun --nproc-per-node 8 scripts/tp_check.py --config m3_1layer --batch 32 --prompt 2048 --steps 8
    torchrun --nproc-per-node 2 scripts/tp_check.py --config tiny --batch 2 --prompt 40 --steps 2 --backend eager

Every rank builds the model's shard from the same seeded full weights (``group=dist.group.WORLD``),
compiles prefill and decode with ``fullgraph=True`` and runs the demo workload (prefill, then
one-token decode steps); rank 0 then runs the unsharded TP=1 model eagerly on the same inputs and
compares.  Backend: NCCL on GPUs (one process per GPU, NVLink multicast kept off: NCCL_NVLS_ENABLE=0
and the variables beside it), gloo on the CPU.  Reported (rank 0; JSON with ``--out``):

* graph breaks (expected 0) and recompiles (frames compiled beyond the prefill and decode graphs,
  expected 0), and the collectives in the two compiled FX graphs (2 all-reduces per layer);
* agreement per token: max |logits TP=N - TP=1| over the vocabulary, relative to max |logits TP=1|.
  Sharded bf16 partial sums reduce in another order, a few bf16 ulps; tests/models/test_tp.py bounds
  settled tokens at 5e-2 and the median at 3e-2.  A token whose router is near-tied may pick another
  expert (a whole expert's difference), so up to 1/16 of the tokens may exceed 5e-2 (the bench's
  rule; this script runs no reference to find the near-ties);
* step times (synchronised, median of the decode steps after the first), TP=N compiled and TP=1
  eager, and with ``--graph`` (GPU) the TP=N decode step replayed from a CUDA graph.
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

# NVLink multicast off before NCCL or torch.distributed reads the environment (shared GPUs, see the device notes)
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

import torch
import torch.distributed as dist

import mm3_compile  # noqa: F401  (registers torch.ops.mm3.*)
from mm3_compile.contract import PAGE_SIZE
from mm3_compile.models import (
    MiniMaxM3Config,
    PagedKVRuntime,
    build_model,
    compile_model,
    random_full_state,
    run_demo_workload,
)

SETTLED_TOL, MEDIAN_TOL, FLIPPED_SHARE = 5e-2, 3e-2, 1 / 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", help="MiniMaxM3Config preset (tiny, m3_1layer, ...)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt", type=int, default=40, help="tokens per prompt")
    p.add_argument("--steps", type=int, default=2, help="decode steps after the prefill")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (eager: the traced FX graph as is)")
    p.add_argument("--graph", action="store_true", help="GPU: also time the decode step replayed from a CUDA graph")
    p.add_argument(
        "--no-rerun", action="store_true", help="compare and time the compiling run itself (CI: one run, not timed)"
    )
    p.add_argument("--out", default=None, help="rank 0 writes the report here as JSON")
    return p.parse_args(argv)


def collectives(graphs) -> dict[str, int]:
    """Collective ops (c10d functional) in the compiled FX graphs, by name."""
    found = collections.Counter()
    for gm in graphs:
        for node in gm.graph.nodes:
            name = str(node.target)
            if node.op == "call_function" and ("c10d_functional" in name or "all_reduce" in name):
                found[name] += 1
    return dict(found)


def decode_ms(result) -> float:
    decode = [s.seconds for s in result.steps[2:]] or [s.seconds for s in result.steps[1:]]
    return 1e3 * statistics.median(decode)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    config = MiniMaxM3Config.preset(args.config)
    blocks = -(-(args.prompt + args.steps) // PAGE_SIZE) + 1
    state = random_full_state(config, seed=0, device=device)  # identical on every rank of a device type

    def runtime_for(model):
        return PagedKVRuntime(model, args.batch * blocks, blocks, kv_cache_dtype=args.kv_cache_dtype)

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        if args.backend == "eager":
            return gm.forward
        return torch._dynamo.lookup_backend(args.backend)(gm, example_inputs)

    torch._dynamo.utils.counters.clear()
    model = build_model(config, seed=0, device=device, group=dist.group.WORLD, state=state)
    runtime = runtime_for(model)
    fns = compile_model(model, backend=capture)
    first = run_demo_workload(model, runtime, args.batch, args.prompt, args.steps, compiled=fns)  # compiles
    tp_n = (
        first if args.no_rerun else run_demo_workload(model, runtime, args.batch, args.prompt, args.steps, compiled=fns)
    )
    graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    frames = len(graphs)
    graph_ms = None
    if args.graph and cuda:
        from mm3_compile.models.graphs import GraphedDecode
        from mm3_compile.models.runtime import workload_tokens

        prompts, tokens = workload_tokens(config.vocab_size, [args.prompt] * args.batch, args.steps, seed=0)
        runtime.reset()
        with torch.no_grad():
            meta = runtime.add_prompts([args.prompt] * args.batch)
            fns[0](torch.cat(prompts).to(device), meta, runtime.caches)
        graphed = GraphedDecode(model, runtime, decode_fn=fns[1], batch_sizes=(args.batch,))
        graphed.capture()
        times = []
        for step in range(args.steps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            graphed.step(tokens[step])
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        graph_ms = 1e3 * statistics.median(times[1:] or times)
    dist.barrier()

    ok = True
    if rank == 0:
        del model, runtime
        reference = build_model(config, seed=0, device=device, state=state)  # TP=1, unsharded
        tp_1 = run_demo_workload(reference, runtime_for(reference), args.batch, args.prompt, args.steps)
        per_token = torch.cat(
            [(a.logits - b.logits).abs().amax(-1) / b.logits.abs().max() for a, b in zip(tp_n.steps, tp_1.steps)]
        )  # [all tokens of all steps]
        flipped = float((per_token >= SETTLED_TOL).float().mean())
        median = float(per_token.median())
        found = collectives(graphs)
        all_reduces = sum(n for name, n in found.items() if "all_reduce" in name)
        checks = {
            "graph_breaks == 0": graph_breaks == 0,
            "recompiles == 0": frames == 2,
            "all_reduces == 2 per layer per graph": all_reduces == 2 * 2 * config.num_hidden_layers,
            f"median per-token error < {MEDIAN_TOL}": median < MEDIAN_TOL,
            f"tokens >= {SETTLED_TOL}: at most {FLIPPED_SHARE:.1%}": flipped <= FLIPPED_SHARE,
        }
        ok = all(checks.values())
        report = {
            "world_size": world,
            "backend": dist.get_backend(),
            "device": str(device),
            "config": args.config,
            "batch": args.batch,
            "prompt": args.prompt,
            "steps": args.steps,
            "compile_backend": args.backend,
            "graph_breaks": graph_breaks,
            "recompiles": frames - 2,
            "collectives": found,
            "per_token_max": float(per_token.max()),
            "per_token_median": median,
            "tokens_over_tol": flipped,
            "decode_ms_tp_n_compiled": decode_ms(tp_n),
            "decode_ms_tp_1_eager": decode_ms(tp_1),
            "prefill_ms_tp_n_compiled": 1e3 * tp_n.steps[0].seconds,
            "first_run_s": sum(s.seconds for s in first.steps),
            "decode_ms_tp_n_graph": graph_ms,
            "checks": checks,
            "ok": ok,
        }
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        print(f"TP={world} ({dist.get_backend()}, {device}) vs TP=1, {args.config} B{args.batch} prompt {args.prompt}")
        for key in (
            "graph_breaks",
            "recompiles",
            "collectives",
            "per_token_max",
            "per_token_median",
            "tokens_over_tol",
        ):
            print(f"  {key:24s} {report[key]}")
        for key in (
            "decode_ms_tp_n_compiled",
            "decode_ms_tp_n_graph",
            "decode_ms_tp_1_eager",
            "prefill_ms_tp_n_compiled",
        ):
            value = report[key]
            print(f"  {key:24s} {'-' if value is None else f'{value:.3f}'}")
        for name, passed in checks.items():
            print(f"  {'PASS' if passed else 'FAIL'} {name}")
    status = torch.tensor([0 if ok else 1], device=device)  # NCCL broadcasts device tensors
    dist.broadcast(status, 0)
    dist.destroy_process_group()
    return int(status.item())


if __name__ == "__main__":
    sys.exit(main())
