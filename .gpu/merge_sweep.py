"""Session 40 (prepared): the dependent merge launch of B1 grids (union.split_merge_kernel, ~1.3 us of a step at 16
splits): warps {1, 2, 4 (plan), 8} x rows per program {1, 2 (plan at B1), 4, 8}, schedule.MERGE_WARPS and
schedule.merge_rows forced; TP1 / TP8 B1 and TP8 B4, bf16 and FP8 (bench/attn_probe.op_row: graph replay over sets
rotated past the L2, float64-checked, graph == eager), the plan first and last. Run: python3 .gpu/merge_sweep.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, torch  # noqa: E402
from mm3_compile.kernels.sparse_attn import schedule  # noqa: E402

copy, l2 = ceilings()
warps, rows_of = schedule.MERGE_WARPS, schedule.merge_rows
VARIANTS = [None] + [(w, r) for w in (1, 2, 4, 8) for r in (1, 2, 4, 8)] + [None]
for B, kv, tp, Hq, Hkv in ((1, "bf16", "TP1", 64, 4), (1, "fp8", "TP1", 64, 4), (1, "bf16", "TP8", 8, 1),
                           (1, "fp8", "TP8", 8, 1), (4, "bf16", "TP8", 8, 1)):
    inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
    res = {}
    for v in VARIANTS:
        schedule.MERGE_WARPS = warps if v is None else v[0]
        schedule.merge_rows = rows_of if v is None else (lambda rows, device, r=v[1]: r)
        name = "plan" if v is None else f"w{v[0]}r{v[1]}"
        try:
            res.setdefault(name, []).append(P.op_row(inp, tokens, ref, "", ""))
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            print(f"{tp} B{B} {kv} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    schedule.MERGE_WARPS, schedule.merge_rows = warps, rows_of
    line(f"{tp} B{B} {kv}", res, inp.kv_bytes + inp.io_bytes, copy)
    del inp
    torch.cuda.empty_cache()
