"""``mm3::mxfp8_quantize`` and ``mm3::swiglu_oai_mxfp8_quant``.

The MXFP8 value dtype and its FP8_MAX come from the dtype authority for the input's device,
asked in the real implementation and in the fake alike (so under torch.compile: at trace time).
"""

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from mm3_compile import platform
from mm3_compile.contract import MX_BLOCK_SIZE
from mm3_compile.kernels._launch import eager_launches, empty_row_major, require_kernel_device
from mm3_compile.kernels.mxfp8 import quant as kernels
from mm3_compile.ops._checks import FLOAT_DTYPES, check_finite, check_last_dim_contiguous, check_tensor
from mm3_compile.platform import E8M0_DTYPE


def _check_mx_input(name: str, x: torch.Tensor, width: int) -> None:
    check_tensor(name, x, dtypes=FLOAT_DTYPES, min_ndim=1)
    if width % MX_BLOCK_SIZE != 0 or guard_or_false(width == 0):
        raise ValueError(f"{name}: the quantized width must be a positive multiple of {MX_BLOCK_SIZE}, got {width}")
    check_last_dim_contiguous(name, x)


def _mx_outputs_like(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    value_dtype = platform.mxfp8_value_dtype(x.device)
    lead = x.shape[:-1]
    return (
        empty_row_major((*lead, width), value_dtype, x.device),
        empty_row_major((*lead, width // MX_BLOCK_SIZE), E8M0_DTYPE, x.device),
    )


@torch.library.custom_op("mm3::mxfp8_quantize", mutates_args=())
def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX quantization of ``x`` in blocks of 32 along the last dim.

    Per block ``sb = clamp(ceil(log2(amax / FP8_MAX)) + 127, 0, 254)`` (NaN ignored in the amax), values
    ``x * 2^(127 - sb)`` rounded to nearest even and saturated (+-Inf -> +-FP8_MAX, NaN -> NaN).

    Args:
        x: ``[..., K]`` bf16 / fp16 / fp32, ``K`` a multiple of 32.

    Returns:
        ``(values [..., K]`` in the platform's MXFP8 dtype (``platform.mxfp8_value_dtype``),
        ``scales [..., K/32]`` ``float8_e8m0fnu``).

    Examples:
        >>> values, scales = torch.ops.mm3.mxfp8_quantize(torch.randn(4, 64))
        >>> values.shape, scales.shape
        (torch.Size([4, 64]), torch.Size([4, 2]))
    """
    check_tensor("x", x, min_ndim=1)
    _check_mx_input("x", x, x.shape[-1])
    require_kernel_device("x", x)
    fmt = platform.fp8_format(platform.mxfp8_value_dtype(x.device))
    with eager_launches():
        return kernels.mxfp8_quantize(x, fmt)


@mxfp8_quantize.register_fake
def _(x):
    check_tensor("x", x, min_ndim=1)
    _check_mx_input("x", x, x.shape[-1])
    return _mx_outputs_like(x, x.shape[-1])


def _check_gate_up(gate_up: torch.Tensor, alpha: float, beta: float, limit: float | None) -> None:
    check_finite("alpha", alpha)
    check_finite("beta", beta)
    if limit is not None and not limit >= 0.0:  # also refuses NaN
        raise ValueError(f"limit: expected a clamp limit >= 0 or None, got {limit}")
    check_tensor("gate_up", gate_up, dtypes=FLOAT_DTYPES, min_ndim=1)
    if gate_up.shape[-1] % 2 != 0:
        raise ValueError(f"gate_up: the last dim must be 2*I (gate then up), got {gate_up.shape[-1]}")
    _check_mx_input("gate_up", gate_up, gate_up.shape[-1] // 2)


@torch.library.custom_op("mm3::swiglu_oai_mxfp8_quant", mutates_args=())
def swiglu_oai_mxfp8_quant(
    gate_up: torch.Tensor, alpha: float = 1.702, beta: float = 1.0, limit: float | None = 7.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [..., 2I] -> MXFP8 of ``min(g, limit) * sigmoid(alpha*g) * (clamp(u, +-limit) + beta)``.

    Args:
        gate_up: ``[..., 2I]`` bf16 / fp16 / fp32, gate columns then up columns; ``I`` a multiple of 32.
        alpha, beta: the SwiGLU-OAI constants (finite).
        limit: the clamp (>= 0), or ``None`` for no clamps.

    Returns:
        ``(values [..., I]`` platform MXFP8 dtype, ``scales [..., I/32]`` ``float8_e8m0fnu``), as
        ``mxfp8_quantize`` of the fp32 activation.

    Examples:
        >>> values, scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(torch.randn(4, 128, dtype=torch.bfloat16))
        >>> values.shape, scales.shape
        (torch.Size([4, 64]), torch.Size([4, 2]))

    The fp32 activation is quantized by exactly the MX rule of ``mxfp8_quantize``; its sigmoid is the
    platform's ``1 / (1 + exp(-x))``, a few fp32 ulps from torch's, so against a torch reference a code
    may differ by one where the activation lies within 2^-17 of a quantum from a rounding midpoint
    (measured <= 1.5e-6; scales always equal; tests/properties/test_prop_quant.py).
    """
    _check_gate_up(gate_up, alpha, beta, limit)
    require_kernel_device("gate_up", gate_up)
    fmt = platform.fp8_format(platform.mxfp8_value_dtype(gate_up.device))
    with eager_launches():
        return kernels.swiglu_oai_mxfp8_quant(gate_up, alpha, beta, limit, fmt)


@swiglu_oai_mxfp8_quant.register_fake
def _(gate_up, alpha=1.702, beta=1.0, limit=7.0):
    _check_gate_up(gate_up, alpha, beta, limit)
    return _mx_outputs_like(gate_up, gate_up.shape[-1] // 2)
