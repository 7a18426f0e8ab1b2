"""ncu of the prefill GEMMs at 8192 tokens (the bench block's weights and routes, routed experts, 128-row layout):
GEMM1 (paired tiles + tails: two launches) and GEMM2, in the schedule's launch order (ROW_GROUP 1) and the 2-D
grid (0). Each variant runs once to compile, then once profiled, so the profiled launches are the last 6
`_mxfp8_gemm_kernel` launches.
Question it answers: is GEMM1 bound by the L2 (bytes into the SMs), the tensor pipe, or neither (latency)?
Run: ncu -k regex:_mxfp8_gemm_kernel --launch-skip 6 --launch-count 6 --section SpeedOfLight
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy
  python3 .gpu/ncu_prefill.py"""
import dataclasses, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill_setup import E, T, blocks, cfg, dev, ex, fmt, k, moe, moe_bench, pairs, pw, torch, x
from mm3_compile.kernels.moe import gemm as G, schedule as S
from mm3_compile.ops.moe import gemm_schedule
g1cfg = gemm_schedule(T * k, 2 * cfg.moe_intermediate_size, cfg.hidden_size, E, dev)
tail = S.tail_schedule(g1cfg)
g2cfg = gemm_schedule(T * k, cfg.hidden_size, cfg.moe_intermediate_size, E, dev, True)
rg = lambda c, g: dataclasses.replace(c, ROW_GROUP=g)
gate_up = G.mxfp8_gemm(x, None, ex.gate_up.values, ex.gate_up.scales, fmt, g1cfg, torch.bfloat16, pairs, blocks, k,
                       None, layout_m=128, tail_config=tail)
act, act_s = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up, cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit)
act_s = act_s.view(torch.uint8)
used = int((blocks >= 0).sum())
print(f"configs {g1cfg} tail {tail} GEMM2 {g2cfg}; used 128-row blocks {used}", flush=True)
runs = []
for g in (1, 0):
    runs.append((f"GEMM1 g{g}", lambda g=g: G.mxfp8_gemm(x, None, ex.gate_up.values, ex.gate_up.scales, fmt, rg(g1cfg, g),
                 torch.bfloat16, pairs, blocks, k, None, layout_m=128, tail_config=rg(tail, g))))
    runs.append((f"GEMM2 g{g}", lambda g=g: G.mxfp8_gemm(act, act_s, ex.down.values, ex.down.scales, fmt, rg(g2cfg, g),
                 torch.float32, pairs, blocks, 1, pw, layout_m=128)))
for _, fn in runs:  # compile + warm (6 kernel launches)
    fn()
torch.cuda.synchronize()
for name, fn in runs:  # the profiled launches (6)
    a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
    a.record(); fn(); b.record(); b.synchronize()
    print(f"{name}: {a.elapsed_time(b):.3f} ms (under the profiler when run by ncu)", flush=True)
