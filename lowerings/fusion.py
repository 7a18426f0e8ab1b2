"""Post-grad pass: fuse a plain-PyTorch SwiGLU-OAI feeding ``mm3::mxfp8_quantize``.

Installed with ``torch.compile(model, options=mm3_compile.compile_options())`` (``lowerings.compile_options``). The pass

1. rewrites ``swiglu_oai(gate_up) -> mm3.mxfp8_quantize`` into one
   ``mm3.swiglu_oai_mxfp8_quant``: the reference formula computed in fp32
   (``gate, up = gate_up.float().chunk(2, -1)``, ``gate.clamp(max=limit)``,
   ``up.clamp(-limit, limit)``, ``gate * sigmoid(alpha * gate) * (up + beta)``; any alpha, beta
   and limit, or no clamps), then
2. on a GPU, replaces the remaining quant nodes by their Triton kernels (with the pass
   installed, ``mxfp8_quantize`` is kept whole through AOTAutograd so step 1 can see it).

Its ``uuid`` carries the FP8 platform, so Inductor's FX graph cache never serves a graph
traced for one FP8 target to another (e.g. emulated gfx942 after sm_90).
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import (
    MULTIPLE,
    CallFunction,
    CallFunctionVarArgs,
    KeywordArg,
    is_match,
)
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mm3_compile import platform
from mm3_compile.lowerings.decompose import kernels_traceable, trace_body
from mm3_compile.ops import quant

aten, prims = torch.ops.aten, torch.ops.prims
SCALARS = (int, float)
# What the fused op accepts for gate_up (its reference upcasts to fp32 first).
FUSED_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _swiglu_quant_pattern(upcast: bool, clamped: bool):
    """``mxfp8_quantize(g * sigmoid(alpha * g) * (u + beta))`` over the split halves of gate_up.

    Written in the post-grad (aten) form the reference code takes; shapes and scalars are
    wildcards, checked by ``_is_swiglu_of_gate_up``.
    """
    source = KeywordArg("gate_up")
    if upcast:
        source = CallFunction(prims.convert_element_type.default, source, torch.float32)
    halves = CallFunction(aten.split.Tensor, source, KeywordArg("half"), KeywordArg("dim"), _users=2)
    up = CallFunction(operator.getitem, halves, 1)
    if clamped:
        gate = CallFunction(
            aten.clamp_max.default, CallFunction(operator.getitem, halves, 0), KeywordArg("limit"), _users=2
        )
        up = CallFunction(aten.clamp_min.default, up, KeywordArg("neg_limit"))
        up = CallFunction(aten.clamp_max.default, up, KeywordArg("up_limit"))
    else:
        gate = CallFunction(operator.getitem, halves, 0, _users=2)
    sigmoid = CallFunction(aten.sigmoid.default, CallFunction(aten.mul.Tensor, gate, KeywordArg("alpha")))
    act = CallFunction(
        aten.mul.Tensor,
        CallFunction(aten.mul.Tensor, gate, sigmoid),
        CallFunction(aten.add.Tensor, up, KeywordArg("beta")),
    )
    return CallFunction(torch.ops.mm3.mxfp8_quantize.default, act, _users=MULTIPLE)


def _is_swiglu_of_gate_up(match, upcast: bool) -> bool:
    """The match computes exactly what the fused op does, and the fused op accepts its arguments.

    The fused op computes in fp32: without an explicit upcast the user's formula runs in gate_up's
    own dtype, so only fp32 gate_up matches then (fp16 / bf16 products round and overflow
    differently).  Arguments the fused op would refuse (fp64 input, a negative limit, non-finite
    alpha / beta) leave the graph as the user wrote it.  ``half`` may be symbolic (dynamic shapes).
    """
    kw = match.kwargs
    gate_up = kw["gate_up"].meta["val"]
    if gate_up.dtype not in (FUSED_INPUT_DTYPES if upcast else (torch.float32,)):
        return False
    if not isinstance(kw["half"], (int, torch.SymInt)) or not isinstance(kw["dim"], int):
        return False
    if kw["dim"] not in (-1, gate_up.dim() - 1) or not statically_known_true(2 * kw["half"] == gate_up.shape[-1]):
        return False
    if not all(isinstance(kw[name], SCALARS) and math.isfinite(kw[name]) for name in ("alpha", "beta")):
        return False
    if "limit" not in kw:
        return True
    limits = (kw["limit"], kw["up_limit"], kw["neg_limit"])
    return (
        all(isinstance(v, SCALARS) for v in limits)
        and kw["limit"] == kw["up_limit"] == -kw["neg_limit"]
        and kw["limit"] >= 0
    )


def _fuse(match, gate_up, alpha, beta, limit=None, **_) -> None:
    def fused(gate_up):
        return torch.ops.mm3.swiglu_oai_mxfp8_quant.default(gate_up, float(alpha), float(beta), limit)

    match.replace_by_example(fused, [gate_up])


def _decompose(opdef):
    """Replace one quant node by its kernels, when they can be emitted (GPU, no interpreter)."""

    def replace(match, *args, **kwargs) -> None:
        tensors = [a for a in args if isinstance(a, torch.fx.Node)]
        if not kernels_traceable([t.meta["val"] for t in tensors]):
            return

        def body(*tensor_args):
            replaced = iter(tensor_args)
            call_args = [next(replaced) if isinstance(a, torch.fx.Node) else a for a in args]
            return trace_body(opdef, *call_args, **kwargs)

        match.replace_by_example(body, tensors, run_functional_passes=False)

    return replace


@functools.cache
def _rewrites() -> list[tuple[object, object, object]]:
    """(pattern, extra check, handler), tried in order; built on first use."""
    rewrites = [
        (_swiglu_quant_pattern(upcast, clamped), functools.partial(_is_swiglu_of_gate_up, upcast=upcast), _fuse)
        for upcast in (True, False)
        for clamped in (True, False)
    ]
    for opdef in (quant.mxfp8_quantize, quant.swiglu_oai_mxfp8_quant):
        packet = getattr(torch.ops.mm3, opdef._name.split("::")[-1]).default
        rewrites.append((CallFunctionVarArgs(packet), lambda match: True, _decompose(opdef)))
    return rewrites


def _rewrite(graph: torch.fx.Graph) -> None:
    # Inductor's PatternMatcherPass skips CPU nodes; the fusion is wanted there too (CPU Inductor calls the
    # fused op), so the patterns are applied directly.
    for pattern, check, handler in _rewrites():
        for node in list(graph.find_nodes(op="call_function", target=pattern.fns[0])):
            if node._erased:
                continue
            match = pattern.match(node)
            if is_match(match) and check(match):
                handler(match, *match.args, **match.kwargs)


class Mm3PostGradPass(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        _rewrite(graph)
        graph.lint()

    def uuid(self) -> str:
        target = platform.platform_for(None)
        with open(__file__, "rb") as source:
            digest = hashlib.sha256(source.read()).hexdigest()
        return f"mm3-post-grad-{digest[:16]}-{target.target}-{target.fp8_e4m3}"


def fusion_installed() -> bool:
    """True while Inductor compiles with our post-grad pass (then ``mxfp8_quantize`` waits for it)."""
    return isinstance(torch._inductor.config.post_grad_custom_post_pass, Mm3PostGradPass)
