"""ROW_GROUP A/B at 8192 tokens (TOK): GEMM1 / GEMM2 alone (bench block weights + routes, routed experts only,
128-row layout; launch orders 0, 1 (the schedule's since session 34), 2, 4, 8; outputs compared bit for bit), then
the compiled block (routed + shared; schedule._prefill patched to each order) and dequantize + grouped_mm.
Run: python3 .gpu/row_group.py (about 3-4 minutes with cold compiles)."""
import dataclasses, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill_setup import E, T, blocks, cfg, dev, ex, fmt, k, moe, moe_bench, pairs, pw, torch, x
from mm3_compile.kernels.moe import gemm as G, schedule as S
from mm3_compile.ops.moe import gemm_schedule

def bench(fn, n=10):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(3): fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) / 3)
    ts.sort(); return ts[len(ts) // 2]

g1cfg = gemm_schedule(T * k, 2 * cfg.moe_intermediate_size, cfg.hidden_size, E, dev)
tail = S.tail_schedule(g1cfg)
g2cfg = gemm_schedule(T * k, cfg.hidden_size, cfg.moe_intermediate_size, E, dev, True)
print("configs", g1cfg, tail, g2cfg, flush=True)
fl1 = 2 * T * k * 2 * cfg.moe_intermediate_size * cfg.hidden_size
fl2 = 2 * T * k * cfg.moe_intermediate_size * cfg.hidden_size
ORDERS = (0, 1, 2, 4, 8)
rg = lambda c, g: dataclasses.replace(c, ROW_GROUP=g)
def g1(c, t):
    return lambda: G.mxfp8_gemm(x, None, ex.gate_up.values, ex.gate_up.scales, fmt, c, torch.bfloat16, pairs, blocks, k, None, layout_m=128, tail_config=t)
gate_up = g1(g1cfg, tail)()
act, act_s = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up, cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit)
act_s = act_s.view(torch.uint8)
def g2(c):
    return lambda: G.mxfp8_gemm(act, act_s, ex.down.values, ex.down.scales, fmt, c, torch.float32, pairs, blocks, 1, pw, layout_m=128)
ref1, ref2 = None, None
for rnd in range(2):
    for g in ORDERS:
        fn = g1(rg(g1cfg, g), rg(tail, g)); y = fn(); torch.cuda.synchronize(); ms = bench(fn)
        ref1 = y if ref1 is None else ref1
        print(f"GEMM1 ROW_GROUP {g}: {ms:.3f} ms {fl1 / ms / 1e9:.0f} TFLOP/s same={torch.equal(y, ref1)}", flush=True)
    for g in ORDERS:
        fn = g2(rg(g2cfg, g)); y = fn(); torch.cuda.synchronize(); ms = bench(fn)
        ref2 = y if ref2 is None else ref2
        print(f"GEMM2 ROW_GROUP {g}: {ms:.3f} ms {fl2 / ms / 1e9:.0f} TFLOP/s same={torch.equal(y, ref2)}", flush=True)

# the compiled block, routed + shared, with the prefill tiles patched to each order
orig = S._prefill
def timed(fn, n=8):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts) // 2]
outs = {}
for rnd in range(1):
    for g in (0, 1, 4):
        S._prefill = lambda r, xm, g=g: rg(orig(r, xm), g)
        torch._dynamo.reset()
        f = torch.compile(moe, fullgraph=True, dynamic=False)
        with torch.no_grad():
            y = f(x); ms = timed(lambda: f(x))
        outs.setdefault(g, y)
        print(f"block T{T} compiled ROW_GROUP {g}: {ms:.3f} ms same_as_0={torch.equal(y, outs[0])}", flush=True)
S._prefill = orig
torch._dynamo.reset()
f = torch.compile(lambda x: moe_bench.dequant_grouped_mm(moe, x), fullgraph=True, dynamic=False)
with torch.no_grad():
    f(x); print(f"dequant + grouped_mm compiled: {timed(lambda: f(x)):.3f} ms", flush=True)
