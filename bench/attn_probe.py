"""One-call H200 probe of the attention kernels (run by the integrator; < 150 s).

For decode B1 / B32 at seq 32768, TP1 (Hq 64, Hkv 4) and TP8 (Hq 8, Hkv 1), bf16 and FP8 KV: the
op's output on rotated set 0 against the float64 reference on sampled tokens, then CUDA-graph replay
time (>= 32 calls per graph over input sets rotated past the L2) with programmatic dependent launch
on (``MM3_PDL=1``, the default) and off (``MM3_PDL=0``), and the graph's output against eager; at B1 the
op compiled as well, on fresh counters and on a workspace.
Prefill TP1 1x8192 bf16: mean |out - fp64 reference| on 16 sampled tokens and ``do_bench`` time.
GB/s are against a same-run 2 GiB device-to-device copy (read + write).  Prints one table last and
writes it to ``$OUT/attn_probe.md`` when ``OUT`` is set.

    python bench/attn_probe.py            # every row
    python bench/attn_probe.py --quick    # B1 rows and prefill only
    python bench/attn_probe.py --quick --prefill-variants  # + the prefill error under other numerics
"""

import argparse
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `bench` from the checkout

import torch
import triton

from bench import inputs as bench_inputs
from bench.refs import compare, naive_attention_on_sample, sample_tokens

MIN_POOL_BYTES = 1 << 30  # as bench/attention.py: rotated sets do not share L2 lines
CALLS_PER_GRAPH = 32
REPLAYS = 10
WINDOWS = 5


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=40)
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9


def decode_call(inp, s, op=None):
    """One decode call on rotated set ``s``: the plain op, or ``op`` (a compiled one) with the same arguments."""
    args = (s["q"], inp.cache, s["topk_idx"], s["block_table"], inp.seq_lens, inp.k_scale, inp.v_scale)
    return (op or plain_decode)(*args, inp.sm_scale, inp.case.kv_cache_dtype)


def plain_decode(q, cache, topk_idx, block_table, seq_lens, k_scale, v_scale, sm_scale, kv_cache_dtype):
    return torch.ops.mm3.sparse_attn_decode(
        q, cache, topk_idx, block_table, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale
    )


def workspace_decode(workspace):
    def call(q, cache, topk_idx, block_table, seq_lens, k_scale, v_scale, sm_scale, kv_cache_dtype):
        return torch.ops.mm3.sparse_attn_decode_with_workspace(
            q, cache, topk_idx, block_table, seq_lens, workspace, sm_scale, kv_cache_dtype, k_scale, v_scale
        )

    return call


def graph_time_us(inp, op=None) -> tuple[float, bool]:
    """Per-call time of graph replays (median of windows), and whether the graph's output equals eager's."""
    sets = inp.sets
    eager = decode_call(inp, sets[(CALLS_PER_GRAPH - 1) % len(sets)])
    for s in sets[:2]:  # warm-up (and compile) outside the capture
        decode_call(inp, s, op)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [decode_call(inp, sets[i % len(sets)], op) for i in range(CALLS_PER_GRAPH)]
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(outs[-1], eager)
    times = []
    for _ in range(WINDOWS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS_PER_GRAPH))
    del graph, outs
    return sorted(times)[len(times) // 2], same


def decode_rows(quick: bool, copy: float) -> list[dict]:
    """Eager op rows with PDL on and off; at B1 also the op compiled (Inductor launches without PDL) on fresh
    counters (``sparse_attn_decode``: a memset per call) and on a workspace (``..._with_workspace``)."""
    import mm3_compile.ops

    rows = []
    shapes = [(1, 32768)] if quick else [(1, 32768), (32, 32768)]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    compiled = {
        "compiled, fresh counters": torch.compile(plain_decode, fullgraph=True),
        "compiled, workspace": torch.compile(
            workspace_decode(mm3_compile.ops.decode_workspace("cuda")), fullgraph=True
        ),
    }
    for B, seq in shapes:
        for kv in ("bf16", "fp8"):
            for tp, Hq, Hkv in (("TP1", 64, 4), ("TP8", 8, 1)):
                case = bench_inputs.AttnCase("decode", tp, Hq, Hkv, 128, (1,) * B, (seq,) * B, kv)
                inp = bench_inputs.make_attn_inputs(case, torch.device("cuda"), l2, MIN_POOL_BYTES)
                tokens = sample_tokens(inp.pos.shape[0], 8, gen_seed=len(case.key))
                ref = naive_attention_on_sample(inp, inp.sets[0], tokens)
                variants = [(pdl, None) for pdl in ("1", "0")]
                variants += [(name, op) for name, op in compiled.items()] if B == 1 else []
                for label, op in variants:
                    if op is None:
                        os.environ["MM3_PDL"] = label
                    out = decode_call(inp, inp.sets[0], op)
                    got = out[tokens.to(out.device)].float().cpu()
                    ok, max_err = compare(got, ref)
                    us, same = graph_time_us(inp, op)
                    gbps = (inp.kv_bytes + inp.io_bytes) / (us * 1e-6) / 1e9
                    rows.append(
                        {
                            "row": f"decode {tp} B{B} {kv}",
                            "pdl": label,
                            "ok": ok and same,
                            "max_err": max_err,
                            "mean_err": float((got - ref).abs().mean()),
                            "us": us,
                            "pct": 100 * gbps / copy,
                        }
                    )
                    os.environ.pop("MM3_PDL", None)
                del inp
                torch.cuda.empty_cache()
    return rows


def _upstream_softmax(logits, dim):
    """Softmax with the numerics of vLLM's M3 kernels (fp32 logits and sum, P rounded to bf16 before P.V):
    the float64 reference's softmax replaced by this one emulates them (the output is rounded after)."""
    m = logits.amax(dim, keepdim=True)
    p = torch.exp((logits - torch.where(torch.isfinite(m), m, 0.0)).float())
    return p.to(torch.bfloat16).double() / p.sum(dim, keepdim=True).double()


def prefill_rows(variants: bool) -> list[dict]:
    """TP1 1x8192 bf16: the op, and with ``variants`` the error of the same sample under an emulation of
    upstream numerics, fp32 KV-centric partials instead of fp16 ones, and the union-walk schedule."""
    from unittest import mock

    from mm3_compile.kernels.sparse_attn import kv_centric, prefill
    from mm3_compile.kernels.sparse_attn import naive as attn_naive

    case = bench_inputs.AttnCase("prefill", "TP1", 64, 4, 128, (8192,), (8192,), "bf16")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    inp = bench_inputs.make_attn_inputs(case, torch.device("cuda"), l2, MIN_POOL_BYTES)
    s = inp.sets[0]

    def call():
        return torch.ops.mm3.sparse_attn_prefill(
            s["q"],
            inp.cache,
            s["topk_idx"],
            s["block_table"],
            inp.cu_seqlens_q,
            inp.seq_lens,
            inp.sm_scale,
            inp.case.kv_cache_dtype,
            inp.k_scale,
            inp.v_scale,
        )

    tokens = sample_tokens(inp.pos.shape[0], 16, gen_seed=len(case.key))
    ref = naive_attention_on_sample(inp, s, tokens).float().cpu()

    def row(name, got, ms=None):
        ok, max_err = compare(got, ref)
        tflops = inp.flops / (ms * 1e-3) / 1e12 if ms else float("nan")
        mean = float((got - ref).abs().mean())
        return {
            "row": name,
            "pdl": "-",
            "ok": ok,
            "max_err": max_err,
            "mean_err": mean,
            "us": (ms or 0) * 1e3,
            "pct": tflops,
        }

    def measured(name):
        out = call()
        got = out[tokens.to(out.device)].float().cpu()
        return row(name, got, triton.testing.do_bench(call, warmup=3, rep=60))

    rows = [measured("prefill TP1 1x8192 bf16")]
    if not variants:
        return rows
    real_empty = kv_centric.empty_row_major

    def fp32_partials(shape, dtype, device):
        return real_empty(shape, torch.float32 if dtype == torch.float16 else dtype, device)

    def emulated(name):
        with mock.patch.object(attn_naive.torch, "softmax", _upstream_softmax):
            return row(name, naive_attention_on_sample(inp, s, tokens).to(torch.bfloat16).float().cpu())

    def with_fp32_partials(name):
        with mock.patch.object(kv_centric, "empty_row_major", fp32_partials):
            return measured(name)

    def union(name):
        with mock.patch.object(prefill, "prefill_schedule", lambda *a: "union"):
            return measured(name)

    for name, variant in (
        ("  same sample, upstream numerics emulated (fp64)", emulated),
        ("  KV-centric with fp32 partials", with_fp32_partials),
        ("  union-walk schedule", union),
    ):
        try:
            rows.append(variant(name))
        except Exception as e:  # noqa: BLE001 (a failing variant is a line of the probe, not its end)
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--prefill-variants", action="store_true", help="where the prefill error comes from")
    args = parser.parse_args()
    import mm3_compile  # noqa: F401  (registers the ops)

    begin = time.time()
    copy = copy_gbps()
    rows = decode_rows(args.quick, copy)
    rows += prefill_rows(args.prefill_variants)
    lines = [
        (
            f"copy ceiling {copy:.0f} GB/s; {torch.cuda.get_device_name()}; torch {torch.__version__}, triton "
            f"{triton.__version__}; {time.time() - begin:.0f} s"
        ),
        "| row | PDL / variant | correct | max err | mean err | us | % copy (decode) / TFLOP/s (prefill) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['pdl']} | {r['ok']} | {r['max_err']:.2e} | {r['mean_err']:.2e} | "
            f"{r['us']:.2f} | {r['pct']:.1f} |"
        )
    table = "\n".join(lines)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attn_probe.md"), "w") as f:
            f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
