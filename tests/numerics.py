"""The one tolerance vocabulary of the tests: errors relative to the reference's largest magnitude.

Model outputs (logits, hidden states) are compared this way because their small entries carry no
information of their own: one bf16 ulp of the largest logit is the resolution of the whole row.
"""

import torch


def relative_error(got: torch.Tensor, want: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """``max |got - want| / max |want|`` (fp32 scalar), or per row over the last dim with ``per_row``.

    Examples:
        >>> relative_error(torch.tensor([1.0, 2.1]), torch.tensor([1.0, 2.0]))
        tensor(0.0500)
    """
    diff = (got.float() - want.float()).abs()
    return (diff.amax(-1) if per_row else diff.max()) / want.float().abs().max()


def assert_relative_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """``torch.testing.assert_close`` with an absolute tolerance of ``tol * max |want|`` (dtypes, shapes
    and NaN positions must match too)."""
    torch.testing.assert_close(got, want, rtol=0, atol=tol * float(want.abs().max()))
