"""Session 39: what a batch-dynamic compiled FP8 decode loses against eager, forced in eager: MAX_SPLITS = T (a
symbolic split count's bound) and/or the stage count of an unknown split length (kernel_options with
blocks_per_program=None); decode bench shapes at B32 (and B1), graph replay over rotated sets, float64-checked.
Run: python3 .gpu/sym_opts.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, torch  # noqa: E402
from mm3_compile.kernels.sparse_attn import schedule, union  # noqa: E402

copy, l2 = ceilings()
orig_max, orig_opts = union.max_splits, schedule.kernel_options


def sym_max(num_splits, T):
    return orig_max(None, T)


def sym_opts(*a, **k):
    k["blocks_per_program"] = None
    return orig_opts(*a, **k)


VARIANTS = {"eager": (orig_max, orig_opts), "max=T": (sym_max, orig_opts), "stages?": (orig_max, sym_opts),
            "both": (sym_max, sym_opts)}
for B, kv, tp, Hq, Hkv in ((32, "fp8", "TP8", 8, 1), (32, "fp8", "TP1", 64, 4), (32, "bf16", "TP8", 8, 1),
                           (1, "fp8", "TP1", 64, 4)):
    inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
    res = {}
    for name in list(VARIANTS) * 2:
        union.max_splits, union.schedule.kernel_options = VARIANTS[name]
        res.setdefault(name, []).append(P.op_row(inp, tokens, ref, "", ""))
    union.max_splits, union.schedule.kernel_options = orig_max, orig_opts
    line(f"{tp} B{B} {kv}", res, inp.kv_bytes + inp.io_bytes, copy)
    del inp
    torch.cuda.empty_cache()
