"""Triton compile options that Inductor's user-kernel path drops, restored from the kernels' own constexprs.

Inductor compiles a user-defined Triton kernel with ``num_warps`` and ``num_stages`` only: ``wrap_triton`` moves
no ``maxnreg`` into the kernel's config (torch 2.11-2.13 ``SPECIAL_CONFIG_NAMES``) and
``CachingAutotuner._create_compile_options`` forwards none. A kernel that declares the constexpr ``MAXNREG``
(``kernels/_launch.py``: ``launch``) carries its register cap in its arguments, and the wrapper below turns
it back into the ``maxnreg`` compile option. The GEMM2 prefill tile needs it: 8 warps at ptxas's 143
registers run one program per SM, capped at 128 two (H200: 7.18 -> 5.06 ms, bench/NOTES.md session 25).

Inductor also compiles kernels in worker processes (``compile_threads > 1``), whose job is a pickled reference
to ``async_compile._load_triton_kernel_from_source``. That name is pointed at :func:`load_triton_kernel`, so a
worker unpickling the job imports ``mm3_compile`` (whose import installs this wrapper in the worker too) before
it loads and compiles the kernel.
"""

import functools
import logging

import torch._inductor.async_compile as async_compile
from torch._inductor import codecache
from torch._inductor.runtime import triton_heuristics

log = logging.getLogger("mm3_compile")

CAP_CONSTEXPR = "MAXNREG"  # the constexpr a kernel declares to carry its register cap (0: none)


def _with_register_cap(create_options):
    @functools.wraps(create_options)
    def create(self, cfg, compile_meta):
        options = create_options(self, cfg, compile_meta)
        cap = compile_meta.get("constants", {}).get(CAP_CONSTEXPR)
        if cap and self.device_props.type == "cuda":
            options["maxnreg"] = int(cap)
        return options

    create.mm3_register_cap = True
    return create


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
    async_compile._load_triton_kernel_from_source = load_triton_kernel
