"""mm3_compile: MiniMax-M3 kernels as torch.compile-native custom ops (``torch.ops.mm3.*``).

Importing the package registers every op and its Inductor lowering. On a machine without a GPU
the kernels run in the Triton interpreter, which must be chosen before triton is first
imported: if nobody has decided yet (``TRITON_INTERPRET`` unset, triton not imported), this
import switches it on.
"""

import os as _os
import sys as _sys

import torch as _torch

if "TRITON_INTERPRET" not in _os.environ and "triton" not in _sys.modules and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"

from mm3_compile import ops, platform  # noqa: E402  (importing ops registers torch.ops.mm3.*)
from mm3_compile import lowerings as _lowerings  # noqa: E402

_lowerings.install()
compile_options = _lowerings.compile_options
dynamic_shapes = _lowerings.dynamic_shapes

__all__ = ["compile_options", "dynamic_shapes", "ops", "platform"]
