"""Argument validation shared by the op declarations: every error names the argument."""

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_tensor(name: str, t, *, dtypes=None, ndim=None, min_ndim=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dims, got shape {tuple(t.shape)}")


def check_same_device(reference_name: str, reference: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(f"{name}: expected a tensor on {reference.device} like {reference_name}, got {t.device}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(t.stride())}")
