"""Session 42: FP8 V converted before its transpose (schedule.launch_options CONVERT_V_FIRST, jit.load_block) against
Triton's own order (the conversion after the transpose, byte-wise ld.shared), decode bench shapes, interleaved
(bench/attn_probe.op_row: graph replay over every rotated set, float64-checked, graph == eager).
Run: python3 .gpu/vfirst_ab.py ("plan": schedule.launch_options; "off": CONVERT_V_FIRST forced off)"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, schedule, torch  # noqa: E402

base = schedule.kernel_options


def first(on):
    def patched(*a, **k):
        o = base(*a, **k)
        o["CONVERT_V_FIRST"] = on and o["CONVERT_V_FIRST"]
        return o

    schedule.kernel_options = patched


copy, l2 = ceilings()
SHAPES = [(1, "fp8", "TP1", 64, 4), (1, "fp8", "TP8", 8, 1), (1, "bf16", "TP1", 64, 4), (2, "fp8", "TP1", 64, 4),
          (8, "fp8", "TP8", 8, 1), (16, "fp8", "TP8", 8, 1), (8, "fp8", "TP1", 64, 4), (32, "fp8", "TP1", 64, 4),
          (32, "fp8", "TP8", 8, 1), (128, "fp8", "TP1", 64, 4), (128, "fp8", "TP8", 8, 1)]
for B, kv, tp, Hq, Hkv in SHAPES:
    inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
    res = {}
    for on in (False, True, False, True):
        first(on)
        res.setdefault("plan" if on else "off", []).append(P.op_row(inp, tokens, ref, "", ""))
    first(True)
    line(f"{tp} B{B} {kv}", res, inp.kv_bytes + inp.io_bytes, copy)
    del inp
    torch.cuda.empty_cache()
