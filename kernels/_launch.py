"""How every launcher starts a kernel: through ``wrap_triton`` so AOTAutograd can trace it."""

import contextlib
import functools
import os
import threading
import types

import torch
from torch._library.triton import set_wrap_triton_enabled

from mm3_compile import platform

_tracing = threading.local()
# The Triton interpreter is not thread-safe: while it runs a kernel it patches ``triton.language``
# module-wide, so kernels interpreted from two Python threads at once fail inside it
# ("'tensor' object cannot be interpreted as an integer").  Interpreted launches take turns.
_interpreter_lock = threading.Lock()


class _NoPatch:
    def restore(self) -> None:
        pass


@contextlib.contextmanager
def _language_patched_once():
    """The interpreter patches ``triton.language`` when a launch starts and again, by ``inspect.getmembers``
    over three modules, at every call of a nested ``@triton.jit`` function; the nested patches are never
    undone and pile up (a 32-token FP8 decode call: 39 s, 8.9 s when patched once).  For the length of one
    of our launches the language is patched once, for both module names a nested function may use
    (``tl``, and ``core`` in Triton's own ``tl.zeros``...), and the interpreter's own patching does nothing.
    Taken under ``_interpreter_lock``; an interpreter without ``_patch_lang`` (another Triton) is left as is.
    """
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None:
        yield
        return
    import triton.language as tl

    scope = patch(types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core}))
    interpreter._patch_lang = lambda fn: _NoPatch()
    try:
        yield
    finally:
        interpreter._patch_lang = patch
        scope.restore()


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors (compute units on ROCm) of a CUDA device: schedules size their grids by it."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(kernel, grid, *args, maxnreg: int | None = None, pdl: bool = False, **kwargs) -> None:
    """Launch ``kernel``; inside a traced op body this records a Triton kernel node instead.

    Two launch options travel as constexprs the kernel declares, because Inductor's user-kernel path
    forwards neither (torch 2.11-2.13 ``SPECIAL_CONFIG_NAMES``): an eager launch passes the Triton option
    too, a traced one only the constexpr, which ``lowerings/kernel_options.py`` turns back into the compile
    option when Inductor compiles the kernel.

    Args:
        maxnreg: a register cap per thread (PTX ``.maxnreg``); constexpr ``MAXNREG`` (0: none).
        pdl: a programmatic dependent launch (``use_pdl``); constexpr ``PDL``, Triton's ``launch_pdl``.
    """
    if "MAXNREG" in kernel.arg_names:
        kwargs["MAXNREG"] = maxnreg or 0
        if maxnreg and not platform.interpreting() and not launches_traced():
            kwargs["maxnreg"] = maxnreg
    elif maxnreg is not None:
        raise ValueError(f"maxnreg: kernel {kernel.__name__} declares no MAXNREG constexpr to carry the cap")
    if "PDL" in kernel.arg_names:
        kwargs["PDL"] = bool(pdl)
        if pdl and not launches_traced():
            kwargs["launch_pdl"] = True
    elif pdl:
        raise ValueError(f"pdl: kernel {kernel.__name__} declares no PDL constexpr to wait on its predecessor")
    if platform.interpreting():
        with _interpreter_lock, _language_patched_once():
            torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
        return
    torch.library.wrap_triton(kernel)[grid](*args, **kwargs)


@contextlib.contextmanager
def traced_launches():
    """An op body is being traced into a graph (Inductor lowering): launches become graph nodes."""
    previous = getattr(_tracing, "active", False)
    _tracing.active = True
    try:
        with set_wrap_triton_enabled(True):
            yield
    finally:
        _tracing.active = previous


def launches_traced() -> bool:
    """Whether an op body is being traced (``traced_launches``): tensors are not real."""
    return getattr(_tracing, "active", False)


@contextlib.contextmanager
def eager_launches():
    """Real tensors go straight to the kernel: no higher-order-op dispatch on the eager path."""
    if getattr(_tracing, "active", False):
        yield
        return
    with set_wrap_triton_enabled(False):
        yield


def size_hint(n) -> int | None:
    """A size's example value for a performance choice, without guarding on it (None if it has none).

    Under ``dynamic=True`` a launch option picked from the hint stays in the graph for every size: the
    results stay correct, only the choice may be the second best for sizes far from the hint.
    """
    if isinstance(n, torch.SymInt):
        return n.node.hint if n.node.has_hint() else None
    return int(n)


def empty_row_major(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` with its row-major strides spelled out.

    ``torch.empty`` multiplies ``max(1, size)`` into each stride; for a symbolic width such as ``K // 32``
    that leaves ``Max(1, K//32)`` in the stride under ``backed_size_oblivious``, Inductor cannot match it
    to the layout of the user kernel argument and inserts a copy that reads itself (torch 2.11:
    ``KeyError: 'opN'`` in ``Scheduler.compute_ancestors``).
    """
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = step * size
    return torch.empty_strided(tuple(shape), tuple(reversed(strides)), dtype=dtype, device=device)


def require_kernel_device(name: str, t: torch.Tensor) -> None:
    """CPU tensors only run under the Triton interpreter; say so instead of failing deep inside Triton."""
    if t.device.type == "cpu" and not platform.interpreting():
        raise RuntimeError(
            f"{name} is on the CPU but the Triton interpreter is off: set TRITON_INTERPRET=1 before "
            "importing torch/triton to run mm3 kernels on the CPU, or pass CUDA tensors"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a CUDA or CPU tensor, got device {t.device}")


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch on NVIDIA sm_90+ (``MM3_PDL=0`` turns it off, for A/B timing), eager
    and traced into Inductor graphs alike (``launch`` says how the option reaches each)."""
    if platform.interpreting() or device.type != "cuda":
        return False
    if os.environ.get("MM3_PDL", "1") == "0" or platform.hardware_vendor(device) != "nvidia":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9
