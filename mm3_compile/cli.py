"""``mm3-compile``: the demo (main job) and the platform table.

    mm3-compile demo [--device cpu|cuda] [--emulate gfx942] ...
    mm3-compile platform

Without a GPU the kernels run in the Triton interpreter (``import mm3_compile`` switches it on).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse(argv):
    parser = argparse.ArgumentParser(prog="mm3-compile", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a tiny MiniMax-M3 workload eagerly and compiled, and report")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    demo.add_argument("--emulate", default=None, help="answer FP8 questions as this target (sm_90, gfx942, ...)")
    demo.add_argument("--tokens", type=int, default=None, help="MoE activation rows to quantize")
    sub.add_parser("platform", help="print the FP8 resolution table for this device and every emulated target")
    return parser.parse_args(argv)


def _select_device(requested: str) -> str:
    import torch  # importing torch does not import triton

    device = requested
    if requested == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA/ROCm device is visible")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise SystemExit("--device cpu on a machine with a GPU: run with TRITON_INTERPRET=1 set in the environment")
    return device


def _table(rows: list[dict[str, str]]) -> str:
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines.append("  ".join("-" * widths[c] for c in columns))
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


def _timed(fn, *args, repeats: int = 3):
    import torch

    fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, (time.perf_counter() - start) / repeats


def quant_demo(device: str, tokens: int | None) -> list[dict[str, str]]:
    """Fused SwiGLU-OAI + MXFP8 on a real-shaped M3 MoE activation, eager and compiled."""
    import torch

    from mm3_compile import platform
    from mm3_compile.kernels.mxfp8.naive import mxfp8_dequantize_ref, mxfp8_quantize_ref, swiglu_oai_ref

    tokens = tokens or (4096 if device == "cuda" else 64)
    intermediate = 3072  # M3 expert intermediate size
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(tokens, 2 * intermediate, generator=gen) * 3).to(torch.bfloat16).to(device)

    def moe_activation(gate_up):
        values, scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up, 1.702, 1.0, 7.0)
        return values, scales, values.float() * torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)

    explanation = torch._dynamo.explain(moe_activation)(gate_up)
    compiled = torch.compile(moe_activation, fullgraph=True)
    (values, scales, _), eager_s = _timed(moe_activation, gate_up)
    (c_values, c_scales, _), compiled_s = _timed(compiled, gate_up)

    fmt = platform.fp8_format(platform.mxfp8_value_dtype(gate_up.device))
    act = swiglu_oai_ref(gate_up)
    ref_values, ref_scales = mxfp8_quantize_ref(act, fmt)
    code_diff = (values.view(torch.uint8).int() - ref_values.view(torch.uint8).int()).abs()
    dequant_err = (mxfp8_dequantize_ref(values, scales) - act).abs().max() / act.abs().max()
    return [
        {"check": "op", "value": "mm3::swiglu_oai_mxfp8_quant"},
        {"check": "input", "value": f"gate_up {list(gate_up.shape)} {gate_up.dtype} on {device}"},
        {"check": "outputs", "value": f"values {values.dtype}, scales {scales.dtype} {list(scales.shape)}"},
        {"check": "graph breaks (fullgraph=True)", "value": str(explanation.graph_break_count)},
        {"check": "scales == reference", "value": str(torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8)))},
        {"check": "max |code - reference code|", "value": str(code_diff.max().item())},
        {"check": "max |dequant - fp32 act| / max |act|", "value": f"{dequant_err.item():.3g}"},
        {"check": "compiled == eager", "value": str(torch.equal(values.view(torch.uint8), c_values.view(torch.uint8)) and torch.equal(scales.view(torch.uint8), c_scales.view(torch.uint8)))},
        {"check": "time eager / compiled", "value": f"{eager_s * 1e3:.2f} ms / {compiled_s * 1e3:.2f} ms"},
    ]


def main(argv=None) -> int:
    args = _parse(argv)
    if args.command == "platform":
        _select_device("auto")
        from mm3_compile import platform

        print(_table(platform.resolution_table()))
        return 0

    device = _select_device(args.device)
    if args.emulate:
        os.environ["MM3_EMULATE"] = args.emulate
    import torch

    from mm3_compile import platform

    p = platform.platform_for(torch.device(device))
    print(f"mm3-compile demo on {device}" + (" (Triton interpreter)" if platform.interpreting() else ""))
    print(_table([p.describe()]))
    print()
    print(_table(quant_demo(device, args.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
