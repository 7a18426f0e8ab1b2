"""Session 38: the workspace op compiled with dynamic shapes, traced at B1, run at TP8 B1 and B32, with the dependent
merge off (schedule.DEPENDENT_MERGE_MAX_TILES 0) and on (4), interleaved (inputs and rows as .gpu/dep_ab.py).
Run: python3 .gpu/dep_c.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, mm3_compile, schedule, torch  # noqa: E402
import mm3_compile.ops  # noqa: E402

copy, l2 = ceilings()
ws = mm3_compile.ops.decode_workspace("cuda")
for tiles in (0, 4, 0, 4):
    schedule.DEPENDENT_MERGE_MAX_TILES = tiles
    torch._dynamo.reset()
    compiled = torch.compile(P.workspace_decode(ws), dynamic=True, fullgraph=True)
    for B in (1, 32):
        inp, tokens, ref = make(B, "bf16", "TP8", 8, 1, l2)
        torch._dynamo.mark_dynamic(inp.sets[0]["q"], 0)
        with mm3_compile.dynamic_shapes():
            r = [P.op_row(inp, tokens, ref, "", "", op=compiled)]
        line(f"workspace compiled(traced B1) dep{tiles} TP8 B{B} bf16", {"c": r}, inp.kv_bytes + inp.io_bytes, copy)
        del inp
        torch.cuda.empty_cache()
