"""Fixtures of the sparse-attention tests."""

import pytest

from mm3_compile.kernels.sparse_attn import prefill


@pytest.fixture
def schedule(request, monkeypatch):
    """Forces a prefill schedule (both are exact; the rule would pick one per platform and T)."""
    name = getattr(request, "param", None)
    if name is not None:
        monkeypatch.setattr(prefill, "prefill_schedule", lambda *args: name)
    return name
