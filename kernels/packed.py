"""Packed-token helpers shared by the kernels that find a token's request in ``cu_seqlens``."""

import triton
import triton.language as tl


@triton.jit
def find_requests(cu_ptr, num_reqs, x):
    """Per element of ``x`` ([N] int32): the largest r < num_reqs with cu[r] <= x (entries that tie are
    passed over to the last one; empty requests are skipped).  A binary search over ``cu[0 : num_reqs + 1]``."""
    lo = tl.zeros(x.shape, tl.int32)
    hi = lo + num_reqs  # invariant: cu[lo] <= x < cu[hi]
    while tl.max(hi - lo) > 1:
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid) <= x
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def find_request(cu_ptr, num_reqs, x):
    """:func:`find_requests` for one scalar ``x``."""
    return tl.max(find_requests(cu_ptr, num_reqs, x + tl.zeros([1], tl.int32)), axis=0)
