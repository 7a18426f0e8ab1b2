"""Session 41: why the bench's TP8 B1 FP8 row (6.10 us, H100) sits ~0.85 us above the probe's (5.2-5.3 us).
Same inputs, three timings each, interleaved: the probe's replay (bench/attn_probe.replay_us) of the plain op and
of the workspace op, and the bench's Timer.graph (bench/timing.py) of the workspace op. Run: python3 .gpu/harness_ab.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, make, torch  # noqa: E402
from bench.timing import Timer  # noqa: E402
from mm3_compile.ops import decode_workspace  # noqa: E402

copy, l2 = ceilings()
ws = decode_workspace("cuda")
timer = Timer(torch.device("cuda"), quick=False)
for B, kv, tp, Hq, Hkv in ((1, "fp8", "TP8", 8, 1), (1, "bf16", "TP8", 8, 1), (1, "fp8", "TP1", 64, 4)):
    inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
    wop = P.workspace_decode(ws)
    fns = [lambda s=s: P.decode_call(inp, s, wop) for s in inp.sets]
    out = {"probe plain": [], "probe workspace": [], "bench Timer workspace": []}
    for _ in range(3):
        out["probe plain"].append(P.replay_us(lambda s: P.decode_call(inp, s), inp.sets)[0])
        out["probe workspace"].append(P.replay_us(lambda s: P.decode_call(inp, s, wop), inp.sets)[0])
        out["bench Timer workspace"].append(timer.graph(fns) * 1e3)
    print(f"{tp} B{B} {kv} sets {len(inp.sets)}: " + "  ".join(f"{k} {'/'.join(f'{u:.2f}' for u in v)}" for k, v in out.items()), flush=True)
    del inp
    torch.cuda.empty_cache()
