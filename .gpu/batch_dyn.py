"""Session 39: the workspace op compiled as compile_model compiles (dynamic=False, only the batch dims marked dynamic:
q dim 0, the lists' token dim, the table's and seq_lens' request dim; the table width static), traced at B1 and
traced at B32, each run at B1 and B32, against eager (bench/attn_probe.op_row: graph replay over sets rotated past
the L2, float64-checked, graph == eager). Run: python3 .gpu/batch_dyn.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, mm3_compile, torch  # noqa: E402
import mm3_compile.ops  # noqa: E402

copy, l2 = ceilings()
ws = mm3_compile.ops.decode_workspace("cuda")


def mark(inp):
    for s in inp.sets:
        torch._dynamo.maybe_mark_dynamic(s["q"], 0)
        torch._dynamo.maybe_mark_dynamic(s["topk_idx"], 1)
        torch._dynamo.maybe_mark_dynamic(s["block_table"], 0)
    torch._dynamo.maybe_mark_dynamic(inp.seq_lens, 0)


for kv in ("bf16", "fp8"):
    for tp, Hq, Hkv in (("TP8", 8, 1), ("TP1", 64, 4)):
        inps = {B: make(B, kv, tp, Hq, Hkv, l2) for B in (1, 32)}
        res = {B: {"eager": [P.op_row(inp, tokens, ref, "", "")]} for B, (inp, tokens, ref) in inps.items()}
        for first in (1, 32):
            torch._dynamo.reset()
            compiled = torch.compile(P.workspace_decode(ws), dynamic=False, fullgraph=True)
            for B in (first, 33 - first):
                inp, tokens, ref = inps[B]
                mark(inp)
                with mm3_compile.dynamic_shapes():
                    res[B][f"traced_B{first}"] = [P.op_row(inp, tokens, ref, "", "", op=compiled)]
        for B, (inp, tokens, ref) in inps.items():
            line(f"{tp} B{B} {kv} workspace", res[B], inp.kv_bytes + inp.io_bytes, copy)
        del inps
        torch.cuda.empty_cache()
