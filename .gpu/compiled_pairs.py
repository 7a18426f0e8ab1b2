"""Session 43: the decode op compiled with dynamic shapes (as bench/attention.py's op_compiled) on FP8 rows, whose
symbolic split takes the multi-wave options (V_PAIRS, 3 stages), timed as bench/attn_probe.op_row, float64-checked.
Run: python3 .gpu/compiled_pairs.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, torch  # noqa: E402

copy, l2 = ceilings()
compiled = torch.compile(P.plain_decode, dynamic=True)
for B, kv, tp, Hq, Hkv in [(32, "fp8", "TP8", 8, 1), (32, "fp8", "TP1", 64, 4), (1, "fp8", "TP1", 64, 4),
                           (128, "fp8", "TP8", 8, 1)]:
    inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
    rows = {"op": [P.op_row(inp, tokens, ref, "", "") for _ in range(2)],
            "compiled": [P.op_row(inp, tokens, ref, "", "", op=compiled) for _ in range(2)]}
    line(f"{tp} B{B} {kv}", rows, inp.kv_bytes + inp.io_bytes, copy)
    del inp
    torch.cuda.empty_cache()
