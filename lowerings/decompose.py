"""Put each mm3 op's Triton kernels into Inductor's generated code.

The op stays one opaque node for Dynamo, ``torch.export`` and the CPU; when AOTAutograd
functionalizes a graph for a GPU, the op's own body is traced instead, so its
``wrap_triton`` launches become ``triton_kernel_wrapper_*`` nodes that Inductor compiles
as user-defined Triton kernels (what ``torch.library.triton_op`` does, keeping our explicit
fakes). The body asks the dtype authority while it is traced: the FP8 flavour, MXFP8 value
dtype and FP8_MAX become constants of the generated kernel launch.

Under the Triton interpreter ``wrap_triton`` cannot trace (it hands back the raw interpreted
function), so CPU graphs keep calling the op.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from mm3_compile import platform
from mm3_compile.kernels._launch import traced_launches


def _export_keeps_custom_ops() -> bool:
    """``torch.export`` keeps ``torch.ops.mm3.*`` nodes: an exported program stays portable."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:  # pragma: no cover - older/newer torch without the switch
        return False
    return custom_triton_ops_decomposition_disabled()


def kernels_traceable(values) -> bool:
    """Whether tensors (real, fake or functional) live where Inductor emits our Triton kernels."""
    tensors = [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]
    return bool(tensors) and not platform.interpreting() and all(t.device.type == "cuda" for t in tensors)


def trace_body(opdef, *args, **kwargs):
    """Run the op's Python body so that its launches are recorded instead of executed."""
    with traced_launches():
        return opdef._init_fn(*args, **kwargs)


def register_functional_decomposition(opdef, defer=lambda: False) -> None:
    """Decompose ``opdef`` into its kernels under AOTAutograd unless ``defer()`` keeps it whole."""

    def rule(mode, op, types, args, kwargs):
        if _export_keeps_custom_ops() or defer() or not kernels_traceable((args, kwargs)):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        if any(t is not torch.Tensor and not issubclass(t, (FakeTensor, FunctionalTensor)) for t in types):
            return NotImplemented
        with mode:
            return trace_body(opdef, *args, **kwargs)

    opdef.register_torch_dispatch(FunctionalTensorMode, rule)


def kernel_names_in(code: str) -> dict[str, int]:
    """Our user-defined Triton kernels launched by Inductor's generated wrapper code, with launch counts."""
    import re

    import triton

    from mm3_compile.kernels.indexer import topk
    from mm3_compile.kernels.kv_cache import write
    from mm3_compile.kernels.moe import gemm
    from mm3_compile.kernels.mxfp8 import quant
    from mm3_compile.kernels.sparse_attn import decode, kv_centric, prefill, union

    names = sorted(
        obj.fn.__name__
        for module in (topk, write, quant, gemm, union, decode, kv_centric, prefill)
        for obj in vars(module).values()
        if isinstance(obj, triton.runtime.jit.JITFunction)
    )
    counts = {name: len(re.findall(rf"\b{name}_\d+\.run\(", code)) for name in names}
    return {name: n for name, n in counts.items() if n}
