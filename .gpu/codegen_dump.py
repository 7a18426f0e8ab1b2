"""Session 39: Inductor's generated code of the decode op compiled with dynamic=True (traced at B1) and without, at
TP1 B1 bf16 and TP8 B1 fp8, written to $OUT/code_*.py; each call timed as in .gpu/wide_ab.py. Run: python3
.gpu/codegen_dump.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, mm3_compile, torch  # noqa: E402
import mm3_compile.ops  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

copy, l2 = ceilings()
out = os.environ.get("OUT", ".")
ws = mm3_compile.ops.decode_workspace("cuda")
for kv, tp, Hq, Hkv in (("bf16", "TP1", 64, 4), ("fp8", "TP8", 8, 1)):
    inp, tokens, ref = make(1, kv, tp, Hq, Hkv, l2)
    res = {"eager": [P.op_row(inp, tokens, ref, "", "")]}
    for name, fn, dyn in (("plain_dyn", P.plain_decode, True), ("plain_static", P.plain_decode, False),
                          ("ws_dyn", P.workspace_decode(ws), True), ("ws_static", P.workspace_decode(ws), False)):
        torch._dynamo.reset()
        compiled = torch.compile(fn, dynamic=dyn, fullgraph=True)
        s = inp.sets[0]
        if dyn:
            torch._dynamo.mark_dynamic(s["q"], 0)
        with mm3_compile.dynamic_shapes():
            _, codes = run_and_get_code(P.decode_call, inp, s, compiled)
            with open(f"{out}/code_{tp}_{kv}_{name}.py", "w") as f:
                f.write("\n\n# ---- next\n".join(codes))
            res[name] = [P.op_row(inp, tokens, ref, "", "", op=compiled)]
    line(f"{tp} B1 {kv}", res, inp.kv_bytes + inp.io_bytes, copy)
    del inp
    torch.cuda.empty_cache()
