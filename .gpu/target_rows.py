"""Session 43: issue 26's target rows on one card (bench/attn_probe.op_row: graph replay of 32 calls over sets rotated
past the L2, float64-checked, graph == eager), two runs each, with the copy ceiling of the same run.
Run: python3 .gpu/target_rows.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, torch  # noqa: E402

copy, l2 = ceilings()
for B, kv, tp, Hq, Hkv in [(1, "bf16", "TP1", 64, 4), (1, "fp8", "TP1", 64, 4), (1, "bf16", "TP8", 8, 1),
                           (1, "fp8", "TP8", 8, 1), (32, "bf16", "TP8", 8, 1), (32, "fp8", "TP8", 8, 1),
                           (32, "fp8", "TP1", 64, 4)]:
    inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
    line(f"{tp} B{B} {kv}", {"op": [P.op_row(inp, tokens, ref, "", "") for _ in range(2)]},
         inp.kv_bytes + inp.io_bytes, copy)
    del inp
    torch.cuda.empty_cache()
