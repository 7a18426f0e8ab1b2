"""Session 40: one-wave decode grids between B1 and B32 (programs of 1, 2 or 4 blocks), the launch options forced
against the plan's (bf16 8 warps 3 stages, FP8 8 warps 2 stages): bf16 4 warps 3 stages; FP8 4 warps 1 or 2 stages
(bench/attn_probe.op_row: graph replay over sets rotated past the L2, float64-checked, graph == eager).
Run: python3 .gpu/wave_ab.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, force_options, line, make, torch  # noqa: E402

copy, l2 = ceilings()
CASES = [(8, "bf16", "TP8", 8, 1), (16, "bf16", "TP8", 8, 1), (4, "bf16", "TP1", 64, 4), (8, "bf16", "TP1", 64, 4),
         (2, "bf16", "TP1", 64, 4), (8, "fp8", "TP8", 8, 1), (2, "fp8", "TP1", 64, 4), (4, "fp8", "TP8", 8, 1)]
for B, kv, tp, Hq, Hkv in CASES:
    variants = [None, (4, 3), None] if kv == "bf16" else [None, (4, 1), (4, 2), None]
    inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
    res = {}
    for wo in variants:
        force_options(wo)
        res.setdefault("plan" if wo is None else f"w{wo[0]}s{wo[1]}", []).append(P.op_row(inp, tokens, ref, "", ""))
    force_options(None)
    line(f"{tp} B{B} {kv}", res, inp.kv_bytes + inp.io_bytes, copy)
    del inp
    torch.cuda.empty_cache()
