"""Adversarial calls of every mm3 op on CUDA, for compute-sanitizer (``bash scripts/gpu_check.sh sanitize``).

Edge shapes (one token, empty lists, seq_len 0), junk index values with ``MM3_VALIDATE=0`` (-1, ids past
the request, pages outside the cache, slots past the cache), the last slot of the cache, NaN/Inf
inputs and the largest size the ops accept per dimension.  Every call is synchronised, so an illegal
access is reported at the call that made it; the output ends with one ``CALLS: n ok, m failed`` line.

Add an op's calls with ``@call("name", merge=False)``; ``merge=True`` marks the calls that run the
split-decode merge (arrival counters, cross-program reads), which ``--merge`` runs alone for racecheck
and synccheck::

    python3 scripts/sanitize_calls.py            # every call
    python3 scripts/sanitize_calls.py --merge    # the split-decode merge calls only
    python3 scripts/sanitize_calls.py --list
    python3 scripts/sanitize_calls.py --only index_topk   # the calls whose name contains the text
"""

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("MM3_VALIDATE", "0")  # junk index values reach the kernels, which must skip them

import torch

import mm3_compile.ops
from mm3_compile import platform
from mm3_compile.contract import PAGE_SIZE

CALLS: list[tuple[str, bool, object]] = []
DEV = torch.device("cuda")


def call(name: str, merge: bool = False):
    def register(fn):
        CALLS.append((name, merge, fn))
        return fn

    return register


def randn(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


# ---- mm3::mxfp8_quantize / mm3::swiglu_oai_mxfp8_quant ----------------------------------------------
@call("mxfp8_quantize: one block, NaN/Inf, every dtype, strided rows")
def _():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = randn(1, 32, dtype=dtype)
        x[0, 3], x[0, 5], x[0, 7] = float("nan"), float("inf"), -float("inf")
        torch.ops.mm3.mxfp8_quantize(x)
        torch.ops.mm3.mxfp8_quantize(torch.full((3, 64), float("nan"), dtype=dtype, device=DEV))
        torch.ops.mm3.mxfp8_quantize(randn(9, 200, dtype=dtype)[:, :96])  # row stride 200: last program partial


@call("mxfp8_quantize: max sizes per dimension (a 2^16+1 x 32 and a 2 x 2^20 tensor)")
def _():
    torch.ops.mm3.mxfp8_quantize(randn(65537, 32))
    torch.ops.mm3.mxfp8_quantize(randn(2, 1 << 20))
    torch.ops.mm3.mxfp8_quantize(randn(3, 5, 1056))  # 1056 = 1024 + 32: a ragged last column tile


@call("swiglu_oai_mxfp8_quant: one block, NaN, no limit, max sizes")
def _():
    g = randn(1, 64, scale=8.0)
    g[0, 0], g[0, 40] = float("nan"), -float("inf")
    for limit in (7.0, None, 0.0):
        torch.ops.mm3.swiglu_oai_mxfp8_quant(g, 1.702, 1.0, limit)
    torch.ops.mm3.swiglu_oai_mxfp8_quant(randn(65537, 64))
    torch.ops.mm3.swiglu_oai_mxfp8_quant(randn(2, 2 * (1 << 19)))
    torch.ops.mm3.swiglu_oai_mxfp8_quant(randn(7, 2 * 1056 + 16)[:, : 2 * 1056])


# ---- mm3::kv_cache_write ------------------------------------------------------------------------------
def _kv_cache(num_blocks, heads, D, dtype, nhd=False):
    if nhd:
        return torch.zeros(num_blocks, PAGE_SIZE, heads, 2 * D, dtype=dtype, device=DEV).permute(0, 2, 1, 3)
    return torch.zeros(num_blocks, heads, PAGE_SIZE, 2 * D, dtype=dtype, device=DEV)


@call("kv_cache_write: one token into the last slot, junk slots, NaN keys, every D, NHD, FP8 scales")
def _():
    for D in (16, 64, 128, 256):
        for nhd in (False, True):
            cache = _kv_cache(2, 3, D, torch.bfloat16, nhd)
            key = randn(1, 3, D)
            key[0, 0, 0] = float("nan")
            torch.ops.mm3.kv_cache_write(key, key, cache, torch.tensor([2 * PAGE_SIZE - 1], device=DEV))
            slots = torch.tensor([-1, 2 * PAGE_SIZE, 10**12, -(10**12), 0], device=DEV)
            torch.ops.mm3.kv_cache_write(randn(5, 3, D), randn(5, 3, D), cache, slots)
            byte_cache = _kv_cache(2, 3, D, torch.uint8, nhd)
            k_scale = torch.rand(3, 2 * PAGE_SIZE, device=DEV) + 0.1
            torch.ops.mm3.kv_cache_write(randn(5, 3, D), randn(5, 3, D), byte_cache, slots, "fp8", k_scale, k_scale)
            one = torch.ones(1, device=DEV)
            torch.ops.mm3.kv_cache_write(key, key, byte_cache, slots[-1:], "fp8_e5m2", one, one)


@call("kv_cache_write: many tokens, all padding, an empty batch")
def _():
    cache = _kv_cache(64, 8, 128, torch.uint8)
    slots = torch.randperm(64 * PAGE_SIZE, device=DEV)[:8000]
    torch.ops.mm3.kv_cache_write(randn(8000, 8, 128), randn(8000, 8, 128), cache, slots, "fp8")
    torch.ops.mm3.kv_cache_write(randn(7, 8, 128), randn(7, 8, 128), cache, torch.full((7,), -1, device=DEV), "fp8")
    torch.ops.mm3.kv_cache_write(
        randn(0, 8, 128), randn(0, 8, 128), cache, torch.zeros(0, dtype=torch.int64, device=DEV), "fp8"
    )


# ---- mm3::index_topk ------------------------------------------------------------------------------------
def _index_args(seq_lens, q_lens, heads=2, dim=64, dtype=torch.bfloat16, junk_table=True):
    blocks = [-(-s // PAGE_SIZE) for s in seq_lens]
    max_blocks = max(blocks + [1]) + 1
    num_pages = sum(blocks) + 1
    fill = 1 << 30 if junk_table else 0
    table = torch.full((len(seq_lens), max_blocks), fill, dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (
        randn(sum(q_lens), heads, dim, dtype=dtype),
        randn(num_pages, PAGE_SIZE, dim, dtype=dtype),
        table.to(DEV),
        cu.to(DEV),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
    )


@call("index_topk: one token, seq_len 0 padding, topk above the blocks, junk tables, Didx 16/256, NaN")
def _():
    torch.ops.mm3.index_topk(*_index_args([1], [1]), 16, 0, 1)
    torch.ops.mm3.index_topk(*_index_args([0, 1, 129], [0, 1, 2]), 64, 2, 2)
    for dim in (16, 256):
        args = _index_args([700, 128], [3, 1], heads=1, dim=dim)
        args[0][0, 0, 0] = float("nan")
        args[1][1, 5, 0] = float("inf")
        torch.ops.mm3.index_topk(*args, 4, 1, 1)


@call("index_topk: FP8 index-K cache (uint8 bytes), per-slot scales, junk tables")
def _():
    q, cache, table, cu, seq = _index_args([700, 1, 0], [3, 1, 0], heads=4, dim=128)
    fp8 = platform.platform_for(DEV).kv_e4m3_dtype
    cache8 = cache.float().clamp(-200, 200).to(fp8).view(torch.uint8)
    torch.ops.mm3.index_topk(q, cache8, table, cu, seq, 16, 1, 1, "fp8")
    scale = torch.rand(cache.shape[0] * PAGE_SIZE, device=DEV) + 0.5
    torch.ops.mm3.index_topk(q, cache8, table, cu, seq, 16, 0, 1, "fp8", scale)


@call("index_topk: decode rows whose request guess misses (empty requests), a grid as wide as the table")
def _():
    # token t is not request t past the empty request: the score and top-k programs fall back to the search;
    # the table is narrower than the chunk grid, so each chunk's page id is read ahead with the guess
    args = _index_args([700, 0, 300, 1000], [1, 0, 1, 1], heads=4, dim=128)
    torch.ops.mm3.index_topk(*args, 16, 0, 1)
    args[4][0] = 5000  # a seq_len past the table's blocks: the kernels stop at the table's width
    torch.ops.mm3.index_topk(*args, 16, 1, 1)


@call("index_topk: long context (64k tokens), many tokens")
def _():
    torch.ops.mm3.index_topk(*_index_args([65536, 300], [1, 300], heads=4, dim=128), 64, 1, 1)


# ---- mm3::sparse_attn_prefill / mm3::sparse_attn_decode ---------------------------------------------
def _attn_args(seq_lens, q_lens, *, Hkv=2, G=8, D=128, T=16, spec="auto", junk=True, nan=False):
    blocks = [-(-s // PAGE_SIZE) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    max_blocks = max(blocks + [1])
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    if junk and table.numel() > 1:
        table[0, -1] = num_blocks + 5  # a page outside the cache
        table[-1, 0] = -1
    total_q = sum(q_lens)
    topk = torch.randint(-2, max_blocks + 3, (Hkv, total_q, T), dtype=torch.int32)
    if junk and topk.numel():
        topk.view(-1)[::7] = 10**6
        topk.view(-1)[1::5] = -1
    storage = platform.resolve_kv_cache_dtype(spec, DEV, torch.bfloat16)
    cache = torch.randn(num_blocks, Hkv, PAGE_SIZE, 2 * D, device=DEV)
    cache = cache.to(storage).view(torch.uint8) if platform.is_fp8(storage) else cache.to(storage)
    q = randn(total_q, Hkv * G, D)
    if nan and q.numel():
        q[0, 0, 0] = float("nan")
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    return q, cache, topk.to(DEV), table.to(DEV), cu, torch.tensor(seq_lens, dtype=torch.int32, device=DEV)


@call("sparse_attn_prefill: one token, junk lists and tables, NaN q, G 1/16, D 64/128, fp8, T 1/64")
def _():
    for D, G, T, spec in ((64, 1, 1, "auto"), (128, 16, 4, "fp8"), (128, 8, 64, "auto"), (64, 4, 33, "fp8_e5m2")):
        q, cache, topk, table, cu, seq = _attn_args([1], [1], Hkv=1, G=G, D=D, T=T, spec=spec, nan=True)
        torch.ops.mm3.sparse_attn_prefill(q, cache, topk, table, cu, seq, D**-0.5, spec)
        q, cache, topk, table, cu, seq = _attn_args([0, 300, 129, 4000], [0, 40, 129, 7], G=G, D=D, T=T, spec=spec)
        torch.ops.mm3.sparse_attn_prefill(q, cache, topk, table, cu, seq, D**-0.5, spec)


@call("sparse_attn_prefill: a 4096-token chunk over a 16k context")
def _():
    q, cache, topk, table, cu, seq = _attn_args([16384], [4096], Hkv=1, G=8, T=16)
    torch.ops.mm3.sparse_attn_prefill(q, cache, topk, table, cu, seq, 128**-0.5)


@call("sparse_attn_decode: split merge, one request, seq_len 0 padding, junk lists, NaN q", merge=True)
def _():
    for spec, T in (("auto", 16), ("fp8", 64), ("auto", 1)):
        q, cache, topk, table, _, seq = _attn_args([8192], [1], Hkv=1, G=8, T=T, spec=spec, nan=True)
        torch.ops.mm3.sparse_attn_decode(q, cache, topk, table, seq, 128**-0.5, spec)
        q, cache, topk, table, _, seq = _attn_args([0, 5000, 129], [2, 2, 2], Hkv=2, G=4, D=64, T=T, spec=spec)
        torch.ops.mm3.sparse_attn_decode(q, cache, topk, table, seq, 64**-0.5, spec)
        workspace = mm3_compile.ops.decode_workspace(DEV)
        for _ in range(2):  # the counters in a caller's workspace: read back zero by the next call
            torch.ops.mm3.sparse_attn_decode_with_workspace(q, cache, topk, table, seq, workspace, 64**-0.5, spec)
        assert not workspace.any(), "sparse_attn_decode_with_workspace left counters set"


@call("sparse_attn_decode: a 256-request batch (one split: the grid fills the GPU)")
def _():
    q, cache, topk, table, _, seq = _attn_args([2000] * 256, [1] * 256, Hkv=1, G=8, T=16)
    torch.ops.mm3.sparse_attn_decode(q, cache, topk, table, seq, 128**-0.5)


# ---- MoE ops: mm3::moe_align / mm3::mxfp8_grouped_gemm / mm3::mxfp8_linear / mm3::moe_experts ------------
def _mx_weight(*shape):
    values, scales = torch.ops.mm3.mxfp8_quantize(randn(*shape, scale=0.05))
    return values, scales.view(torch.uint8)


@call(
    "moe_experts: 1 token, all rows on one expert, experts without rows, 19 tokens, NaN rows, the shared expert "
    "in the routed launches, real widths"
)
def _():
    E, H, I = 8, 256, 128
    w1, w2 = _mx_weight(E, 2 * I, H), _mx_weight(E, H, I)
    shared = (*_mx_weight(2 * I, H), *_mx_weight(H, I))
    for T, k, one_expert in ((1, 2, False), (19, 2, True), (37, 4, False)):
        ids = torch.argsort(torch.rand(T, E, device=DEV), dim=-1)[:, :k]  # distinct experts per token
        if one_expert:
            ids[:, 0] = 0  # every token's first slot on expert 0
        x = randn(T, H)
        x[0, 0] = float("nan")
        weights = torch.rand(T, k, device=DEV)
        torch.ops.mm3.moe_experts(x, ids, weights, *w1, *w2)
        torch.ops.mm3.moe_experts(x, ids, weights, *w1, *w2, 1.702, 1.0, 7.0, *shared)
    E, H, I = 128, 6144, 3072  # the real widths, decode and a prefill tile
    w1, w2 = _mx_weight(E, 2 * I, H), _mx_weight(E, H, I)
    shared = (*_mx_weight(2 * I, H), *_mx_weight(H, I))
    for T in (1, 32, 300):
        ids = torch.argsort(torch.rand(T, E, device=DEV), dim=-1)[:, :4]
        torch.ops.mm3.moe_experts(randn(T, H), ids, torch.rand(T, 4, device=DEV), *w1, *w2)
        torch.ops.mm3.moe_experts(randn(T, H), ids, torch.rand(T, 4, device=DEV), *w1, *w2, 1.702, 1.0, 7.0, *shared)


@call("mxfp8_linear: 1 and 300 rows, bf16 and MXFP8 activations, N 16, K 32")
def _():
    for n, k in ((16, 32), (6144, 6144), (48, 1056)):
        w = _mx_weight(n, k)
        for rows in (1, 300):
            x = randn(rows, k)
            torch.ops.mm3.mxfp8_linear(x, *w)
            xv, xs = torch.ops.mm3.mxfp8_quantize(x)
            torch.ops.mm3.mxfp8_linear(xv, *w, xs.view(torch.uint8))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--merge", action="store_true", help="only the split-decode merge calls")
    parser.add_argument("--list", action="store_true", help="list the calls and exit")
    parser.add_argument("--only", default="", help="only the calls whose name contains this text")
    args = parser.parse_args()
    selected = [(n, fn) for n, merge, fn in CALLS if (merge or not args.merge) and args.only in n]
    if args.list:
        print("\n".join(n for n, _ in selected))
        return 0
    if not torch.cuda.is_available():
        print("CALLS: no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    failed = 0
    for name, fn in selected:
        start = time.perf_counter()
        try:
            fn()
            torch.cuda.synchronize()
            print(f"ok     {time.perf_counter() - start:7.1f}s  {name}", flush=True)
        except Exception:  # noqa: BLE001 -- any error is this call failing: reported, counted, the next call runs
            failed += 1
            print(f"FAILED {time.perf_counter() - start:7.1f}s  {name}\n{traceback.format_exc()}", flush=True)
    print(f"CALLS: {len(selected) - failed} ok, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
