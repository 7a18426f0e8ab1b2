"""mm3_compile: MiniMax-M3 kernels as torch.compile-native custom ops (``torch.ops.mm3.*``)."""

from mm3_compile import ops, platform  # noqa: F401  (importing ops registers torch.ops.mm3.*)
