"""Argument validation shared by the op declarations: every error names the argument.

Shapes, dtypes, devices and strides are checked on every call (also in the fakes, so a compiled
caller fails at trace time).  The *values* of the index tensors (``cu_seqlens_q``, ``seq_lens``,
``block_table``, ``slot_mapping``, ``topk_idx``) are checked where reading them is free or asked for: calls on
CPU tensors by default, calls on GPU tensors with ``MM3_VALIDATE=1`` (one device sync per call);
``MM3_VALIDATE=0`` turns them off everywhere.  They are skipped while tracing and during CUDA-graph
capture, so GPU graphs whose ops Inductor lowered to our kernels never check them; a compiled graph
that calls an op (CPU, or no lowering) checks at run time like an eager call.  Without the check the kernels still never read or write out of bounds: an
inconsistent entry is skipped (an empty row, an unwritten slot), which the tests check too.
"""

import math
import os

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.symbolic_shapes import guard_or_false

from mm3_compile.contract import PAGE_SIZE

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


def check_index_vector(name: str, t: torch.Tensor) -> None:
    """A 1-D index tensor the kernels read as ``ptr + i``: it must be dense."""
    if t.stride(0) != 1 and guard_or_false(t.shape[0] > 1):
        raise ValueError(f"{name}: expected a contiguous 1-D tensor (stride 1), got strides {tuple(t.stride())}")


def check_scale_values(name: str, scales: torch.Tensor) -> None:
    """Scales a cache write divides by must be positive and finite: 0 saturates every stored value and a
    negative one flips signs (the attention ops apply any scale as given, their contract)."""
    values = scales.detach().cpu().flatten()
    bad = ~(torch.isfinite(values) & (values > 0))
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"{name}: expected positive finite scales, got {float(values[i])} at flat index {i}")


def check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")


def values_checked(*tensors: torch.Tensor) -> bool:
    """Whether this call checks index values (see the module docstring)."""
    setting = os.environ.get("MM3_VALIDATE")
    if setting == "0" or torch.compiler.is_compiling() or any(is_fake(t) for t in tensors):
        return False
    devices = {t.device.type for t in tensors}
    if devices == {"cpu"}:
        return True
    return setting == "1" and devices <= {"cpu", "cuda"} and not torch.cuda.is_current_stream_capturing()


def check_request_values(
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    q_lens: torch.Tensor,  # [num_reqs] new tokens per request
    num_blocks: int,
) -> None:
    """Per request: 0 (padding) or q_len <= seq_len <= the table's reach, and every visible page in the cache."""
    seq_lens, q_lens, block_table = seq_lens.cpu().long(), q_lens.cpu().long(), block_table.cpu()
    reach = block_table.shape[1] * PAGE_SIZE
    bad = ((seq_lens != 0) & (seq_lens < q_lens)) | (seq_lens < 0) | (seq_lens > reach)
    if bad.any():
        r = int(bad.nonzero()[0])
        raise ValueError(
            f"seq_lens: request {r} has seq_len {int(seq_lens[r])}; expected 0 (padding) or between its "
            f"{int(q_lens[r])} new tokens and the block table's reach ({block_table.shape[1]} blocks = {reach} tokens)"
        )
    visible = torch.arange(block_table.shape[1])[None, :] * PAGE_SIZE < seq_lens[:, None]  # [num_reqs, max_blocks]
    out = visible & ((block_table < 0) | (block_table >= num_blocks))
    if out.any():
        r, b = (int(i) for i in out.nonzero()[0])
        raise ValueError(
            f"block_table: request {r}, block {b} maps to page {int(block_table[r, b])}, outside the cache's "
            f"{num_blocks} pages"
        )


def check_topk_values(topk_idx: torch.Tensor) -> None:
    """Selected block ids: -1 marks an unused slot and ids past a token's own block (past the table included)
    are ignored by the kernels (causality); an id below -1 names no block and is an error, never dropped."""
    ids = topk_idx.cpu()
    bad = ids < -1
    if bad.any():
        h, t, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"topk_idx: KV head {h}, token {t}, slot {j} names block {int(ids[h, t, j])}; expected -1 (unused) "
            "or a block index >= 0"
        )


def check_cu_seqlens_values(cu_seqlens_q: torch.Tensor, total_q: int) -> torch.Tensor:
    """cu_seqlens_q must start at 0, never decrease and end at total_q; returns the q_lens."""
    cu = cu_seqlens_q.cpu().long()
    q_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total_q or (q_lens < 0).any():
        raise ValueError(
            f"cu_seqlens_q: expected offsets from 0 to total_q={total_q} that never decrease, got {cu.tolist()[:16]}"
            + (" ..." if cu.numel() > 16 else "")
        )
    return q_lens


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(t.stride())}")
