"""Attention code generation: GPU targets compiled ahead on the CPU, symbolic traces, no recompiles."""

import pytest
import torch

from mm3_compile.kernels._launch import size_hint
from mm3_compile.kernels.sparse_attn import decode as decode_kernels
from mm3_compile.ops import decode_workspace
from mm3_compile.ops._kv import resolve_cache_view
from tests.python_process import run_python
from tests.sparse_attn.helpers import build


def each_variant(arity: int) -> str:
    """A compile script's tail: ``compile_variant`` on each group of ``arity`` arguments, in one process (an
    interpreter start per variant cost ~5-8 s); a failing variant is named on stderr."""
    return f"""
for i in range(1, len(sys.argv), {arity}):
    variant = sys.argv[i : i + {arity}]
    try:
        compile_variant(*variant)
    except Exception:
        print("failed variant:", variant, file=sys.stderr)
        raise
"""


AOT_COMPILE_SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mm3_compile import platform
from mm3_compile.kernels.fp8 import FP8Launch
from mm3_compile.kernels.sparse_attn import schedule, union



def compile_variant(target_name, kv_type, G, D, block_q, varlen, scale_mode, native, programs):
    target = GPUTarget("cuda", 90, 32) if target_name == "sm_90" else GPUTarget("hip", target_name, 64)
    kernel = union.sparse_attn_fwd_kernel
    names = kernel.arg_names
    G, D, block_q, scale_mode, programs = int(G), int(D), int(block_q), int(scale_mode), int(programs)
    block_h = schedule.head_block(G, block_q)
    fmt = None if kv_type == "*bf16" else platform.fp8_format(
        platform.FP8_E4M3_FNUZ if "b8" in kv_type else platform.FP8_E4M3_OCP)
    decode_tile = varlen != "1" and block_q == 1
    # a one-token decode grid of `programs` (132 SMs on the H200; past one wave, programs of 2 blocks)
    options = schedule.launch_options("nvidia" if target_name == "sm_90" else "amd", 132, block_q * block_h,
                                      prefill=varlen == "1", fp8_decode=fmt is not None and decode_tile,
                                      decode_programs=programs if decode_tile else None,
                                      blocks_per_program=2 if programs > 132 else None,
                                      fp16_dots=schedule.fp16_dots(fmt, scale_mode))
    v_pairs = options.pop("V_PAIRS")
    constexprs = dict(G=G, D=D, BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_T=16, VARLEN=varlen == "1",
                      SPLIT=varlen != "1", SCALE_MODE=scale_mode, DOT_FP32=options.pop("DOT_FP32"),
                      CONVERT_V_FIRST=options.pop("CONVERT_V_FIRST"), V_PAIRS=v_pairs,
                      FP16_DOTS=schedule.fp16_dots(fmt, scale_mode), PDL=target_name == "sm_90" and varlen != "1",
                      **FP8Launch(fmt, native_load=native == "1").constexprs())
    # the merge of a 16-split one-token decode (the largest split count of T = 16)
    constexprs["MAX_SPLITS"] = union.max_splits(16, 16)
    # a one-token decode tile picks its pages from a 32768-token request's table row (256 entries)
    constexprs["TABLE_ROW"] = union.table_row(256, decode_tile)
    pointers = dict(q_ptr="*bf16", kv_ptr=kv_type, out_ptr="*bf16", partial_ptr="*bf16", k_scale_ptr="*fp32",
                    v_scale_ptr="*fp32", lse_ptr="*fp32", arrivals_ptr="*i32")

    def arg_type(name):
        if name in constexprs:
            return "constexpr"
        if name in pointers:
            return pointers[name]
        return "*i32" if name.endswith("_ptr") else "fp32" if name == "qk_scale" else "i32"

    signature = {n: arg_type(n) for n in names}
    # Real launches specialise 16-divisible pointers and strides; without the hint loads do not vectorise.
    aligned = [n for n in names if n.endswith("_ptr") or n in ("stride_qt", "stride_qh", "stride_kb", "stride_kh",
                                                               "stride_kt")]
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constexprs.items()},
                       {(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(source, target=target, options=options)
    if target_name == "sm_90" and native == "1":  # typed FP8 V is transposed in 16 bits (jit.load_block), not bytes
        assert "ld.shared.b8" not in compiled.asm["ptx"] and "ld.shared.u8" not in compiled.asm["ptx"]
    if v_pairs:  # V's bytes copied and transposed in 16 bits, then split in registers (jit.split_pairs)
        assert ".trans.shared.b16" in compiled.asm["ptx"] and "cvt.rn.f16x2.e4m3x2" in compiled.asm["ptx"]
    if constexprs["PDL"]:
        head = compiled.asm["ptx"].split("griddepcontrol.wait")[0]
        # nothing is read before PDL's wait; one-token tiles prefetch their first dependent loads there
        assert "ld.global" not in head and "atom." not in head, head[-3000:]
        # seq_len, list, table row, q: one or more asm each; one each for scalar FP8 scales
        prefetches = head.count("prefetch.global.L2")
        expected = 4 + (2 if scale_mode == 1 else 0)
        assert prefetches >= expected if decode_tile else prefetches == 0, head[-3000:]
    if decode_tile:  # its dependent merge launch, at the merge's widest row tile
        merge = union.split_merge_kernel
        merge_constexprs = dict(D=D, BLOCK_R=schedule.MERGE_MAX_ROWS, SCALE_MODE=scale_mode,
                                FP16_DOTS=constexprs["FP16_DOTS"], MAX_SPLITS=constexprs["MAX_SPLITS"],
                                PDL=constexprs["PDL"])
        merge_pointers = dict(partial_ptr="*bf16", lse_ptr="*fp32", out_ptr="*bf16", v_scale_ptr="*fp32")
        merge_names = merge.arg_names
        merge_source = ASTSource(
            merge, {n: "constexpr" if n in merge_constexprs else merge_pointers.get(n, "i32") for n in merge_names},
            {(merge_names.index(k),): v for k, v in merge_constexprs.items()},
            {(merge_names.index(n),): [["tt.divisibility", 16]] for n in merge_pointers})
        merged = triton.compile(merge_source, target=target, options=dict(num_warps=schedule.MERGE_WARPS))
        if merge_constexprs["PDL"]:  # the partials come from the attention grid: nothing is read before the wait
            head = merged.asm["ptx"].split("griddepcontrol.wait")[0]
            assert "ld.global" not in head, head[-3000:]
    print("compiled", sorted(compiled.asm), flush=True)

""" + each_variant(9)


KV_CENTRIC_COMPILE_SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mm3_compile import platform
from mm3_compile.kernels.fp8 import FP8Launch
from mm3_compile.kernels.sparse_attn import kv_centric as kc
from mm3_compile.kernels.sparse_attn import schedule

target = GPUTarget("cuda", 90, 32)


def build(kernel, constexprs, pointers, aligned_ints, options):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "qk_scale" else
                 "*i32" if n.endswith("_ptr") else "i32") for n in names}
    aligned = [n for n in names if n.endswith("_ptr") or n in aligned_ints]
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constexprs.items()},
                       {(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    triton.compile(source, target=target, options=options)


def compile_variant(kv_type, G, scale_mode, native, model):
    G, scale_mode, native = int(G), int(scale_mode), native == "1"
    block_tok = kc.tile_tokens(G)
    block_h = schedule.head_block(G, block_tok)
    fmt = None if kv_type == "*bf16" else platform.fp8_format(platform.FP8_E4M3_OCP)
    options = schedule.launch_options("nvidia", 132, block_tok * block_h, prefill=True)
    dot_fp32 = options.pop("DOT_FP32")
    convert_v_first = options.pop("CONVERT_V_FIRST")
    v_pairs = options.pop("V_PAIRS")
    build(kc.pair_keys_kernel, dict(BLOCK_TOK=kc.KEY_TOKENS, BLOCK_T=16), {}, (), dict(num_warps=4))
    build(kc.kv_centric_attn_kernel,
          dict(G=G, D=128, BLOCK_H=block_h, BLOCK_TOK=block_tok, PAIRS=block_tok * kc.TILES_PER_PROGRAM, SLOT_BITS=4,
               SCALE_MODE=scale_mode, DOT_FP32=dot_fp32, CONVERT_V_FIRST=convert_v_first, V_PAIRS=v_pairs,
               **FP8Launch(fmt, native_load=native).constexprs(),
               FOLD_SCALES=model == "*fp16" and kv_type != "*bf16" and scale_mode != 2),
          dict(q_ptr=model, kv_ptr=kv_type, order_ptr="*i64", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
               partial_ptr="*fp16", lse_ptr="*fp32", unscale_ptr="*fp32"),
          ("stride_qt", "stride_qh", "stride_kb", "stride_kh", "stride_kt"), options)
    build(kc.merge_slots_kernel,
          dict(G=G, D=128, BLOCK_R=kc.MERGE_ROWS, BLOCK_T=16, SCALE_OUT=model == "*fp16" and scale_mode == 1),
          dict(partial_ptr="*fp16", lse_ptr="*fp32", unscale_ptr="*fp32", out_ptr=model, v_scale_ptr="*fp32"), (),
          dict(num_warps=4))
    print("compiled", flush=True)

""" + each_variant(5)


def test_launch_choices_read_size_hints_without_guards():
    """Under dynamic shapes the split/stage choice reads the example batch and adds no guard."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    batch = env.create_symintnode(env.create_symbol(32, ConstantSource("batch"), DimDynamic.DYNAMIC), hint=32)
    assert size_hint(batch * 4) == 128 and size_hint(7) == 7
    assert size_hint(env.create_unbacked_symint()) is None
    assert not env.guards


def test_compiled_caller_does_not_recompile_when_batch_varies(device):
    """Token counts, request counts and cache sizes are symbolic through the fakes: one graph serves all."""
    import torch._dynamo.testing

    def step(q, kv_cache, topk_idx, block_table, cu_seqlens_q, seq_lens):
        out = torch.ops.mm3.sparse_attn_prefill(q * 1, kv_cache, topk_idx, block_table, cu_seqlens_q, seq_lens, 0.125)
        one = (q[: seq_lens.shape[0]], kv_cache, topk_idx[:, : seq_lens.shape[0]], block_table, seq_lens)
        dec = torch.ops.mm3.sparse_attn_decode(*one, 0.125)
        dec_ws = torch.ops.mm3.sparse_attn_decode_with_workspace(*one, workspace, 0.125)
        return out.float().sum(-1), dec, dec_ws

    torch._dynamo.reset()
    workspace = decode_workspace(device)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)

    def args(reqs, seed):
        case = build(device, reqs, D=64, Hkv=1, G=2, T=2, seed=seed)
        return (case.q, case.kv_cache, case.topk_idx, case.block_table, case.cu_seqlens_q, case.seq_lens)

    # Duck sizing would tie tiny sizes that happen to be equal (e.g. 4 pages and 4 heads) together.
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        compiled(*args([(140, 3), (20, 2)], 0))
    frames = counter.frame_count
    with torch.compiler.set_stance("fail_on_recompile"), torch.fx.experimental._config.patch(use_duck_shape=False):
        for reqs in ([(300, 4), (10, 2), (130, 3)], [(260, 5), (129, 2)]):
            inputs = args(reqs, len(reqs))
            for got, expected in zip(compiled(*inputs), step(*inputs)):
                torch.testing.assert_close(got, expected)
    assert counter.frame_count == frames


@pytest.mark.gpu
def test_gpu_launchers_trace_with_symbolic_shapes(device):
    """make_fx(symbolic) records the kernels (wrap_triton) with symbolic token counts; the graph replays other sizes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mm3_compile.kernels.sparse_attn import prefill as prefill_kernels

    def tensors(case):
        view, _ = resolve_cache_view(case.kv_cache, case.kv_cache_dtype, case.q.dtype)
        return case.q, view, case.topk_idx, case.block_table, case.cu_seqlens_q, case.seq_lens

    def prefill(q, kv, topk, table, cu, lens):
        return prefill_kernels.sparse_attn_prefill(q, kv, None, topk, table, cu, lens, 0.125, None, None, 0)

    def decode(q, kv, topk, table, cu, lens):
        return decode_kernels.sparse_attn_decode(q, kv, None, topk, table, lens, 0.125, None, None, 0)

    workspace = decode_workspace(device)

    def decode_on_workspace(q, kv, topk, table, cu, lens):
        return decode_kernels.sparse_attn_decode(
            q, kv, None, topk, table, lens, 0.125, None, None, 0, counters=workspace
        )

    first = build(device, [(700, 300), (300, 300)], D=128, Hkv=2, G=8, T=16, seed=1)
    second = build(device, [(900, 17), (200, 17), (1500, 17)], D=128, Hkv=2, G=8, T=16, seed=2)
    for fn in (prefill, decode, decode_on_workspace):
        graph = make_fx(fn, tracing_mode="symbolic")(*tensors(first))
        assert "triton_kernel_wrapper" in graph.code
        # a symbolic split count may exceed 1: counters zeroed per call, unless they are the caller's workspace
        if fn is not prefill:
            assert ("aten.zeros" in graph.code) == (fn is decode), graph.code
        torch.testing.assert_close(graph(*tensors(second)), fn(*tensors(second)), atol=0, rtol=0)
    assert not workspace.any()


# target, kv_type, G, D, block_q, varlen, scale_mode, native, decode programs
GPU_TARGET_VARIANTS = [
    ("sm_90", "*bf16", 16, 128, 8, 1, 0, 0, 1),  # TP1 prefill tile
    ("sm_90", "*bf16", 16, 128, 1, 0, 0, 0, 1),  # TP1 bf16 decode, 3 stages
    ("sm_90", "*u8", 8, 64, 16, 1, 2, 0, 1),  # FP8 bytes, per-slot scales, D 64
    ("gfx942", "*fp8e4b8", 16, 128, 1, 0, 1, 1, 1),  # split decode on MI300: typed e4m3fnuz
    ("sm_90", "*fp8e4nv", 8, 128, 1, 0, 1, 1, 1),  # TP8 B1 decode on the H200: typed e4m3fn, scalar scale, 4 warps
    ("sm_90", "*fp8e4nv", 16, 128, 1, 0, 2, 1, 1),  # TP1 B1 decode, per-slot scales (bf16 dots), 4 warps
    ("sm_90", "*fp8e4nv", 8, 128, 1, 0, 1, 1, 256),  # TP8 B32 decode: 2-block programs, V as int16 pairs
]


def test_kernels_compile_for_gpu_targets():
    """The interpreter accepts things GPU compilation rejects (e.g. non-constexpr globals): compile ahead of time,
    every variant in one process (a failure names its variant on stderr).  A PDL build (sm_90 decode) reads no
    memory before its wait, and one-token tiles issue their L2 prefetches there."""
    args = [str(a) for variant in GPU_TARGET_VARIANTS for a in variant]
    result = run_python(AOT_COMPILE_SCRIPT, *args, env_drop=("TRITON_INTERPRET",))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("compiled") == len(GPU_TARGET_VARIANTS), result.stdout


# kv_type, G, scale_mode, native, model
KV_CENTRIC_VARIANTS = [
    ("*bf16", 16, 0, 0, "*bf16"),
    ("*fp8e4nv", 8, 1, 1, "*bf16"),
    ("*u8", 16, 2, 0, "*bf16"),
    ("*fp8e4nv", 16, 1, 1, "*fp16"),  # scales folded (fp16 model)
]


def test_kv_centric_kernels_compile_for_sm90():
    """The KV-centric prefill kernels compile for the H200 (the CPU tests run them in the interpreter), every
    variant in one process (a failure names its variant on stderr)."""
    args = [str(a) for variant in KV_CENTRIC_VARIANTS for a in variant]
    result = run_python(KV_CENTRIC_COMPILE_SCRIPT, *args, env_drop=("TRITON_INTERPRET",))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("compiled") == len(KV_CENTRIC_VARIANTS), result.stdout
