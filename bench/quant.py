"""Fused SwiGLU-OAI + MXFP8 quant: ``[M, 2*3072]`` bf16 -> fp8 values ``[M, 3072]`` + E8M0 scales ``[M, 96]``.

Bytes = input read + values + scales written.  Providers: our op (eager, compiled), the pure-PyTorch
reference ``mxfp8_quantize_ref(swiglu_oai_ref(x))`` eager, and the same under torch.compile, which is
Inductor's own fusion of the reference (the target's baseline).  All are timed Python-launched and as
CUDA-graph replays.
"""

import math

import torch

from bench.harness import Check, Context
from bench.inputs import MAX_SETS
from mm3_compile import platform
from mm3_compile.kernels.mxfp8.naive import mxfp8_quantize_ref, swiglu_oai_ref

MISMATCH_LIMIT = 1e-3  # fraction of differing bytes tolerated (1-ulp sigmoid differences flip a rounding)


def shapes(ctx: Context) -> tuple[list[int], int]:
    if not ctx.cuda:
        return [8], 64
    # The target shapes (M >= 4096) first: a run that reaches its deadline loses M=64 rows first.
    return ([4096, 64] if ctx.quick else [4096, 65536, 64]), 3072


def _compare(out, expected) -> Check:
    values, scales = out
    exp_values, exp_scales = expected
    if values.shape != exp_values.shape or scales.shape != exp_scales.shape:
        return Check(False, None, f"shape {tuple(values.shape)} vs {tuple(exp_values.shape)}")
    v_bad = (values.view(torch.uint8) != exp_values.view(torch.uint8)).float().mean().item()
    s_bad = (scales.view(torch.uint8) != exp_scales.view(torch.uint8)).float().mean().item()
    ok = v_bad <= MISMATCH_LIMIT and s_bad <= MISMATCH_LIMIT
    return Check(ok, v_bad, f"differing bytes: values {v_bad:.1e}, scales {s_bad:.1e}")


def run(ctx: Context, passes=("ours", "baselines")) -> None:
    device = ctx.device
    fmt = platform.fp8_format(platform.mxfp8_value_dtype(device))

    def reference(gate_up):
        return mxfp8_quantize_ref(swiglu_oai_ref(gate_up), fmt)

    def ours(gate_up):
        return torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up)

    providers = {
        "ours": [("op", ours), ("op_compiled", ctx.compile(ours, dynamic=True))],
        # dynamic=False: Inductor's best static-shape fusion is the baseline the target names.
        "baselines": [("ref", reference), ("ref_compiled(inductor)", ctx.compile(reference, dynamic=False))],
    }
    Ms, inter = shapes(ctx)
    expected_cache = {}
    for pass_name in passes:
        for M in Ms:
            set_bytes = M * 2 * inter * 2 + M * inter + M * inter // 32
            n_sets = 1 if not ctx.cuda else max(1, min(MAX_SETS, math.ceil(4 * ctx.l2_bytes / set_bytes)))
            gen = torch.Generator(device=device).manual_seed(M)
            sets = [
                2.0 * torch.randn((M, 2 * inter), dtype=torch.bfloat16, device=device, generator=gen)
                for _ in range(n_sets)
            ]
            if M not in expected_cache:
                expected_cache[M] = reference(sets[0])
            expected = expected_cache[M]
            base = dict(family="quant", shape=f"M{M} x {2 * inter}", dtype="bf16", kv_dtype="-")
            for name, fn in providers[pass_name]:
                fns = [lambda x=x, fn=fn: fn(x) for x in sets]
                ctx.provider(
                    base,
                    name,
                    fns,
                    lambda out, expected=expected: _compare(out, expected),
                    modes=("launched", "graph"),
                    nbytes=set_bytes,
                    ceiling_kind="copy",
                )
            del sets
        if ctx.cuda:
            torch.cuda.empty_cache()
