"""Session 40: one-token decode B1 with fewer splits (16 splits of 1 block = the plan; 8 of 2; 4 of 4) x warps/stages,
TP1 and TP8, bf16 and FP8 (bench/attn_probe.op_row: graph replay over sets rotated past the L2, float64-checked,
graph == eager), interleaved with the plan. Run: python3 .gpu/b1_sweep.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, torch  # noqa: E402
from mm3_compile.kernels.sparse_attn import decode, schedule  # noqa: E402

copy, l2 = ceilings()
plan, opts = decode.split_plan, schedule.kernel_options
VARIANTS = [("plan", None, None), ("s8", 8, None), ("s8 w8s3", 8, (8, 3)), ("s8 w4s3", 8, (4, 3)),
            ("s4 w8s3", 4, (8, 3)), ("s16 w4s2", 16, (4, 2)), ("plan", None, None)]
for B, kv, tp, Hq, Hkv in ((1, "bf16", "TP1", 64, 4), (1, "fp8", "TP1", 64, 4), (1, "bf16", "TP8", 8, 1),
                           (1, "fp8", "TP8", 8, 1)):
    inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
    res = {}
    for name, splits, wo in VARIANTS:
        decode.split_plan = plan if splits is None else (lambda tq, h, T, dev, per_sm=2, s=splits: (s, -(-T // s)))

        def patched(*a, wo=wo, **k):
            o = opts(*a, **k)
            if wo is not None:
                o.update(num_warps=wo[0], num_stages=wo[1])
            return o

        schedule.kernel_options = patched
        res.setdefault(name, []).append(P.op_row(inp, tokens, ref, "", ""))
    decode.split_plan, schedule.kernel_options = plan, opts
    line(f"{tp} B{B} {kv}", res, inp.kv_bytes + inp.io_bytes, copy)
    del inp
    torch.cuda.empty_cache()
