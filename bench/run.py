"""mm3_compile benchmarks: ``python bench/run.py [--quick] [--cpu] [--families quant,decode,prefill] [--out DIR]``.

Runs against the installed ``mm3_compile`` (``python -m bench.run`` works too, from a checkout with an
editable install); from an unpacked sdist use ``python bench/run.py``.

One command on one H200 (the full run is budgeted to fit a single device call, ``--budget-s``):
ceilings first (a 4 GiB device-to-device copy, an 8192^3 bf16 matmul), then every family, each row
checked against the pure-PyTorch reference before it is timed.  Writes ``results.csv`` (long
format), ``table.md``, ``targets.md`` and one PNG per family to ``--out``, and refreshes the README
section between ``<!-- bench:start -->`` and ``<!-- bench:end -->``.

``--cpu`` runs every family on tiny shapes in the Triton interpreter: it only checks the harness.
``--readme-table CSV`` regenerates the README section (and table.md beside the CSV) from a CSV.
"""

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("quant", "decode", "prefill", "indexer", "moe", "layer")
SHARES = {
    "quant": 1.5,
    "decode": 2.5,
    "prefill": 3.0,
    "indexer": 1.0,
    "moe": 2.0,
    "layer": 1.5,
}  # of the time budget, as families start


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing: a smoke run")
    p.add_argument(
        "--cpu", action="store_true", help="tiny shapes in the Triton interpreter (harness check, no timing claims)"
    )
    p.add_argument(
        "--families", default=",".join(FAMILIES), help="comma list of quant,decode,prefill,indexer,moe,layer"
    )
    p.add_argument("--out", default=None, help="output folder (default bench/results, bench/results/cpu with --cpu)")
    p.add_argument(
        "--readme",
        default=None,
        help="README whose bench section is rewritten (default README.md; --cpu touches none unless given)",
    )
    p.add_argument("--no-readme", action="store_true", help="do not touch the README")
    p.add_argument(
        "--budget-s", type=float, default=None, help="wall-clock budget for the families (default 380, quick 150)"
    )
    p.add_argument(
        "--topk-share",
        type=int,
        default=1,
        help="consecutive query tokens sharing their random older blocks (1 = independent, worst case)",
    )
    p.add_argument("--readme-table", metavar="CSV", help="only regenerate table.md + the README section from CSV")
    args = p.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    # Interpreter numbers are no measurement: they never land in the GPU results or the README by default.
    if args.out is None:
        args.out = os.path.join(REPO, "bench", "results", *(["cpu"] if args.cpu else []))
    if args.readme is None and (args.readme_table or not args.cpu):
        args.readme = os.path.join(REPO, "README.md")
    unknown = set(args.families) - set(FAMILIES)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}; choose from {FAMILIES}")
    return args


def _prepare_environment(cpu: bool) -> None:
    """Before torch/triton are imported: the interpreter for --cpu, a fresh Inductor cache, and ``bench`` importable.

    Inductor's caches live in a new temporary folder for each run: its FX graph cache does not see a changed
    lowering, so an older run's entries could stand in for this checkout's code, and a "cold" compile could be a
    hit. The cache stays on inside the run (the layer family times the warm compile as its hit).

    ``mm3_compile`` is the installed package (``pip install -e .`` in a checkout, or a wheel/sdist
    install): the repo folder is appended to ``sys.path``, after site-packages, so only ``bench``
    comes from it and an unpacked sdist's source folder never shadows the install."""
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the interpreter is ~3x faster single-threaded
    cache_dir = tempfile.mkdtemp(prefix="mm3_bench_inductor_")
    atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    if REPO not in sys.path:
        sys.path.append(REPO)
    import importlib.util

    try:
        found = importlib.util.find_spec("mm3_compile.kernels") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise SystemExit(
            "bench: mm3_compile is not installed in this Python (its kernels and lowerings install inside it): "
            "run `pip install -e .` (or `make setup`) first"
        )


def measure_ceilings(ctx) -> None:
    """This run's copy GB/s (bytes read + written) and bf16 matmul TFLOP/s: every % is against them."""
    import torch

    copy_bytes, n = ((2 << 30), 8192) if ctx.cuda else ((16 << 20), 256)  # GPU: 2 GiB read + 2 GiB written
    ctx.ceilings["copy"] = _copy_ceiling(ctx, copy_bytes)
    ctx.ceilings["matmul"] = _matmul_ceiling(ctx, n)
    for row in ctx.rows:  # the ceilings are 100% of themselves by definition; keep the column filled
        row["pct_of_ceiling"] = 100.0 if row.get("ms") not in ("", None) else ""
    if ctx.cuda:
        torch.cuda.empty_cache()


def _copy_ceiling(ctx, copy_bytes: int) -> float | None:
    import torch

    from bench.harness import Check

    src = torch.randn(copy_bytes // 2, dtype=torch.bfloat16, device=ctx.device)
    dst = torch.empty_like(src)
    base = dict(family="ceiling", shape=f"{2 * copy_bytes / 2**30:g} GiB moved", dtype="bf16", kv_dtype="-")

    def copy_check(_):
        return Check(bool(torch.equal(dst[:4096], src[:4096])))

    ctx.provider(base, "copy", [lambda: dst.copy_(src)], copy_check, nbytes=2 * copy_bytes, ceiling_kind="copy")
    return ctx.rows[-1].get("gbps") or None


def _matmul_ceiling(ctx, n: int) -> float | None:
    import torch

    from bench.harness import Check

    a = torch.randn((n, n), dtype=torch.bfloat16, device=ctx.device)
    b = torch.randn((n, n), dtype=torch.bfloat16, device=ctx.device)
    c = torch.empty((n, n), dtype=torch.bfloat16, device=ctx.device)

    def mm_check(_):
        ref = a[:64].float() @ b.float()
        return Check(bool(torch.allclose(c[:64].float(), ref, atol=0.5, rtol=2e-2)))

    base = dict(family="ceiling", shape=f"{n}^3 matmul", dtype="bf16", kv_dtype="-")
    ctx.provider(base, "matmul", [lambda: torch.mm(a, b, out=c)], mm_check, flops=2 * n**3, ceiling_kind="matmul")
    return ctx.rows[-1].get("tflops") or None


def write_outputs(rows, out_dir: str, readme: str | None) -> None:
    from bench import report

    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "results.csv")
    report.write_csv(rows, csv_path)
    rows = report.read_csv(csv_path)  # the table, plots and targets see exactly what --readme-table will
    table = report.markdown_table(rows)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(table)
    for path in report.plots(rows, out_dir):
        print(f"wrote {path}")
    if readme:
        report.update_readme(report.readme_section(rows), readme)
    results = report.targets(rows)
    targets_md = report.targets_markdown(results)
    with open(os.path.join(out_dir, "targets.md"), "w") as f:
        f.write(targets_md)
    print(f"wrote {csv_path}, table.md, targets.md" + (f"; README section of {readme}" if readme else ""))
    print("\nTARGETS\n" + targets_md, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    _prepare_environment(args.cpu)
    if args.readme_table:
        from bench import report

        rows = report.read_csv(args.readme_table)
        table = report.markdown_table(rows)
        with open(os.path.join(os.path.dirname(os.path.abspath(args.readme_table)), "table.md"), "w") as f:
            f.write(table)
        report.update_readme(report.readme_section(rows), args.readme)
        print(table)
        return 0

    import torch

    import mm3_compile  # noqa: F401  (registers torch.ops.mm3.*)
    from bench.harness import Context
    from bench.timing import Budget

    for name in ("recompile_limit", "cache_size_limit"):  # many shapes/dtypes per compiled provider
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    if args.cpu:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("no CUDA device: pass --cpu for the interpreter smoke run", file=sys.stderr)
        return 2
    budget_s = args.budget_s if args.budget_s is not None else (150 if args.quick else 380)
    budget = Budget(budget_s, {f: SHARES[f] for f in args.families})
    ctx = Context(device, args.quick or args.cpu, budget, share=args.topk_share)
    print(
        f"device {ctx.env['gpu']}, torch {ctx.env['torch']}, triton {ctx.env['triton']}; budget {budget_s:.0f} s",
        flush=True,
    )
    t0 = time.monotonic()
    measure_ceilings(ctx)
    print(f"ceilings: copy {ctx.ceilings.get('copy')} GB/s, matmul {ctx.ceilings.get('matmul')} TFLOP/s", flush=True)
    from bench import attention, indexer, layer, moe, quant

    runners = {
        "quant": lambda: quant.run(ctx),
        "decode": lambda: attention.Decode(ctx).run(),
        "prefill": lambda: attention.Prefill(ctx).run(),
        "indexer": lambda: indexer.run(ctx),
        "moe": lambda: moe.run(ctx),
        "layer": lambda: layer.run(ctx),
    }
    for family in args.families:
        budget.begin(family)
        started = time.monotonic()
        print(f"== {family} (deadline in {budget.deadline - started:.0f} s)", flush=True)
        try:
            runners[family]()
        except Exception as e:  # keep what the other families measured
            ctx._failed(dict(family=family, shape="-", dtype="-", kv_dtype="-", provider="(family)"), ("-",), e)
        print(f"== {family} took {time.monotonic() - started:.1f} s", flush=True)
    print(f"all families: {time.monotonic() - t0:.1f} s", flush=True)
    write_outputs(ctx.rows, args.out, None if args.no_readme else args.readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
