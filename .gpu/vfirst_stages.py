"""Session 42: TP8 B32 FP8 (8 splits of 2 blocks, 2 per SM) with CONVERT_V_FIRST on/off x stages 1/2/3 (plan: 2),
and TP8 B8/B16, TP1 B2/B8 FP8 on/off with the plan's options; bench/attn_probe.op_row, interleaved.
Run: python3 .gpu/vfirst_stages.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, schedule, torch  # noqa: E402

base = schedule.kernel_options


def opts(on, stages=None):
    def patched(*a, **k):
        o = base(*a, **k)
        o["CONVERT_V_FIRST"] = on and o["CONVERT_V_FIRST"]
        if stages is not None and not k.get("prefill"):
            o["num_stages"] = stages
        return o

    schedule.kernel_options = patched


copy, l2 = ceilings()
inp, tokens, ref = make(32, "fp8", "TP8", 8, 1, l2)
res = {}
for _ in range(2):
    for on, st in ((False, None), (True, None), (True, 1), (True, 3), (False, 3)):
        opts(on, st)
        res.setdefault(f"{'first' if on else 'triton'}{'' if st is None else f's{st}'}", []).append(
            P.op_row(inp, tokens, ref, "", ""))
line("TP8 B32 fp8", res, inp.kv_bytes + inp.io_bytes, copy)
del inp
for B, tp, Hq, Hkv in ((8, "TP8", 8, 1), (16, "TP8", 8, 1), (2, "TP1", 64, 4), (8, "TP1", 64, 4)):
    inp, tokens, ref = make(B, "fp8", tp, Hq, Hkv, l2)
    res = {}
    for on in (False, True, False, True):
        opts(on)
        res.setdefault("first" if on else "triton", []).append(P.op_row(inp, tokens, ref, "", ""))
    line(f"{tp} B{B} fp8", res, inp.kv_bytes + inp.io_bytes, copy)
    del inp
    torch.cuda.empty_cache()
opts(True)
