"""Session 39: the split merge in passes (what a symbolic split count compiles to), forced in eager: passes of 2, 4,
8 or 16 splits (union.merge_passes_of -> (n, True)) against the one exact pass of eager's known count; B1 (the
dependent merge, 16 splits), TP8 B8 (last arrival, 16 splits) and B32 (2-8 splits); graph replay over rotated
sets, float64-checked, graph == eager. Run: python3 .gpu/merge_pass.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, torch  # noqa: E402
from mm3_compile.kernels.sparse_attn import union  # noqa: E402

copy, l2 = ceilings()
exact = union.merge_passes_of
for B, kv, tp, Hq, Hkv in ((1, "bf16", "TP8", 8, 1), (1, "fp8", "TP1", 64, 4), (8, "bf16", "TP8", 8, 1),
                           (32, "bf16", "TP8", 8, 1), (32, "fp8", "TP8", 8, 1), (32, "fp8", "TP1", 64, 4)):
    inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
    res = {}
    for n in (0, 2, 4, 8, 16, 0):
        union.merge_passes_of = exact if n == 0 else (lambda splits, T, n=n: (n, True))
        res.setdefault("exact" if n == 0 else f"pass{n}", []).append(P.op_row(inp, tokens, ref, "", ""))
    union.merge_passes_of = exact
    line(f"{tp} B{B} {kv}", res, inp.kv_bytes + inp.io_bytes, copy)
    del inp
    torch.cuda.empty_cache()
