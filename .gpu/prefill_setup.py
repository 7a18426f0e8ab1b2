"""The prefill GEMM scripts' inputs (row_group.py, ncu_prefill.py): the bench M3 MoE block on the GPU, TOK (8192)
tokens routed by the float reference, aligned to the 128-row layout with the routed experts only."""
import os, sys
sys.path.insert(0, os.getcwd())
from bench.run import _prepare_environment
_prepare_environment(False)
import torch
import mm3_compile  # noqa: F401  (registers the ops)
from bench import moe as moe_bench
from mm3_compile import platform
from mm3_compile.kernels.moe.naive import route_ref
from mm3_compile.models import MiniMaxM3Config

dev = torch.device("cuda")
cfg = MiniMaxM3Config.m3_1layer()
moe = moe_bench.build_block(dev, cfg)
ex = moe.experts
T = int(os.environ.get("TOK", "8192"))
gen = torch.Generator(device=dev).manual_seed(7)
x = torch.randn(T, cfg.hidden_size, generator=gen, device=dev).to(torch.bfloat16)
logits = torch.nn.functional.linear(x.float(), moe.gate_weight)
ids, w = route_ref(logits, moe.correction_bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor)
E, k = ex.gate_up.values.shape[0], ids.shape[1]
pairs, blocks = torch.ops.mm3.moe_align(ids, E, 128)
fmt = platform.fp8_format(ex.gate_up.values.dtype)
pw = w.reshape(-1).float()
