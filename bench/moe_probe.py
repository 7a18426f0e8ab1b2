"""One device round for the MoE kernels: correctness at the real widths, schedule variants, the family.

``python bench/moe_probe.py [--cpu] [--budget-s 200] [--skip-family]``: (1) GEMM1 / GEMM2 / the linear vs the
float64 references of ``kernels/moe/naive.py`` on the experts the routes picked; (2) CUDA-graph timings of the
grouped GEMM kernels under a few tile configurations for 1 / 32 / 128 / 8192 tokens; (3) the ``moe`` bench
family (compiled block vs the previous design). Prints one table per part; results go to bench/NOTES.md by hand.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.run import _prepare_environment

_prepare_environment("--cpu" in sys.argv)

import torch

import mm3_compile  # noqa: F401
from bench import moe as moe_bench
from bench.harness import Context
from bench.timing import Budget, Timer
from mm3_compile import platform
from mm3_compile.kernels.moe import gemm as gemm_kernels
from mm3_compile.kernels.moe.naive import grouped_gemm_ref, mx_dequantize_f64, mxfp8_linear_ref
from mm3_compile.kernels.moe.naive import route_ref as route
from mm3_compile.kernels.moe.schedule import GemmConfig, layout_m
from mm3_compile.models import MiniMaxM3Config
from mm3_compile.ops.moe import gemm_schedule

T0 = time.monotonic()


def routes(moe, x):
    cfg = moe.config
    logits = torch.nn.functional.linear(x.float(), moe.gate_weight)
    return route(logits, moe.correction_bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor)


def rel_err(got, ref):
    finite = torch.isfinite(ref)
    return float((got.double() - ref)[finite].abs().max() / ref[finite].abs().max())


def correctness(moe, device, tokens):
    cfg = moe.config
    ex = moe.experts
    rows = []
    for T in tokens:
        gen = torch.Generator(device=device).manual_seed(100 + T)
        x = torch.randn(T, cfg.hidden_size, generator=gen, device=device).to(torch.bfloat16)
        ids, weights = routes(moe, x)
        k = ids.shape[1]
        E, two_i, H = ex.gate_up.values.shape
        bm = layout_m(gemm_schedule(T * k, two_i, H, E, device))
        pairs, blocks = torch.ops.mm3.moe_align(ids, E, bm)
        g = torch.ops.mm3.mxfp8_grouped_gemm(x, ex.gate_up.values, ex.gate_up.scales, pairs, blocks, bm, k)
        act, act_s = torch.ops.mm3.swiglu_oai_mxfp8_quant(g, cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit)
        pw = weights.reshape(-1).float()
        y = torch.ops.mm3.mxfp8_grouped_gemm(act, ex.down.values, ex.down.scales, pairs, blocks, bm, 1, act_s, pw)
        torch.cuda.synchronize() if device.type == "cuda" else None
        # float64 references on a sample of pairs (all pairs of at most 8 experts)
        sample_experts = ids.flatten().unique()[:8]
        sel = torch.isin(ids.flatten(), sample_experts).nonzero().squeeze(1)
        sub_ids = ids.flatten()[sel].view(-1, 1)
        g_ref = grouped_gemm_ref(x.double()[sel // k], ex.gate_up.values, ex.gate_up.scales, sub_ids)
        y_ref = grouped_gemm_ref(mx_dequantize_f64(act[sel], act_s[sel]), ex.down.values, ex.down.scales, sub_ids)
        y_ref = y_ref.to(torch.bfloat16).double() * pw[sel].double()[:, None]  # the kernel's bf16 rounding point
        sh = moe.shared
        lin = torch.ops.mm3.mxfp8_linear(x, sh.gate_up.values, sh.gate_up.scales)
        lin_ref = mxfp8_linear_ref(x, sh.gate_up.values, sh.gate_up.scales)
        rows.append((T, rel_err(g[sel], g_ref), rel_err(y[sel], y_ref), rel_err(lin, lin_ref), int(blocks.ge(0).sum())))
    print("\n== correctness vs float64 (max |err| / max |ref|; bf16 outputs: one rounding ~2^-9 relative)")
    print("| tokens | GEMM1 (bf16 out) | GEMM2 (weighted fp32) | linear (shared gate_up) | used row blocks |")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.2e} | {r[2]:.2e} | {r[3]:.2e} | {r[4]} |")
    return rows


def variants(moe, device, timer, tokens, configs_for):
    cfg = moe.config
    ex = moe.experts
    print("\n== grouped GEMM variants (CUDA-graph replay, us per call; bytes = active experts' MXFP8 bytes)")
    print("| tokens | GEMM | config (BM,BN,BK,warps,stages) | us | GB/s | TFLOP/s |")
    for T in tokens:
        if time.monotonic() - T0 > BUDGET * 0.55:
            print(f"| {T} | skipped: budget |")
            continue
        gen = torch.Generator(device=device).manual_seed(T)
        sets = []
        for _ in range(1 if T > 1024 else 4):
            x = torch.randn(T, cfg.hidden_size, generator=gen, device=device).to(torch.bfloat16)
            ids, w = routes(moe, x)
            sets.append((x, ids, w))
        k = sets[0][1].shape[1]
        fmt = platform.fp8_format(ex.gate_up.values.dtype)
        active = sum(s[1].unique().numel() for s in sets) / len(sets)
        for name, wt, K in (("gate_up", ex.gate_up, cfg.hidden_size), ("down", ex.down, cfg.moe_intermediate_size)):
            E, N = wt.values.shape[:2]
            nbytes = active * N * K * (1 + 1 / 32)
            flops = 2 * T * k * N * K
            for c in configs_for(T):
                try:
                    fns = []
                    for x, ids, w in sets:
                        pairs, blocks = torch.ops.mm3.moe_align(ids, E, c.BLOCK_M)
                        if name == "gate_up":
                            args = (x, None)
                            tk, pw = k, None
                        else:
                            a = torch.randn(T * k, K, generator=gen, device=device)
                            args = torch.ops.mm3.mxfp8_quantize(a)
                            args = (args[0], args[1].view(torch.uint8))
                            tk, pw = 1, w.reshape(-1).float()
                        out_dtype = torch.bfloat16 if name == "gate_up" else torch.float32
                        fns.append(
                            lambda args=args, pairs=pairs, blocks=blocks, tk=tk, pw=pw, od=out_dtype, wt=wt, c=c, fmt=fmt: (
                                gemm_kernels.mxfp8_gemm(
                                    args[0], args[1], wt.values, wt.scales, fmt, c, od, pairs, blocks, tk, pw
                                )
                            )
                        )
                    ms = timer.graph(fns)
                    cs = f"{c.BLOCK_M},{c.BLOCK_N},{c.BLOCK_K},{c.num_warps},{c.num_stages}" + (",swap" * c.SWAP_AB)
                    print(
                        f"| {T} | {name} | {cs} | {ms * 1e3:.1f} | {nbytes / ms / 1e6:.0f} | {flops / ms / 1e9:.0f} |"
                    )
                except Exception as e:  # noqa: BLE001 (a config that does not compile, shared memory, is a row)
                    print(f"| {T} | {name} | {c} | error {type(e).__name__}: {str(e)[:120]} |")
                sys.stdout.flush()


def decode_configs(T):
    default = gemm_schedule(T * 4, 6144, 6144, 128, torch.device("cuda"))
    out = [default]
    for bn, bk, st, w, swap in (
        (64, 512, 3, 4, False),
        (64, 256, 4, 4, False),
        (128, 256, 4, 4, False),
        (32, 512, 3, 4, False),
        (64, 256, 3, 4, False),
    ):
        c = GemmConfig(16, bn, bk, w, st, swap)
        if c != default:
            out.append(c)
    return out


def block_variants(moe, device, timer, tokens, prefill_tokens):
    """The compiled block: the shared expert folded into the routed launches or separate, and the operand order
    of the GEMMs (``SWAP_AB``), patched into the op's schedule for this probe only."""
    import dataclasses

    import mm3_compile.ops.moe as ops_moe

    cfg = moe.config
    base_schedule = ops_moe.schedule
    variants = (("folded", True, False), ("separate", False, False), ("folded+swap", True, True))
    print("\n== compiled block variants (graph replay for decode, launched for prefill; us)")
    print("| tokens | " + " | ".join(v[0] for v in variants) + " | max rel. diff vs separate |")
    inputs = {}
    for T in tokens + prefill_tokens:
        gen = torch.Generator(device=device).manual_seed(T)
        n = 1 if T in prefill_tokens else 4
        inputs[T] = [torch.randn(T, cfg.hidden_size, generator=gen, device=device).to(torch.bfloat16) for _ in range(n)]
    us, outs = {}, {}
    for name, fold, swap in variants:
        moe.experts.can_fold = lambda shared, fold=fold: fold  # instance attribute: this probe only
        ops_moe.schedule = lambda *a, swap=swap: dataclasses.replace(base_schedule(*a), SWAP_AB=swap)
        torch._dynamo.reset()
        compiled = torch.compile(moe, fullgraph=True, dynamic=False)
        for T, xs in inputs.items():
            if time.monotonic() - T0 > BUDGET * 0.8:
                continue
            try:
                outs[name, T] = compiled(xs[0]).float()
                fns = [lambda x=x, f=compiled: f(x) for x in xs]
                us[name, T] = (timer.launched(fns) if T in prefill_tokens else timer.graph(fns)) * 1e3
            except Exception as e:  # noqa: BLE001 (a variant that does not compile is a row)
                print(f"| {T} | {name}: error {type(e).__name__}: {str(e)[:160]} |", flush=True)
    ops_moe.schedule = base_schedule
    del moe.experts.can_fold
    for T in inputs:
        ref = outs.get(("separate", T))
        cells = [f"{us[v[0], T]:.1f}" if (v[0], T) in us else "-" for v in variants]
        diffs = [
            f"{float((outs[v[0], T] - ref).abs().max() / ref.abs().max()):.1e}"
            for v in variants
            if ref is not None and (v[0], T) in outs and v[0] != "separate"
        ]
        print(f"| {T} | " + " | ".join(cells) + f" | {', '.join(diffs)} |", flush=True)


def prefill_configs(T):
    return [
        gemm_schedule(T * 4, 6144, 6144, 128, torch.device("cuda")),
        GemmConfig(128, 128, 64, 8, 3),
        GemmConfig(128, 128, 128, 8, 3),
        GemmConfig(128, 128, 128, 4, 3),
        GemmConfig(128, 128, 64, 8, 3, True),
        GemmConfig(128, 128, 128, 8, 3, True),
        GemmConfig(128, 128, 128, 8, 4, True),
        GemmConfig(128, 256, 128, 8, 3, True),
        GemmConfig(256, 128, 64, 8, 3, True),
    ]


def main():
    global BUDGET
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--budget-s", type=float, default=200)
    p.add_argument("--skip-family", action="store_true")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--skip-block", action="store_true")
    args = p.parse_args()
    BUDGET = args.budget_s
    device = torch.device("cpu" if args.cpu else "cuda")
    config = MiniMaxM3Config.tiny() if args.cpu else MiniMaxM3Config.m3_1layer()
    moe = moe_bench.build_block(device, config)
    print(f"built block in {time.monotonic() - T0:.1f} s; value dtype {moe.experts.gate_up.values.dtype}", flush=True)
    correctness(moe, device, [1, 5] if args.cpu else [1, 32, 8192])
    print(f"[{time.monotonic() - T0:.0f} s]", flush=True)
    if not args.cpu:
        timer = Timer(device, quick=True)
        variants(moe, device, timer, [1, 32, 128], decode_configs)
        if not args.skip_prefill:
            variants(moe, device, timer, [8192], prefill_configs)
        if not args.skip_block:
            block_variants(moe, device, timer, [1, 32, 128], [] if args.skip_prefill else [8192])
        print(f"[{time.monotonic() - T0:.0f} s]", flush=True)
    if args.skip_family:
        return
    left = BUDGET - (time.monotonic() - T0)
    ctx = Context(device, True, Budget(max(10.0, left - 5), {"moe": 1.0}))
    from bench.run import measure_ceilings

    measure_ceilings(ctx)
    ctx.budget.begin("moe")
    print(f"ceilings: copy {ctx.ceilings.get('copy')} GB/s, matmul {ctx.ceilings.get('matmul')} TFLOP/s", flush=True)
    if not args.cpu:
        from torch._inductor.utils import run_and_get_code

        from mm3_compile.lowerings.decompose import kernel_names_in

        x = torch.randn(32, config.hidden_size, device=device).to(torch.bfloat16)
        _, code = run_and_get_code(torch.compile(moe, fullgraph=True, dynamic=False), x)
        print("kernels in the compiled block (T=32):", kernel_names_in("\n".join(code)), flush=True)
    moe_bench.run(ctx, moe)
    print(f"[{time.monotonic() - T0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
