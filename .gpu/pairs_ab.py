"""Session 43: FP8 V read as int16 pairs (schedule.launch_options V_PAIRS, jit.load_block / split_pairs: the 16-bit
ldmatrix transpose straight from the copied bytes, the FP8 -> fp16 conversion after it in registers) against session
42's plan (V_PAIRS off, CONVERT_V_FIRST as planned then), decode bench shapes, interleaved (bench/attn_probe.op_row:
graph replay over every rotated set, float64-checked, graph == eager), and the two paths' outputs compared bit for bit.
"pairs" is the schedule's plan (pairs where it takes them; the session's first call took them at every FP8 launch).
Run: python3 .gpu/pairs_ab.py [stages | everywhere]  (stages: force the pairs launches' num_stages and time only
their shapes; everywhere: pairs at every FP8 decode launch over fp16 dots)"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, schedule, torch  # noqa: E402

base = schedule.kernel_options
STAGES = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "everywhere" else None
EVERYWHERE = "everywhere" in sys.argv[1:]  # pairs at every FP8 launch over fp16 dots, the plan's stages


def variant(pairs):
    def patched(*a, **k):
        o = base(*a, **k)
        if not pairs and o["V_PAIRS"]:  # session 42's plan: the same options without fp16 dots' pairs
            o = base(*a, **{**k, "fp16_dots": False})
        elif pairs and EVERYWHERE and k.get("fp8_decode") and k.get("fp16_dots"):
            o.update(V_PAIRS=True, CONVERT_V_FIRST=False)
        if pairs and o["V_PAIRS"] and STAGES:
            o["num_stages"] = STAGES
        return o

    schedule.kernel_options = patched


copy, l2 = ceilings()
ALL = [(1, "fp8", "TP1", 64, 4), (1, "fp8", "TP8", 8, 1), (1, "bf16", "TP1", 64, 4), (2, "fp8", "TP1", 64, 4),
          (8, "fp8", "TP8", 8, 1), (16, "fp8", "TP8", 8, 1), (8, "fp8", "TP1", 64, 4), (32, "fp8", "TP1", 64, 4),
          (32, "fp8", "TP8", 8, 1), (128, "fp8", "TP1", 64, 4), (128, "fp8", "TP8", 8, 1)]
SHORT = [(16, "fp8", "TP8", 8, 1), (8, "fp8", "TP1", 64, 4), (32, "fp8", "TP8", 8, 1)]  # the plan's pairs launches
SHAPES = SHORT if STAGES else ALL
for B, kv, tp, Hq, Hkv in SHAPES:
    inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
    outs = []
    for pairs in (False, True):
        variant(pairs)
        outs.append(P.decode_call(inp, inp.sets[0]))
    torch.cuda.synchronize()
    res = {}
    for pairs in (False, True, False, True):
        variant(pairs)
        res.setdefault("pairs" if pairs else "s42", []).append(P.op_row(inp, tokens, ref, "", ""))
    line(f"{tp} B{B} {kv} same_bits {torch.equal(*outs)}", res, inp.kv_bytes + inp.io_bytes, copy)
    del inp, outs
    torch.cuda.empty_cache()
