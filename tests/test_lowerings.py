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
from tests.every_op import EveryOp, make_batch

PREFILL_LENGTHS = (1, 127, 128, 129, 1000)
DECODE_BATCHES = (1, 2, 7, 64)


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
    module = EveryOp(num_blocks=160, kv_cache_dtype=kv_cache_dtype, device=device)
    prefill, prefill_count = compile_counted(module.prefill, "inductor")
    decode, decode_count = compile_counted(module.decode, "inductor")

    explanation = torch._dynamo.explain(module.prefill)(*make_batch(module, [0], [5], device=device).args())
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1

    prefill(*make_batch(module, [0, 40], [3, 5], seed=1, device=device).args())  # warm-up: the dynamic graph
    decode(*make_batch(module, [130, 200, 7], [1, 1, 1], seed=2, device=device).args())
    frames = prefill_count.frame_count, decode_count.frame_count
    with torch.compiler.set_stance("fail_on_recompile"):
        for seed, length in enumerate(PREFILL_LENGTHS):
            batch = make_batch(module, [0], [length], seed=seed, device=device)
            assert_outputs_equal(prefill(*batch.args()), module.prefill(*batch.args()))
        for seed, batch_size in enumerate(DECODE_BATCHES):
            batch = make_batch(module, [130] * batch_size, [1] * batch_size, seed=seed, device=device)
            assert_outputs_equal(decode(*batch.args()), module.decode(*batch.args()))
    assert (prefill_count.frame_count, decode_count.frame_count) == frames


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
    ref_values, ref_scales = mxfp8_quantize_ref(swiglu_oai_ref(gate_up), platform.fp8_format(values.dtype))
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))
    assert (values.view(torch.uint8).int() - ref_values.view(torch.uint8).int()).abs().max() <= 1


def test_fusion_pass_leaves_other_activations_alone(device):
    torch._dynamo.reset()

    def different_limits(gate_up):
        gate, up = gate_up.float().chunk(2, dim=-1)
        act = gate.clamp(max=7.0) * torch.sigmoid(1.702 * gate.clamp(max=7.0)) * (up.clamp(-5.0, 5.0) + 1.0)
        return torch.ops.mm3.mxfp8_quantize(act)

    compiled = torch.compile(different_limits, fullgraph=True, options=mm3_compile.compile_options())
    _, (code,) = torch._inductor.utils.run_and_get_code(compiled, torch.randn(4, 64, device=device))
    assert "swiglu_oai_mxfp8" not in code


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
