"""Session 38: the dependent merge launch (schedule.DEPENDENT_MERGE_MAX_TILES 4) against the last arrival's merge
(the constant at 0: the same binaries, last_merges = 1, no merge launch), decode bench shapes, graph replay over sets
rotated past the L2 (bench/attn_probe.op_row: error against float64 on sampled tokens, graph output == eager),
interleaved; then the op compiled with dynamic shapes, traced at B1, run at B1 and B32 (symbolic merge grid).
Run: python3 .gpu/dep_ab.py"""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from bench import attn_probe as P
import mm3_compile  # noqa: F401
from mm3_compile.kernels.sparse_attn import schedule

SHAPES = [(1, "bf16", "TP8", 8, 1), (1, "bf16", "TP1", 64, 4), (1, "fp8", "TP8", 8, 1), (1, "fp8", "TP1", 64, 4),
          (32, "bf16", "TP8", 8, 1), (32, "fp8", "TP8", 8, 1), (32, "bf16", "TP1", 64, 4), (32, "fp8", "TP1", 64, 4)]


def ceilings():
    """(copy GB/s, L2 bytes) of this device, printed."""
    copy = P.copy_gbps()
    print(torch.cuda.get_device_name(), f"copy {copy:.0f} GB/s", flush=True)
    return copy, torch.cuda.get_device_properties(0).L2_cache_size


def make(B, kv, tp, Hq, Hkv, l2):
    case = P.bench_inputs.AttnCase("decode", tp, Hq, Hkv, 128, (1,) * B, (32768,) * B, kv)
    inp = P.bench_inputs.make_attn_inputs(case, torch.device("cuda"), l2, P.MIN_POOL_BYTES)
    tokens = P.sample_tokens(inp.pos.shape[0], 8, gen_seed=len(case.key))
    return inp, tokens, P.naive_attention_on_sample(inp, inp.sets[0], tokens)


def force_options(warps_stages, base=schedule.kernel_options):
    """Make schedule.kernel_options give decode launches (warps, stages), or its own options for None."""
    def patched(*a, **k):
        o = base(*a, **k)
        if warps_stages is not None and not k.get("prefill"):
            o.update(num_warps=warps_stages[0], num_stages=warps_stages[1])
        return o

    schedule.kernel_options = patched


def line(label, res, moved, copy):
    out = f"{label}:"
    for k, rs in res.items():
        us = sorted(r["us"] for r in rs)
        out += (f"  {k} {'/'.join(f'{u:.2f}' for u in us)} us ({100 * moved / (us[0] * 1e-6) / 1e9 / copy:.1f}%) "
                f"ok {all(r['ok'] for r in rs)} mean {rs[0]['mean_err']:.2e}")
    print(out, flush=True)


def main():
    copy, l2 = ceilings()
    for B, kv, tp, Hq, Hkv in SHAPES:
        inp, tokens, ref = make(B, kv, tp, Hq, Hkv, l2)
        res = {}
        for tiles in (0, 4, 0, 4):
            schedule.DEPENDENT_MERGE_MAX_TILES = tiles
            res.setdefault(f"dep{tiles}", []).append(P.op_row(inp, tokens, ref, "", ""))
        schedule.DEPENDENT_MERGE_MAX_TILES = 4
        line(f"{tp} B{B} {kv}", res, inp.kv_bytes + inp.io_bytes, copy)
        del inp
        torch.cuda.empty_cache()

    # compiled, dynamic shapes, traced at B1: B32 runs the same graph with a zero merge grid
    for kv in ("bf16", "fp8"):
        torch._dynamo.reset()
        compiled = torch.compile(P.plain_decode, dynamic=True, fullgraph=True)
        for B in (1, 32):
            inp, tokens, ref = make(B, kv, "TP8", 8, 1, l2)
            torch._dynamo.mark_dynamic(inp.sets[0]["q"], 0)
            with mm3_compile.dynamic_shapes():
                r = [P.op_row(inp, tokens, ref, "", "", op=compiled) for _ in range(2)]
            line(f"compiled(traced B1) TP8 B{B} {kv}", {"dep4": r}, inp.kv_bytes + inp.io_bytes, copy)
            del inp
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
