"""Session 43: the decode op compiled as bench/attention.py's op_compiled does (the workspace op, dynamic=True), FP8
rows: a symbolic split's options with V converted first (the plan) against V read as int16 pairs (V_PAIRS forced for
symbolic block counts), one compile per variant, interleaved (rows as .gpu/dep_ab.py: bench/attn_probe.op_row, graph
replay over every rotated set, float64-checked, graph == eager), with the eager op as a control.
Run: python3 .gpu/compiled_pairs.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, mm3_compile, schedule, torch  # noqa: E402
import mm3_compile.ops  # noqa: E402

base = schedule.kernel_options


def variant(pairs):
    def patched(*a, **k):
        o = base(*a, **k)
        symbolic = not isinstance(k.get("blocks_per_program"), int)
        if pairs and symbolic and k.get("fp8_decode") and k.get("fp16_dots"):
            o.update(V_PAIRS=True, CONVERT_V_FIRST=False)
        return o

    schedule.kernel_options = patched
    torch._dynamo.reset()
    return torch.compile(P.workspace_decode(ws), dynamic=True)


copy, l2 = ceilings()
ws = mm3_compile.ops.decode_workspace("cuda")
SHAPES = [(1, "TP1", 64, 4), (1, "TP8", 8, 1), (32, "TP1", 64, 4), (32, "TP8", 8, 1), (128, "TP1", 64, 4),
          (128, "TP8", 8, 1)]
inputs = {s: make(s[0], "fp8", s[1], s[2], s[3], l2) for s in SHAPES}
res = {s: {"op": [P.op_row(*inputs[s], "", "")]} for s in SHAPES}
for pairs in (False, True, False, True):
    compiled = variant(pairs)
    for s in SHAPES:
        res[s].setdefault("pairs" if pairs else "first", []).append(P.op_row(*inputs[s], "", "", op=compiled))
for s in SHAPES:
    line(f"compiled {s[1]} B{s[0]} fp8", res[s], inputs[s][0].kv_bytes + inputs[s][0].io_bytes, copy)
