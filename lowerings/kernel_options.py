"""Triton compile options that Inductor's user-kernel path drops, restored from the kernels' own constexprs.

Inductor compiles a user-defined Triton kernel with ``num_warps`` and ``num_stages`` only: ``wrap_triton`` moves
no ``maxnreg`` into the kernel's config (torch 2.11-2.13 ``SPECIAL_CONFIG_NAMES``) and
``CachingAutotuner._create_compile_options`` forwards none. A kernel that declares the constexpr ``MAXNREG``
(``kernels/_launch.py``: ``launch``) carries its register cap in its arguments, and the wrapper below turns
it back into the ``maxnreg`` compile option. The GEMM2 prefill tile needs it: 8 warps at ptxas's 143
registers run one program per SM, capped at 128 two (H200: 7.18 -> 5.06 ms, bench/NOTES.md session 25).

The constexpr ``PDL`` likewise becomes ``launch_pdl`` (a programmatic dependent launch, sm_90+): the compiled
kernel's metadata carries it, so Inductor launches it through Triton's launcher (its static launcher refuses
launch attributes). Its ``gdc_wait`` is non-pure inline assembly, which Inductor's TTIR analysis of the
tensors a user kernel writes cannot see through: it would take every input as written (cudagraph trees then
skip a decode step's graph for "mutated inputs"). The grid-dependency instructions touch no memory, so our
kernels are analysed as compiled with ``PDL`` off (:func:`_analysed_without_opaque_asm`). So is the attention
kernels' ``CONVERT_V_FIRST`` (a register move kept non-pure so Triton does not reorder it: ``jit.load_block``).

Inductor also compiles kernels in worker processes (``compile_threads > 1``), whose job is a pickled reference
to ``async_compile._load_triton_kernel_from_source``. That name is pointed at :func:`load_triton_kernel`, so a
worker unpickling the job imports ``mm3_compile`` (whose import installs this wrapper in the worker too) before
it loads and compiles the kernel.
"""

import functools
import logging

import torch._higher_order_ops.triton_kernel_wrap as triton_kernel_wrap
import torch._inductor.async_compile as async_compile
from torch._inductor import codecache
from torch._inductor.runtime import triton_heuristics

log = logging.getLogger("mm3_compile")

CAP_CONSTEXPR = "MAXNREG"  # the constexpr a kernel declares to carry its register cap (0: none)
PDL_CONSTEXPR = "PDL"  # the constexpr a kernel declares to be launched as a programmatic dependent launch
# constexprs whose builds add non-pure inline assembly that reads and writes no memory: analysed as off
OPAQUE_ASM_CONSTEXPRS = (PDL_CONSTEXPR, "CONVERT_V_FIRST")


def _with_register_cap(create_options):
    @functools.wraps(create_options)
    def create(self, cfg, compile_meta):
        options = create_options(self, cfg, compile_meta)
        constants = compile_meta.get("constants", {})
        if self.device_props.type == "cuda":
            if constants.get(CAP_CONSTEXPR):
                options["maxnreg"] = int(constants[CAP_CONSTEXPR])
            if constants.get(PDL_CONSTEXPR):
                options["launch_pdl"] = True
        return options

    create.mm3_register_cap = True
    return create


def _ours(kernel) -> bool:
    fn = getattr(kernel, "fn", kernel)  # an Autotuner wraps the JITFunction
    return getattr(fn, "__module__", "").startswith("mm3_compile.")


def _analysed_without_opaque_asm(generate_ttir):
    """``generate_ttir`` for Inductor's analysis of what a user kernel reads and writes: an mm3 kernel is
    analysed as its build with the ``OPAQUE_ASM_CONSTEXPRS`` off, whose memory accesses are the same."""

    @functools.wraps(generate_ttir)
    def generate(kernel, kwargs, *args, **kw):
        if _ours(kernel):
            kwargs = {**kwargs, **{name: False for name in OPAQUE_ASM_CONSTEXPRS if kwargs.get(name)}}
        return generate_ttir(kernel, kwargs, *args, **kw)

    generate.mm3_without_opaque_asm = True
    return generate


def load_triton_kernel(*args, **kwargs):
    """Inductor's kernel loader, reached through this module so that compile workers import it first."""
    return codecache._load_triton_kernel_from_source(*args, **kwargs)


def install() -> None:
    autotuner = triton_heuristics.CachingAutotuner
    if not hasattr(autotuner, "_create_compile_options") or not hasattr(
        async_compile, "_load_triton_kernel_from_source"
    ):
        log.warning(
            "torch lacks the Inductor internals kernel_options.py wraps: compiled kernels run without register caps"
        )
        return
    if not getattr(autotuner._create_compile_options, "mm3_register_cap", False):
        autotuner._create_compile_options = _with_register_cap(autotuner._create_compile_options)
    if not getattr(triton_kernel_wrap.generate_ttir, "mm3_without_opaque_asm", False):
        triton_kernel_wrap.generate_ttir = _analysed_without_opaque_asm(triton_kernel_wrap.generate_ttir)
    async_compile._load_triton_kernel_from_source = load_triton_kernel
