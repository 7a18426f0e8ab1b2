"""Session 39: the op compiled with dynamic=True (symbolic block-table width) before / after the symbolic width kept
the table row (union.table_row: (0, False) = the old gathered pages, without the pre-wait prefetch), against eager,
decode bench shapes, old then new (two timings each); each compiled once per (kv, mode), traced at B1, then run at
B1 and B32 (bench/attn_probe.op_row: graph replay over sets rotated past the L2, float64-checked, graph == eager).
Run: python3 .gpu/wide_ab.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, mm3_compile, torch  # noqa: E402
from mm3_compile.kernels.sparse_attn import union  # noqa: E402

copy, l2 = ceilings()
new_table_row = union.table_row


def old_table_row(max_blocks, one_token_decode):
    return new_table_row(max_blocks, one_token_decode) if isinstance(max_blocks, int) else (0, False)


SHAPES = [("TP8", 8, 1), ("TP1", 64, 4)]
for kv in ("bf16", "fp8"):
    for tp, Hq, Hkv in SHAPES:
        inps = {B: make(B, kv, tp, Hq, Hkv, l2) for B in (1, 32)}
        res = {B: {} for B in inps}
        for B, (inp, tokens, ref) in inps.items():
            res[B]["eager"] = [P.op_row(inp, tokens, ref, "", "")]
        for mode in ("old", "new"):
            union.table_row = old_table_row if mode == "old" else new_table_row
            torch._dynamo.reset()
            compiled = torch.compile(P.plain_decode, dynamic=True, fullgraph=True)
            for B, (inp, tokens, ref) in inps.items():
                torch._dynamo.mark_dynamic(inp.sets[0]["q"], 0)
                with mm3_compile.dynamic_shapes():
                    res[B][mode] = [P.op_row(inp, tokens, ref, "", "", op=compiled) for _ in range(2)]
        union.table_row = new_table_row
        for B, (inp, tokens, ref) in inps.items():
            line(f"{tp} B{B} {kv} (compiled traced at B1)", res[B], inp.kv_bytes + inp.io_bytes, copy)
        del inps
        torch.cuda.empty_cache()
