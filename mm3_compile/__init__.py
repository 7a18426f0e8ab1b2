"""mm3_compile: MiniMax-M3 kernels as torch.compile-native custom ops (``torch.ops.mm3.*``).

Importing the package registers every op and its Inductor lowering. On a machine without a GPU
the kernels run in the Triton interpreter, which must be chosen before triton is first
imported: if nobody has decided yet (``TRITON_INTERPRET`` unset, triton not imported), this
import switches it on.
"""

__version__ = "0.1.0"  # the package version (pyproject.toml reads it from here)

import importlib.util as _importlib_util
import os as _os
import sys as _sys

import torch as _torch

if "TRITON_INTERPRET" not in _os.environ and "triton" not in _sys.modules and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"

if _importlib_util.find_spec("triton") is None:
    raise ImportError(
        f"mm3_compile needs Triton, which this torch ({_torch.__version__}) did not bring: CUDA builds of torch "
        "install `triton`, ROCm builds `pytorch-triton-rocm`; with a CPU-only torch install the interpreter "
        "extra: pip install 'mm3-compile[cpu]'"
    )

from mm3_compile import lowerings as _lowerings  # noqa: E402
from mm3_compile import ops, platform  # noqa: E402  (importing ops registers torch.ops.mm3.*)

_lowerings.install()
compile_options = _lowerings.compile_options
dynamic_shapes = _lowerings.dynamic_shapes

__all__ = ["__version__", "compile_options", "dynamic_shapes", "ops", "platform"]
