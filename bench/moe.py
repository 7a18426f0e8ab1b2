"""The M3 MoE block (router, routed experts, shared expert) compiled, at the real widths.

Decode (1, 32, 128 tokens, CUDA-graph replays over input sets with different routes) is reported against the
copy ceiling on the MXFP8 bytes of the experts the step must read (the distinct routed experts of the sets, on
average, plus the shared expert); prefill (8192 tokens) against the bf16 matmul ceiling counting
``2*T*k*(2I*H + I*H)`` routed + ``2*T*(2I*H + I*H)`` shared FLOPs. Providers: ours (``mm3`` MoE ops, weights
dequantized in registers), the previous design (every expert dequantized to bf16, then ``torch._grouped_mm``)
and ``torch._grouped_mm`` on weights dequantized beforehand (no dequantization in the timed step). Each row
is checked first against the previous design run eagerly (the same quantization points): within 2% of the
output's max.
"""

import math

import torch

from bench.harness import Check, Context
from mm3_compile.contract import MX_BLOCK_SIZE

TOLERANCE = 2e-2  # of max |out|: bf16 GEMM outputs rounded in another order, near-tied MXFP8 activation bytes


def build_block(device, config):
    """An M3 MoE block with seeded random weights, quantized expert by expert (no full bf16 copy at once)."""
    from mm3_compile.models.moe import M3MoE
    from mm3_compile.models.tp import TPInfo

    moe = M3MoE(config, TPInfo(), torch.bfloat16, device)
    gen = torch.Generator(device=device).manual_seed(0)
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size

    def randn(*shape, fan_in):
        return (torch.randn(shape, generator=gen, device=device) / math.sqrt(fan_in)).to(torch.bfloat16)

    with torch.no_grad():
        moe.gate_weight.copy_(randn(E, H, fan_in=H).float())
        moe.correction_bias.copy_(0.05 * torch.randn(E, generator=gen, device=device))
        for weight, shape, fan_in in ((moe.experts.gate_up, (2 * I, H), H), (moe.experts.down, (H, I), I)):
            for e0 in range(0, E, 16):
                values, scales = torch.ops.mm3.mxfp8_quantize(randn(min(16, E - e0), *shape, fan_in=fan_in))
                weight.values[e0 : e0 + 16].copy_(values)
                weight.scales[e0 : e0 + 16].copy_(scales.view(torch.uint8))
        if moe.shared is not None:
            Ish = config.shared_intermediate_size
            moe.shared.gate_up.load(randn(2 * Ish, H, fan_in=H))
            moe.shared.down.load(randn(H, Ish, fan_in=Ish))
    return moe


def dequant_grouped_mm(moe, x, w1=None, w2=None):
    """The previous design: pairs sorted by expert, every expert dequantized to bf16, ``torch._grouped_mm``.

    With ``w1``/``w2`` (``[E, H, 2I]`` / ``[E, I, H]`` bf16, dequantized beforehand) the GEMMs read those instead.
    """
    from mm3_compile.kernels.moe.naive import route_ref as route
    from mm3_compile.models.mxfp8 import mxfp8_dequantize

    cfg = moe.config
    logits = torch.nn.functional.linear(x.float(), moe.gate_weight)
    ids, weights = route(logits, moe.correction_bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor)
    T, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(cfg.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    offsets = counts.cumsum(0).to(torch.int32)
    xs = x[order // k]
    if w1 is None:
        w1 = moe.experts.gate_up.dequantize(x.dtype).transpose(-2, -1)
        w2 = moe.experts.down.dequantize(x.dtype).transpose(-2, -1)
    gate_up = torch._grouped_mm(xs, w1, offs=offsets)
    values, scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up, cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit)
    ys = torch._grouped_mm(mxfp8_dequantize(values, scales.view(torch.uint8), x.dtype), w2, offs=offsets)
    y = torch.empty_like(ys).index_copy(0, order, ys).view(T, k, -1)
    out = (y.float() * weights.unsqueeze(-1)).sum(1)
    sh = moe.shared
    gu = torch.nn.functional.linear(x, sh.gate_up.dequantize(x.dtype))
    v, s = torch.ops.mm3.swiglu_oai_mxfp8_quant(gu, cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit)
    shared = torch.nn.functional.linear(mxfp8_dequantize(v, s.view(torch.uint8), x.dtype), sh.down.dequantize(x.dtype))
    return (out + shared.float()).to(x.dtype)


def expert_bytes(config) -> int:
    """MXFP8 bytes of one expert (values + one scale byte per 32), gate_up and down."""
    per = 3 * config.moe_intermediate_size * config.hidden_size
    return per + per // MX_BLOCK_SIZE


def distinct_experts(moe, xs) -> float:
    from mm3_compile.kernels.moe.naive import route_ref as route

    cfg = moe.config
    counts = []
    for x in xs:
        logits = torch.nn.functional.linear(x.float(), moe.gate_weight)
        ids, _ = route(logits, moe.correction_bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        counts.append(ids.unique().numel())
    return sum(counts) / len(counts)


def _compare(out, expected) -> Check:
    err = float((out.float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1e-30))
    return Check(bool(err <= TOLERANCE), err, f"max err {err:.1e} of max |out|")


def run(ctx: Context, moe=None) -> None:
    from mm3_compile.models import MiniMaxM3Config

    if ctx.cuda:
        # the first decode size and the prefill first: the baselines run on those two only (compile time)
        config, decode_tokens, prefill_tokens = MiniMaxM3Config.m3_1layer(), [32, 1, 128], [8192]
    else:
        config = MiniMaxM3Config.tiny()  # the harness check only: one small shape, every provider
        decode_tokens, prefill_tokens = [5], []
    device = ctx.device
    moe = moe if moe is not None else build_block(device, config)
    H, I, k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    w1 = moe.experts.gate_up.dequantize(torch.bfloat16).transpose(-2, -1)
    w2 = moe.experts.down.dequantize(torch.bfloat16).transpose(-2, -1)
    providers = [
        ("ours_compiled", ctx.compile(moe, fullgraph=True, dynamic=False)),
        (
            "dequant+grouped_mm_compiled",
            ctx.compile(lambda x: dequant_grouped_mm(moe, x), fullgraph=True, dynamic=False),
        ),
        (
            "grouped_mm_predequantized",
            ctx.compile(lambda x: dequant_grouped_mm(moe, x, w1, w2), fullgraph=True, dynamic=False),
        ),
    ]
    for T in decode_tokens[:1] + prefill_tokens + decode_tokens[1:]:
        if ctx.budget.expired():
            ctx.record(family="moe", shape=f"T{T}", provider="(all)", mode="-", error="skipped: time budget")
            continue
        prefill = T in prefill_tokens
        n_sets = 1 if prefill or not ctx.cuda else 4
        gen = torch.Generator(device=device).manual_seed(T)
        xs = [torch.randn(T, H, generator=gen, device=device).to(torch.bfloat16) for _ in range(n_sets)]
        with torch.no_grad():
            expected = dequant_grouped_mm(moe, xs[0])
        active = distinct_experts(moe, xs)
        nbytes = int((active + config.num_shared_experts) * expert_bytes(config))
        flops = 2 * T * (k + config.num_shared_experts) * 3 * I * H
        shape = f"T{T} E{config.num_experts} top{k} H{H} I{I}"
        base = {"family": "moe", "shape": shape, "dtype": "mxfp8", "kv_dtype": "-"}
        for name, fn in providers if T in (decode_tokens[0], *prefill_tokens) else providers[:1]:
            fns = [lambda x=x, fn=fn: fn(x) for x in xs]
            ctx.provider(
                base,
                name,
                fns,
                lambda out, expected=expected: _compare(out, expected),
                modes=("launched",) if prefill or not ctx.cuda else ("graph",),
                flops=flops,
                nbytes=None if prefill else nbytes,
                ceiling_kind="matmul" if prefill else "copy",
                note=f"{active:.1f} distinct experts + shared",
                slow=prefill,
            )
