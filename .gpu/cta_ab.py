"""Session 42: one-token B1 decode launched as clusters of 1 / 2 CTAs (4: triton 3.6's PlanCTA pass fails on the kernel) per program (Triton's num_ctas, sm_90):
Triton splits each program's K^T / V tiles and the QK / PV outputs over the cluster's CTAs (keys for K, D for V), so
every SM reads half of the 64 KB page, and the softmax's row reductions and P cross the cluster through
distributed shared memory; one partial per split as before, so the merge is unchanged.  bench/attn_probe.op_row:
graph replay over every rotated set, float64-checked, graph == eager; interleaved.
Run: python3 .gpu/cta_ab.py"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dep_ab import P, ceilings, line, make, schedule, torch  # noqa: E402

base = schedule.kernel_options


def ctas(n):
    def patched(*a, **k):
        o = base(*a, **k)
        if not k.get("prefill") and n > 1:
            o.update(num_ctas=n)
        return o

    schedule.kernel_options = patched


copy, l2 = ceilings()
CASES = [(1, "bf16", "TP1", 64, 4), (1, "bf16", "TP8", 8, 1), (1, "fp8", "TP1", 64, 4), (1, "fp8", "TP8", 8, 1)]
for B, kv, tp, Hq, Hkv in CASES:
    inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
    res = {}
    for n in (1, 2, 1, 2):
        ctas(n)
        try:
            res.setdefault(f"ctas{n}", []).append(P.op_row(inp, tokens, ref, "", ""))
        except Exception as e:  # noqa: BLE001
            print(f"{tp} B{B} {kv} ctas{n}: {type(e).__name__}: {str(e)[-300:]}", flush=True)
    ctas(1)
    line(f"{tp} B{B} {kv}", {k: v for k, v in res.items() if v}, inp.kv_bytes + inp.io_bytes, copy)
    del inp
    torch.cuda.empty_cache()
