"""The quant ops inside torch.compile(fullgraph=True): no graph breaks, eager results, no recompiles."""

import pytest
import torch
import torch._dynamo.testing

from mm3_compile import platform
from mm3_compile.contract import E8M0_BIAS, MX_BLOCK_SIZE


def quantize_moe_activation(gate_up, x):
    """A caller mixing our ops with ordinary torch code around them."""
    act_values, act_scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up * 1.5, 1.702, 1.0, 7.0)
    x_values, x_scales = torch.ops.mm3.mxfp8_quantize(x + 1)
    dequant = act_values.float() * torch.exp2(act_scales.float() - E8M0_BIAS).repeat_interleave(MX_BLOCK_SIZE, dim=-1)
    return dequant.sum(-1), x_values, x_scales


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_fullgraph_no_breaks_matches_eager_no_recompiles(backend, target, device):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(quantize_moe_activation, backend=counter, fullgraph=True, dynamic=True)

    def inputs(tokens):
        g = torch.Generator().manual_seed(tokens)
        gate_up = torch.randn(tokens, 128, generator=g).to(device)
        return gate_up, torch.randn(tokens, 64, generator=g).to(device)

    with platform.emulate(target):
        explanation = torch._dynamo.explain(quantize_moe_activation)(*inputs(5))
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1

        for tokens in (1, 7):  # size 1 specialises; 7 makes the first dynamic graph
            compiled(*inputs(tokens))
        frames = counter.frame_count
        with torch.compiler.set_stance("fail_on_recompile"):
            for tokens in (64, 300, 7, 2):
                args = inputs(tokens)
                got = compiled(*args)
                expected = quantize_moe_activation(*args)
                torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)  # Inductor reorders the sum
                for a, e in zip(got[1:], expected[1:]):
                    assert a.dtype == e.dtype and torch.equal(a.view(torch.uint8), e.view(torch.uint8))
        assert counter.frame_count == frames
        assert got[1].dtype == platform.mxfp8_value_dtype(device)


def test_emulated_platform_changes_traced_dtype(device):
    """The value dtype is decided while tracing: fake outputs follow the emulated target."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(16, 64, device=device)
        with platform.emulate("sm_90"):
            ocp = torch.ops.mm3.mxfp8_quantize(x)[0].dtype
        with platform.emulate("gfx942"):
            fnuz = torch.ops.mm3.mxfp8_quantize(x)[0].dtype
    assert (ocp, fnuz) == (platform.FP8_E4M3_OCP, platform.FP8_E4M3_FNUZ)
