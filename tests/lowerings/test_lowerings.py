"""Compile guarantees for a module using every op, the fusion pass, export, and (GPU) Inductor code.

On the CPU Inductor calls the ops (their kernels run in the Triton interpreter); on a GPU the
generated code must contain our Triton kernels instead of calls of the ops.
"""

import re

import pytest
import torch
import torch._dynamo.testing

import mm3_compile
from mm3_compile import platform
from mm3_compile.kernels.mxfp8.naive import mxfp8_quantize_ref, swiglu_oai_ref
from mm3_compile.kernels.sparse_attn import decode as decode_kernels
from mm3_compile.lowerings.decompose import kernel_names_in
from tests.every_op import EveryOp, make_batch


# Sizes around a page (127-129 tokens) and past the warm-up's.  In the interpreter a 1000-token prefill
# takes 19 s and 64 decode requests 18 s (each run eagerly and compiled, for both cache dtypes): the CPU
# run stops at 300 tokens and 17 requests, the GPU adds 1000 and 4096 tokens and 64 requests.
def prefill_lengths(device) -> tuple[int, ...]:
    return (1, 127, 128, 129, 300) + ((1000, 4096) if device.type == "cuda" else ())


def decode_batches(device) -> tuple[int, ...]:
    return (1, 2, 7, 17) + ((64,) if device.type == "cuda" else ())


def assert_outputs_equal(got, expected):
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        if g.dtype.is_floating_point and g.element_size() > 1:
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        else:
            assert torch.equal(g.view(torch.uint8), e.view(torch.uint8))


def compile_counted(fn, backend):
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True, dynamic=True), counter


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@mm3_compile.dynamic_shapes()
def test_every_op_compiles_once_and_matches_eager(kv_cache_dtype, device):
    torch._dynamo.reset()
    module = EveryOp(
        num_blocks=160, kv_cache_dtype=kv_cache_dtype, device=device
    )  # 64 requests x 2 pages, or 4096 tokens
    prefill, prefill_count = compile_counted(module.prefill, "inductor")
    decode, decode_count = compile_counted(module.decode, "inductor")

    explanation = torch._dynamo.explain(module.prefill)(*make_batch(module, [0], [5], device=device).args())
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1

    prefill(*make_batch(module, [0, 40], [3, 5], seed=1, device=device).args())  # warm-up: the dynamic graph
    decode(*make_batch(module, [130, 200, 7], [1, 1, 1], seed=2, device=device).args())
    frames = prefill_count.frame_count, decode_count.frame_count
    with torch.compiler.set_stance("fail_on_recompile"):
        for seed, length in enumerate(prefill_lengths(device)):
            batch = make_batch(module, [0], [length], seed=seed, device=device)
            assert_outputs_equal(prefill(*batch.args()), module.prefill(*batch.args()))
        for seed, batch_size in enumerate(decode_batches(device)):
            batch = make_batch(module, [130] * batch_size, [1] * batch_size, seed=seed, device=device)
            assert_outputs_equal(decode(*batch.args()), module.decode(*batch.args()))
    assert (prefill_count.frame_count, decode_count.frame_count) == frames


def test_decode_workspace_is_used_in_place(device):
    """The decode workspace is a mutated module buffer: Inductor re-inplaces the op on it, so a compiled step
    neither copies it nor zeroes counters of its own (no memset before the attention launch)."""
    torch._dynamo.reset()
    module = EveryOp(num_blocks=16, device=device)
    batch = make_batch(module, [130, 200], [1, 1], seed=2, device=device)
    compiled = torch.compile(module.decode, fullgraph=True)
    with torch._inductor.utils.fresh_cache():
        out, (code,) = torch._inductor.utils.run_and_get_code(compiled, *batch.args())
    counters = decode_kernels.ARRIVAL_COUNTERS
    assert not re.search(rf"empty_strided_\w+\(\({counters}, \)", code), "the workspace is copied"
    if device.type == "cpu":  # the op is called with the buffer itself (a graph input)
        (call,) = re.findall(r"sparse_attn_decode_with_workspace\.default\(([^)]*)\)", code)
        workspace_arg = call.split(", ")[5]
        assert re.search(rf"{workspace_arg} = rand_strided\(\({counters}, \)", code), code
    assert_outputs_equal(out, module.decode(*batch.args()))
    assert not module.decode_workspace.any()


def unfused_moe_activation(gate_up, limit=7.0):
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return torch.ops.mm3.mxfp8_quantize(gate * torch.sigmoid(1.702 * gate) * (up + 1.0))


def mm3_calls(code: str) -> list[str]:
    return re.findall(r"torch\.ops\.mm3\.(\w+)\.default\(", code)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fusion_pass_rewrites_unfused_swiglu(dtype, device):
    torch._dynamo.reset()
    gate_up = (torch.randn(33, 128) * 4).to(dtype).to(device)
    compiled = torch.compile(unfused_moe_activation, fullgraph=True, options=mm3_compile.compile_options())
    (values, scales), (code,) = torch._inductor.utils.run_and_get_code(compiled, gate_up)
    if device.type == "cpu":
        assert mm3_calls(code) == ["swiglu_oai_mxfp8_quant"]
    else:
        assert mm3_calls(code) == [] and "_swiglu_oai_mxfp8_kernel" in code
    fused_values, fused_scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up)  # the same kernel, eagerly
    assert torch.equal(values.view(torch.uint8), fused_values.view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), fused_scales.view(torch.uint8))
    ref_values, ref_scales = mxfp8_quantize_ref(swiglu_oai_ref(gate_up), platform.fp8_format(values.dtype))
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))
    diff = (values.view(torch.uint8).int() - ref_values.view(torch.uint8).int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-3  # sigmoid's last ulp, as in test_quant


def test_fusion_pass_with_a_dynamic_token_dim(device):
    """Serving code compiles with a dynamic token dim (the hidden size stays static): the activation
    still fuses.  (With every dim dynamic, ``dynamic=True``, chunk's split point (s + 1) // 2 is not
    provably half of s, so the pass leaves the user's formula.)"""
    torch._dynamo.reset()
    compiled = torch.compile(unfused_moe_activation, fullgraph=True, options=mm3_compile.compile_options())
    gate_up = (torch.randn(5, 128) * 4).to(device)
    torch._dynamo.mark_dynamic(gate_up, 0)
    with mm3_compile.dynamic_shapes():
        (values, scales), (code,) = torch._inductor.utils.run_and_get_code(compiled, gate_up)
    assert "swiglu_oai_mxfp8" in code
    fused_values, fused_scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up)
    assert torch.equal(values.view(torch.uint8), fused_values.view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), fused_scales.view(torch.uint8))


def _half_precision_formula(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)  # no upcast: the user's formula runs in fp16
    return torch.ops.mm3.mxfp8_quantize(gate * torch.sigmoid(1.702 * gate) * (up + 1.0))


def _negative_limit(gate_up):
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=-1.0)
    return torch.ops.mm3.mxfp8_quantize(gate * torch.sigmoid(1.702 * gate) * (up.clamp(1.0, -1.0) + 1.0))


@pytest.mark.parametrize(
    "formula, dtype, fused",
    [
        (_half_precision_formula, torch.float16, False),
        (_negative_limit, torch.float32, False),
        (unfused_moe_activation, torch.float64, True),  # fused on the fp32 upcast, which it accepts
    ],
)
def test_fusion_pass_keeps_what_the_fused_op_would_compute_differently(formula, dtype, fused, device):
    """The fused op computes in fp32 and refuses negative limits: an fp16 formula without an upcast
    (whose products overflow where fp32's do not) and a negative limit stay as written; every case
    compiles to the user's computation."""
    torch._dynamo.reset()
    gate_up = torch.ones(1, 64, dtype=dtype, device=device)
    gate_up[0, 0] = gate_up[0, 32] = 300  # 300 * 300 overflows fp16
    compiled = torch.compile(formula, fullgraph=True, options=mm3_compile.compile_options())
    (values, scales), (code,) = torch._inductor.utils.run_and_get_code(compiled, gate_up)
    assert ("swiglu_oai_mxfp8" in code) == fused  # the op on CPU, its kernel on a GPU
    eager_values, eager_scales = formula(gate_up)
    assert torch.equal(scales.view(torch.uint8), eager_scales.view(torch.uint8))
    diff = (values.view(torch.uint8).int() - eager_values.view(torch.uint8).int()).abs()
    assert diff.max() <= 1  # Inductor's fused sigmoid vs eager's: the last ulp may round either way


def test_fusion_pass_only_on_checked_torch_versions(monkeypatch):
    """Like the lowerings, the pass rewrites through Inductor internals: unknown torch versions get none."""
    from mm3_compile import lowerings

    monkeypatch.setattr(lowerings, "torch_version", lambda: (2, 99))
    assert mm3_compile.compile_options() == {}


def test_fusion_pass_leaves_other_activations_alone(device):
    torch._dynamo.reset()

    def different_limits(gate_up):
        gate, up = gate_up.float().chunk(2, dim=-1)
        act = gate.clamp(max=7.0) * torch.sigmoid(1.702 * gate.clamp(max=7.0)) * (up.clamp(-5.0, 5.0) + 1.0)
        return torch.ops.mm3.mxfp8_quantize(act)

    compiled = torch.compile(different_limits, fullgraph=True, options=mm3_compile.compile_options())
    x = torch.randn(4, 64, device=device) * 4
    (values, scales), (code,) = torch._inductor.utils.run_and_get_code(compiled, x)
    assert "swiglu_oai_mxfp8" not in code
    eager_values, eager_scales = different_limits(x)  # still the computation the user wrote
    assert torch.equal(scales.view(torch.uint8), eager_scales.view(torch.uint8))
    diff = (values.view(torch.uint8).int() - eager_values.view(torch.uint8).int()).abs()
    assert diff.max() <= 1  # Inductor's fused sigmoid vs eager's: the last ulp may round either way


def test_pass_uuid_keys_the_platform():
    """Inductor's FX graph cache includes the pass uuid: a gfx942 trace never reuses an sm_90 graph."""
    with platform.emulate("sm_90"):
        ocp = mm3_compile.compile_options()["post_grad_custom_post_pass"].uuid()
    with platform.emulate("gfx942"):
        fnuz = mm3_compile.compile_options()["post_grad_custom_post_pass"].uuid()
    assert ocp != fnuz and "gfx942" in fnuz


def test_export_keeps_ops_and_round_trips(tmp_path, device):
    module = EveryOp(num_blocks=8, device=device)
    batch = make_batch(module, [0, 100], [4, 60], device=device)
    exported = torch.export.export(module, batch.args(), strict=False)
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    for op in ("kv_cache_write", "index_topk", "sparse_attn_prefill", "swiglu_oai_mxfp8_quant", "mxfp8_quantize"):
        assert f"mm3.{op}.default" in targets, (op, targets)
    path = tmp_path / "every_op.pt2"
    torch.export.save(exported, path)
    loaded = torch.export.load(path)
    expected = EveryOp(num_blocks=8, device=device).prefill(*batch.args())
    assert_outputs_equal(loaded.module()(*batch.args()), expected)


# ----------------------------------------------------------------------------------------------
# GPU: the kernels inside Inductor's code, CUDA graphs, in-place cache writes, AOTInductor.


def compiled_step_code(module, step, batch, **compile_kwargs):
    torch._dynamo.reset()
    compiled = torch.compile(getattr(module, step), fullgraph=True, **compile_kwargs)
    with torch._inductor.utils.fresh_cache():
        out, codes = torch._inductor.utils.run_and_get_code(compiled, *batch.args())
    return out, "\n".join(codes)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_gpu_inductor_code_contains_our_kernels(kv_cache_dtype, step, device):
    module = EveryOp(num_blocks=64, D=128, kv_cache_dtype=kv_cache_dtype, device=device)
    batch = make_batch(
        module, [0, 300] if step == "prefill" else [300, 700], [200, 60] if step == "prefill" else [1, 1], device=device
    )
    out, code = compiled_step_code(module, step, batch)
    assert "async_compile.triton(" in code
    assert mm3_calls(code) == [], "an mm3 op is still called opaquely"
    kernels = kernel_names_in(code)
    for expected in ("_kv_cache_write_kernel", "_swiglu_oai_mxfp8_kernel", "_mxfp8_quantize_kernel"):
        assert expected in kernels, kernels
    assert_outputs_equal(out, getattr(module, step)(*batch.args()))


@pytest.mark.gpu
def test_gpu_emulated_platform_changes_generated_kernels(device):
    def quantize(x):
        return torch.ops.mm3.mxfp8_quantize(x)

    x = torch.randn(64, 256, device=device)
    codes = {}
    for target in ("sm_90", "gfx942"):
        with platform.emulate(target):
            torch._dynamo.reset()
            with torch._inductor.utils.fresh_cache():
                (values, _), (code,) = torch._inductor.utils.run_and_get_code(
                    torch.compile(quantize, fullgraph=True), x
                )
            assert values.dtype == platform.mxfp8_value_dtype(device)
            codes[target] = code
    assert codes["sm_90"] != codes["gfx942"]
    # FP8_MAX is a constant of the generated launch: 448 for OCP e4m3, 240 for FNUZ e4m3.
    assert "448.0" in codes["sm_90"] and "240.0" not in codes["sm_90"]
    assert "240.0" in codes["gfx942"] and "448.0" not in codes["gfx942"]


@pytest.mark.gpu
def test_gpu_fusion_pass_emits_fused_kernel(device):
    torch._dynamo.reset()
    gate_up = (torch.randn(300, 2 * 3072, device=device) * 4).to(torch.bfloat16)
    compiled = torch.compile(unfused_moe_activation, fullgraph=True, options=mm3_compile.compile_options())
    with torch._inductor.utils.fresh_cache():
        (values, scales), (code,) = torch._inductor.utils.run_and_get_code(compiled, gate_up)
    assert kernel_names_in(code) == {"_swiglu_oai_mxfp8_kernel": 1}
    fused_values, fused_scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up)  # the same kernel, eagerly
    assert torch.equal(values.view(torch.uint8), fused_values.view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), fused_scales.view(torch.uint8))
    ref_values, ref_scales = mxfp8_quantize_ref(swiglu_oai_ref(gate_up), platform.fp8_format(values.dtype))
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))


def count_cuda_graphs(device) -> int:
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_container(device.index or 0).tree_manager
    stack = [node for roots in manager.roots.values() for node in roots]
    count = 0
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(child for children in node.children.values() for child in children)
    return count


@pytest.mark.gpu
def test_gpu_reduce_overhead_replays_decode_without_rerecording(device):
    torch._dynamo.reset()
    module = EveryOp(num_blocks=64, D=128, device=device)
    compiled = torch.compile(module.decode, fullgraph=True, mode="reduce-overhead")
    batches = [make_batch(module, [300, 129, 1000, 5], [1, 1, 1, 1], seed=s, device=device) for s in range(6)]
    for batch in batches[:3]:  # warm-up, record, first replay
        compiled(*batch.args())
    recorded = count_cuda_graphs(device)
    for batch in batches[3:]:
        got = [t.clone() for t in compiled(*batch.args())]
        assert_outputs_equal(got, module.decode(*batch.args()))
    assert recorded >= 1 and count_cuda_graphs(device) == recorded


@pytest.mark.gpu
@pytest.mark.parametrize(
    "as_buffer, kind",
    [(True, "bf16"), (False, "bf16"), (False, "fp8_typed"), (False, "fp8_bytes"), (False, "index")],
)
def test_gpu_kv_cache_write_is_in_place(as_buffer, kind, device):
    """A 1 GiB cache (module buffer or graph input) is written in place, also through the FP8 byte view the
    kernel takes of a typed or uint8 cache, and in the model's index-K layout [pages, 1, 128, Didx]."""
    torch._dynamo.reset()
    spec = "fp8" if kind.startswith("fp8") else "auto"
    Hkv, D = (1, 64) if kind == "index" else (4, 128)
    storage = platform.resolve_kv_cache_dtype(spec, device, torch.bfloat16)
    cache_dtype = torch.uint8 if kind == "fp8_bytes" else storage
    num_pages = (1 << 30) // (Hkv * 128 * 2 * D * cache_dtype.itemsize)
    cache = torch.zeros(num_pages, Hkv, 128, 2 * D, dtype=cache_dtype, device=device)
    k = torch.randn(64, Hkv, D, dtype=torch.bfloat16, device=device)
    slots = torch.randperm(num_pages * 128, device=device)[:64]

    class Writer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if as_buffer:
                self.register_buffer("cache", cache)

        def forward(self, k, slots, cache=None):
            target = self.cache if as_buffer else cache
            torch.ops.mm3.kv_cache_write(k, k * 2, target, slots, spec)
            return target[0, 0, 0, :4].float().sum()

    compiled = torch.compile(Writer(), fullgraph=True)
    args = (k, slots) if as_buffer else (k, slots, cache)
    compiled(*args)  # compile
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    compiled(*args)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < cache.numel() * cache.element_size() // 8, "the cache was copied"
    rows = cache.permute(0, 2, 1, 3).reshape(-1, Hkv, 2 * D)[slots.long()]  # [64, Hkv, 2D]
    want = torch.cat([k, k * 2], dim=-1)
    if storage != torch.bfloat16:  # |k| < 448: torch's RNE cast gives the bytes the kernel writes
        want = want.to(storage)
    assert torch.equal(rows.view(torch.uint8), want.view(torch.uint8))


if torch.cuda.is_available():
    from torch.testing._internal.common_utils import TestCase

    class TestDecoderStepKernels(TestCase):
        """The user Triton kernels one compiled decoder step launches: names and counts, stable across runs."""

        @pytest.mark.gpu
        def test_kernel_list(self):
            module = EveryOp(num_blocks=64, D=128, kv_cache_dtype="fp8", device="cuda")
            batch = make_batch(module, [300, 129, 1000], [1, 1, 1], device="cuda")
            _, code = compiled_step_code(module, "decode", batch)
            summary = "\n".join(f"{name} x{count}" for name, count in kernel_names_in(code).items())
            self.assertExpectedInline(
                summary,
                """\
_index_score_kernel x1
_index_topk_kernel x1
_kv_cache_write_kernel x1
_mxfp8_quantize_kernel x1
_swiglu_oai_mxfp8_kernel x1
sparse_attn_fwd_kernel x1""",
            )
