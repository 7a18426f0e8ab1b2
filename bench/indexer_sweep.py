"""Indexer schedule sweep on one GPU: exact lists vs the naive reference, graph-replay time per schedule.

``python3 bench/indexer_sweep.py --out DIR [--budget-s 120] [--kind decode|prefill]``.  Shapes are the ``indexer`` family's
(bf16 index cache ``[pool, 128, 128]`` of >= 1 GiB, inputs rotated past the L2, top-16, init 0,
local 1) plus the FP8 index cache on decode.  Inputs are small integers, so every dot is exact in
fp32 and the lists must equal the reference exactly (sampled tokens).  Per decode row: % of the
same-run copy ceiling on the index-K bytes read.  FP8 vs bf16: how often the top-16 *set* of the
FP8 cache differs from the bf16 cache's on the same N(0, 1) data.  Writes ``sweep.csv``, prints a table.
"""

import argparse
import dataclasses
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.run import _prepare_environment

_prepare_environment(cpu=False)  # an uninstalled checkout: map mm3_compile.kernels onto kernels/

from bench.indexer import IndexCase
from bench.refs import sample_tokens
from bench.timing import Timer
from mm3_compile import platform
from mm3_compile.contract import PAGE_SIZE
from mm3_compile.kernels.indexer import topk as kernels
from mm3_compile.kernels.indexer.naive import index_topk_ref

DIDX = 128
SHAPES = [
    IndexCase("TP1", 4, 32, 1, 32768),
    IndexCase("TP1", 4, 128, 1, 32768),
    IndexCase("TP1", 4, 1, 1, 32768),
    IndexCase("TP8", 1, 32, 1, 32768),
    IndexCase("TP8", 1, 128, 1, 32768),
    IndexCase("TP1", 4, 1, 8192, 8192),
    IndexCase("TP8", 1, 1, 8192, 8192),
    IndexCase("TP1", 4, 4, 2048, 18432),
    IndexCase("TP8", 1, 4, 2048, 18432),
]
DECODE_VARIANTS = {  # keys-major dots, stages and warps: measured, bench/NOTES.md (session 15)
    "bf16_dot": {"fp16_q": False},  # FP8 rows: the key tile converted to bf16 (the default before session 15)
    "topk_warps1": {"topk_warps": 1},  # one row per program: selection rounds as warp shuffles, no CTA barrier
    "topk_warps2": {"topk_warps": 2},
    "chunks_x2": "chunks*2",
    "chunks_/2": "chunks/2",
}
PREFILL_VARIANTS = {  # keys-major dots, stages, warps and the top-k tiles: measured, bench/NOTES.md
    "stages4": {"score_stages": 4},
}


def copy_ceiling_gbps(device) -> float:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(10):
            b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 10)
    return 2 * n / (sorted(times)[2] * 1e-3) / 1e9


def make(case: IndexCase, device, gen, fp8_dtype=None, integer=True):
    n_blocks = math.ceil(case.seq_len / PAGE_SIZE)
    pool = max(case.B * n_blocks, (1 << 30) // (PAGE_SIZE * DIDX * 2))
    if integer:
        k = torch.randint(-3, 4, (pool, PAGE_SIZE, DIDX), device=device, generator=gen).to(torch.bfloat16)
    else:
        k = torch.randn((pool, PAGE_SIZE, DIDX), device=device, generator=gen).to(torch.bfloat16)
    T = case.B * case.q_len
    nbytes = case.B * case.seq_len * DIDX * 2
    sets = []
    for _ in range(max(1, min(32, math.ceil(4 * (60 << 20) / nbytes)))):
        pages = torch.randperm(pool, device=device, generator=gen)[: case.B * n_blocks]
        if integer:
            q = torch.randint(-3, 4, (T, case.Hidx, DIDX), device=device, generator=gen).to(torch.bfloat16)
        else:
            q = torch.randn((T, case.Hidx, DIDX), device=device, generator=gen).to(torch.bfloat16)
        sets.append((q, pages.view(case.B, n_blocks).to(torch.int32)))
    seq_lens = torch.full((case.B,), case.seq_len, dtype=torch.int32, device=device)
    cu = torch.arange(case.B + 1, dtype=torch.int32, device=device) * case.q_len
    return k, sets, cu, seq_lens, nbytes


def reference_on_sample(case, k, q, table, tokens):
    pos = (tokens % case.q_len) + case.seq_len - case.q_len
    req = tokens // case.q_len
    width = int(pos.max()) // PAGE_SIZE + 1
    pages = table.cpu()[req, :width].long()
    compact = k[pages.flatten().to(k.device)].cpu()
    n = tokens.shape[0]
    return index_topk_ref(
        q[tokens.to(q.device)].cpu(),
        compact,
        torch.arange(pages.numel(), dtype=torch.int32).view(pages.shape),
        torch.arange(n + 1, dtype=torch.int32),
        (pos + 1).to(torch.int32),
        case.topk,
        0,
        1,
    )


def variant_schedule(base: kernels.IndexSchedule, change):
    if isinstance(change, dict):
        return dataclasses.replace(base, **change)
    if change == "chunks*2":
        return dataclasses.replace(base, chunks=base.chunks * 2)
    if change == "chunks/2":
        return dataclasses.replace(base, chunks=max(1, base.chunks // 2))
    if change == "block_t/2":
        return dataclasses.replace(base, block_t=max(1, base.block_t // 2))
    raise ValueError(change)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=110)
    p.add_argument("--no-variants", action="store_true")
    p.add_argument("--kind", choices=("all", "decode", "prefill"), default="all", help="shapes swept")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    device = torch.device("cuda")
    timer = Timer(device, quick=True)
    copy = copy_ceiling_gbps(device)
    fp8_dtype = platform.platform_for(device).kv_e4m3_dtype
    fp8_fmt = platform.fp8_format(fp8_dtype)
    rows = [{"shape": "copy ceiling", "variant": "-", "us": "", "pct": "", "ok": "", "note": f"{copy:.0f} GB/s R+W"}]
    log = open(os.path.join(args.out, "sweep.log"), "w")  # noqa: SIM115 -- appended to until the end

    def record(**row):
        rows.append(row)
        print(row, file=log, flush=True)

    gen = torch.Generator(device=device).manual_seed(0)
    for with_variants in (False, True):
        if with_variants and args.no_variants:
            break
        for case in SHAPES:
            if args.kind != "all" and (case.q_len == 1) != (args.kind == "decode"):
                continue
            if time.monotonic() - t0 > args.budget_s:
                record(shape=case.shape, variant="(budget)", us="", pct="", ok="", note="skipped")
                continue
            k, sets, cu, seq_lens, nbytes = make(case, device, gen)
            T = case.B * case.q_len
            base = kernels.index_schedule(T, case.B, case.Hidx, sets[0][1].shape[1], device)
            variants = {"default": None}
            if with_variants:
                variants = DECODE_VARIANTS if case.q_len == 1 else PREFILL_VARIANTS
            tokens = sample_tokens(T, 12, gen_seed=case.B)
            ref = reference_on_sample(case, k, *sets[0], tokens)
            fp8_k = None
            if case.q_len == 1:
                fp8_k = k.to(fp8_dtype)  # small integers: exact in e4m3, so the lists must not change
            for name, change in variants.items():
                sched = base if change is None else variant_schedule(base, change)
                if sched == base and change is not None:
                    continue
                for cache_kind in ("bf16", "fp8") if fp8_k is not None else ("bf16",):
                    cache = k if cache_kind == "bf16" else fp8_k
                    fmt = None if cache_kind == "bf16" else fp8_fmt
                    try:

                        def call(s, cache=cache, fmt=fmt, sched=sched, cu=cu, seq_lens=seq_lens, topk=case.topk):
                            return kernels.index_topk(
                                s[0], cache, s[1], cu, seq_lens, topk, 0, 1, fmt, None, schedule=sched
                            )

                        out = call(sets[0])
                        got = out[:, tokens.to(device)].cpu()
                        ok = bool(torch.equal(got, ref))
                        ms = timer.graph([lambda s=s: call(s) for s in sets])
                        read = nbytes if cache_kind == "bf16" else nbytes // 2
                        pct = f"{100 * read / (ms * 1e-3) / 1e9 / copy:.1f}" if case.q_len == 1 else ""
                        record(
                            shape=case.shape,
                            variant=f"{name}{'' if cache_kind == 'bf16' else ' fp8'}",
                            us=f"{ms * 1e3:.1f}",
                            pct=pct,
                            ok=ok,
                            note=str(sched),
                        )
                    except Exception as e:  # noqa: BLE001 -- a variant that fails to compile is a row, not the end of the sweep
                        record(shape=case.shape, variant=name, us="", pct="", ok=False, note=repr(e)[:300])
            del k, sets, fp8_k
            torch.cuda.empty_cache()
        if not with_variants:  # FP8 vs bf16 top-16 sets on random data, between the default and variant passes
            for case in (IndexCase("TP1", 4, 32, 1, 32768), IndexCase("TP1", 4, 1, 8192, 8192)):
                k, sets, cu, seq_lens, _ = make(case, device, gen, integer=False)
                k8 = k.to(fp8_dtype)  # scale 1: N(0, 1) keys are well inside the e4m3 range
                differ, slots, total = 0, 0, 0
                for q, table in sets[:2]:
                    a = kernels.index_topk(q, k, table, cu, seq_lens, 16, 0, 1)
                    try:
                        b = kernels.index_topk(q, k8, table, cu, seq_lens, 16, 0, 1, fp8_fmt)
                    except Exception as e:  # noqa: BLE001 -- an FP8 compile failure is a row, not the end of the sweep
                        record(
                            shape=case.shape, variant="fp8 vs bf16 sets", us="", pct="", ok=False, note=repr(e)[:300]
                        )
                        break
                    sa, sb = a.sort(-1).values, b.sort(-1).values
                    row_diff = (sa != sb).any(-1)
                    differ += int(row_diff.sum())
                    total += row_diff.numel()
                    # entries of b's set missing from a's
                    missing = (b[..., :, None] != a[..., None, :]).all(-1).sum()
                    slots += int(missing)
                if total == 0:
                    continue
                record(
                    shape=case.shape,
                    variant="fp8 vs bf16 sets",
                    us="",
                    pct="",
                    ok="",
                    note=f"{differ}/{total} rows differ ({100 * differ / total:.1f}%), "
                    f"{slots / total:.2f} of 16 ids differ per row",
                )
                del k, k8, sets
                torch.cuda.empty_cache()
    import csv

    with open(os.path.join(args.out, "sweep.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(f"{r['shape']:<34} {r['variant']:<18} {r['us']:>8} us {r['pct']:>6}% ok={r['ok']} {r['note'][:150]}")
    print(f"total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
