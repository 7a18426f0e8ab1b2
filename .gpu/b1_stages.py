"""Session 44: one-block FP8 B1 programs (one wave, V read as pairs) in 1 stage (the plan: registers, then shared
memory for the dots) against 2 (a cp.async copy the 16-bit transpose reads directly), interleaved, two runs each
(rows as .gpu/dep_ab.py: bench/attn_probe.op_row, graph replay over every rotated set, float64-checked).
Run: python3 .gpu/b1_stages.py [WARPSxSTAGES ...] (default 4x2)"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, force_options, line, make, torch  # noqa: E402
from mm3_compile.kernels.sparse_attn import schedule  # noqa: E402

base = schedule.kernel_options
VARIANTS = [tuple(int(x) for x in a.split("x")) for a in sys.argv[1:]] or [(4, 2)]
copy, l2 = ceilings()
for B, kv, tp, Hq, Hkv in [(1, "fp8", "TP1", 64, 4), (1, "fp8", "TP8", 8, 1), (1, "bf16", "TP1", 64, 4)]:
    inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
    res = {}
    for ws in [None, *VARIANTS] * 2:
        schedule.kernel_options = base
        force_options(ws, base)
        res.setdefault("plan" if ws is None else f"w{ws[0]}s{ws[1]}", []).append(P.op_row(inp, tokens, ref, "", ""))
    line(f"{tp} B{B} {kv}", res, inp.kv_bytes + inp.io_bytes, copy)
    del inp
    torch.cuda.empty_cache()
