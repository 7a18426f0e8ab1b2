"""Session 40: warps x stages of the decode launch at the plan's split count (schedule.kernel_options forced), B1 and
B32, TP1 and TP8, bf16 and FP8 (bench/attn_probe.op_row: graph replay over sets rotated past the L2,
float64-checked, graph == eager), the plan's own options first and last. Run: python3 .gpu/warp_sweep.py [B ...]"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, force_options, line, make, torch  # noqa: E402

copy, l2 = ceilings()
batches = [int(b) for b in sys.argv[1:]] or [1, 32]
VARIANTS = [None, (4, 2), (4, 3), (4, 1), (2, 2), (8, 2), None]
for B in batches:
    for kv in ("bf16", "fp8"):
        for tp, Hq, Hkv in (("TP1", 64, 4), ("TP8", 8, 1)):
            inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
            res = {}
            for wo in VARIANTS:
                force_options(wo)
                res.setdefault("plan" if wo is None else f"w{wo[0]}s{wo[1]}", []).append(
                    P.op_row(inp, tokens, ref, "", ""))
            force_options(None)
            line(f"{tp} B{B} {kv}", res, inp.kv_bytes + inp.io_bytes, copy)
            del inp
            torch.cuda.empty_cache()
