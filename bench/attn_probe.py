"""One-call H200 probe of the attention kernels (run by the integrator; < 150 s).

For decode B1 / B32 at seq 32768, TP1 (Hq 64, Hkv 4) and TP8 (Hq 8, Hkv 1), bf16 and FP8 KV: the
op's output on rotated set 0 against the float64 reference on sampled tokens, then CUDA-graph replay
time (>= 32 calls per graph over input sets rotated past the L2) with programmatic dependent launch
on (``MM3_PDL=1``, the default) and off (``MM3_PDL=0``), and the graph's output against eager; at B1
the op compiled on a workspace with PDL on and off (Inductor launches it as a programmatic dependent
launch on sm_90).
``--floors`` adds B1 floors of the same grid (one program per listed block, or part of it, and KV
head): a launch that stores one value per program; one that also reads the program's page (located from
a page list resolved on the host: one dependent load) by pointer loads or a TMA descriptor and stores its
sum; and one that stores a [16, D] partial per program and merges them (on the last arrival, or spread
over the splits). Op minus floor is what the list walk, attention and merge cost beyond the bytes.
Prefill TP1 1x8192 bf16: mean |out - fp64 reference| on 16 sampled tokens and ``do_bench`` time.
GB/s are against a same-run 2 GiB device-to-device copy (read + write).  Prints one table last and
writes it to ``$OUT/attn_probe.md`` when ``OUT`` is set.

    python bench/attn_probe.py            # every row
    python bench/attn_probe.py --quick    # B1 rows and prefill only
    python bench/attn_probe.py --quick --prefill-variants  # + the prefill error under other numerics
    python bench/attn_probe.py --quick --floors  # + the B1 floors
    python bench/attn_probe.py --stream-floors  # the op over split counts and stages, B32 page-stream floors
"""

import argparse
import math
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `bench` from the checkout

import torch
import triton
import triton.language as tl

from bench import inputs as bench_inputs
from bench.refs import compare, naive_attention_on_sample, sample_tokens

MIN_POOL_BYTES = 1 << 30  # as bench/attention.py: rotated sets do not share L2 lines
CALLS_PER_GRAPH = 32
REPLAYS = 10
WINDOWS = 5


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=40)
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9


def decode_call(inp, s, op=None):
    """One decode call on rotated set ``s``: the plain op, or ``op`` (a compiled one) with the same arguments."""
    args = (s["q"], inp.cache, s["topk_idx"], s["block_table"], inp.seq_lens, s["k_scale"], s["v_scale"])
    return (op or plain_decode)(*args, inp.sm_scale, inp.case.kv_cache_dtype)


def plain_decode(q, cache, topk_idx, block_table, seq_lens, k_scale, v_scale, sm_scale, kv_cache_dtype):
    return torch.ops.mm3.sparse_attn_decode(
        q, cache, topk_idx, block_table, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale
    )


def workspace_decode(workspace):
    def call(q, cache, topk_idx, block_table, seq_lens, k_scale, v_scale, sm_scale, kv_cache_dtype):
        return torch.ops.mm3.sparse_attn_decode_with_workspace(
            q, cache, topk_idx, block_table, seq_lens, workspace, sm_scale, kv_cache_dtype, k_scale, v_scale
        )

    return call


@triton.jit
def _decode_floor_kernel(
    pages_ptr,
    cache_ptr,
    desc,
    out_ptr,
    stride_page,
    stride_head,
    T,
    Hkv,
    cache_rows,  # pool pages x Hkv x 128: the rows of the cache as a [cache_rows, ROW] matrix
    ROW: tl.constexpr,
    KEYS: tl.constexpr,  # keys per program: 128 / parts of a block
    MODE: tl.constexpr,  # 0 no read, 1 pointer loads, 2 a TMA load by a host descriptor, 3 by one made here
    PDL: tl.constexpr,
):
    """Program (slot part, KV head): its listed page's [KEYS, ROW] part of the K/V tile summed; one value stored."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    PARTS: tl.constexpr = 128 // KEYS
    pid = tl.program_id(0)
    slot = pid // PARTS
    part = pid % PARTS
    head = tl.program_id(1)
    value = pid.to(tl.float32)
    if MODE > 0:
        page = tl.load(pages_ptr + head * T + slot).to(tl.int64)
        row = ((page * Hkv + head) * 128 + part * KEYS).to(tl.int32)
        if MODE == 1:
            offs = (part * KEYS + tl.arange(0, KEYS))[:, None] * ROW + tl.arange(0, ROW)[None, :]
            tile = tl.load(cache_ptr + page * stride_page + head * stride_head + offs)
        elif MODE == 2:
            tile = desc.load([row, 0])
        else:
            # the descriptor the op could make (its launches are traced without host descriptors): written to
            # this program's global scratch, fenced, then used
            here = tl.make_tensor_descriptor(cache_ptr, [cache_rows, ROW], [ROW, 1], [KEYS, ROW])
            tile = here.load([row, 0])
        value += tl.sum(tl.sum(tile.to(tl.float32), axis=1), axis=0)
    tl.store(out_ptr + head * T * PARTS + pid, value)


def add_floor_pages(inp) -> None:
    """``floor_pages`` [Hkv, T] int32 per rotated set: the physical pages of token 0's list."""
    for s in inp.sets:
        if "floor_pages" not in s:
            s["floor_pages"] = s["block_table"][0].long()[s["topk_idx"][:, 0].clamp(min=0).long()].to(torch.int32)


def floor_call(inp, mode: int, pdl: bool, parts: int = 1):
    """One-token decode floors over ``inp``'s rotated sets: one program per (listed block part, KV head)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    Hkv, _, T = inp.sets[0]["topk_idx"].shape
    add_floor_pages(inp)
    out = torch.empty((Hkv, T * parts), dtype=torch.float32, device=inp.cache.device)
    cache = inp.cache
    keys = 128 // parts
    rows = cache.view(-1, cache.shape[-1])  # [pool * Hkv * 128, 2D]
    desc = TensorDescriptor.from_tensor(rows, [keys, cache.shape[-1]]) if mode == 2 else rows
    if mode == 3:  # in-kernel descriptors take 128 bytes of global scratch per program
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=cache.device))

    def call(s):
        _decode_floor_kernel[(T * parts, Hkv)](
            s["floor_pages"],
            cache,
            desc,
            out,
            cache.stride(0),
            cache.stride(1),
            T,
            Hkv,
            rows.shape[0],
            ROW=cache.shape[-1],
            KEYS=keys,
            MODE=mode,
            PDL=pdl,
            num_warps=8,
            **({"launch_pdl": True} if pdl else {}),
        )
        return out

    return call


@triton.jit
def _stream_floor_kernel(
    pages_ptr,  # [Hkv, programs * PAGES] int32: each program's listed pages, in order
    cache_ptr,
    desc,
    out_ptr,  # [Hkv, programs] fp32
    stride_page,
    stride_head,
    ROW: tl.constexpr,
    PAGES: tl.constexpr,  # pages per program
    MODE: tl.constexpr,  # 1 pointer loads, 2 TMA tensor-descriptor loads
    STAGES: tl.constexpr,
):
    """Program (token split, KV head): its PAGES listed [128, ROW] pages read in a pipelined loop (their ids
    loaded first, one dependent load, as the op's list walk), each folded into a [16, ROW] sum by one tensor-core dot (what
    makes Triton pipeline a pointer load, as the op's K/V loads), one value stored."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    head = tl.program_id(1)
    Hkv = tl.num_programs(1)
    acc = tl.zeros([16, ROW], tl.float32)
    slots = tl.arange(0, PAGES)
    pages = tl.load(pages_ptr + (head * tl.num_programs(0) + pid) * PAGES + slots)  # resolved first, as the op
    for i in tl.range(PAGES, num_stages=STAGES):
        page = tl.max(tl.where(slots == i, pages, 0)).to(tl.int64)
        if MODE == 1:
            offs = tl.arange(0, 128)[:, None] * ROW + tl.arange(0, ROW)[None, :]
            tile = tl.load(cache_ptr + page * stride_page + head * stride_head + offs)
        else:
            tile = desc.load([((page * Hkv + head) * 128).to(tl.int32), 0])
        ones = tl.full([16, 128], 1.0, tl.bfloat16)
        if tile.dtype == tl.uint8:  # an FP8 cache's bytes: e4m3 tensor-core operands (the sum's value is moot)
            tile = tile.to(tl.float8e4nv, bitcast=True)
            ones = ones.to(tl.float8e4nv)
        acc = tl.dot(ones, tile, acc)
    tl.store(out_ptr + head * tl.num_programs(0) + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def stream_floor_call(inp, mode: int, splits: int, stages: int):
    """Multi-token decode floor over ``inp``'s rotated sets: (token, split) x KV head programs, each reading
    its share of the token's listed pages (``_stream_floor_kernel``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    Hkv, tokens, T = inp.sets[0]["topk_idx"].shape
    for s in inp.sets:
        if "stream_pages" not in s:  # one token per request: token t's table row is row t
            table = s["block_table"].long()
            assert table.shape[0] == tokens, "a decode case of one token per request"
            ids = s["topk_idx"].clamp(min=0).long()  # [Hkv, tokens, T]
            s["stream_pages"] = torch.gather(table.expand(Hkv, -1, -1), 2, ids).to(torch.int32).contiguous()
    cache = inp.cache
    rows = cache.view(-1, cache.shape[-1])
    desc = TensorDescriptor.from_tensor(rows, [128, cache.shape[-1]]) if mode == 2 else rows
    out = torch.empty((Hkv, tokens * splits), dtype=torch.float32, device=cache.device)

    def call(s):
        _stream_floor_kernel[(tokens * splits, Hkv)](
            s["stream_pages"],
            cache,
            desc,
            out,
            cache.stride(0),
            cache.stride(1),
            ROW=cache.shape[-1],
            PAGES=T // splits,
            MODE=mode,
            STAGES=stages,
            num_warps=8,
            launch_pdl=True,
        )
        return out

    return call


@triton.jit
def _merge_floor_columns(partial_ptr, lse_ptr, out_ptr, head, rows, cols, S: tl.constexpr, D: tl.constexpr):
    """out[head, :, cols] = sum_c 2^lse_c partial_c / sum_c 2^lse_c over the S splits (partials read from L2)."""
    m = tl.full([16], float("-inf"), tl.float32)
    wsum = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, cols.shape[0]], tl.float32)
    for c in tl.static_range(S):
        at = (head * S + c).to(tl.int64) * 16 + rows
        lc = tl.load(lse_ptr + at, cache_modifier=".cg")
        oc = tl.load(partial_ptr + at[:, None] * D + cols[None, :], cache_modifier=".cg")
        new_m = tl.maximum(m, lc)
        ref = tl.where(new_m == float("-inf"), 0.0, new_m)
        acc = acc * tl.exp2(m - ref)[:, None] + tl.exp2(lc - ref)[:, None] * oc.to(tl.float32)
        wsum = wsum * tl.exp2(m - ref) + tl.exp2(lc - ref)
        m = new_m
    out = acc / wsum[:, None]
    tl.store(out_ptr + (head * 16 + rows)[:, None] * D + cols[None, :], out.to(tl.bfloat16))


@triton.jit
def _merge_floor_kernel(
    pages_ptr,
    cache_ptr,
    partial_ptr,  # [Hkv, S, 16, D] bf16
    lse_ptr,  # [Hkv, S, 16] fp32
    out_ptr,  # [Hkv, 16, D] bf16
    counters_ptr,  # [2 * Hkv] int32 zeros: arrivals, then departures; left zero
    stride_page,
    stride_head,
    T: tl.constexpr,
    ROW: tl.constexpr,
    KEYS: tl.constexpr,
    MERGE: tl.constexpr,  # 0 partial stores only, 1 the last arrival merges every split, 2 every split merges a slice
):
    """The B1 decode floor with the split merge: each program reads its page part, stores a [16, D] partial and
    its lse, then merges (the op's scheme, or spread over the splits, which wait for each other: one wave only)."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    D: tl.constexpr = ROW // 2
    PARTS: tl.constexpr = 128 // KEYS
    S: tl.constexpr = T * PARTS
    pid = tl.program_id(0)
    slot = pid // PARTS
    part = pid % PARTS
    head = tl.program_id(1)
    Hkv = tl.num_programs(1)
    page = tl.load(pages_ptr + head * T + slot).to(tl.int64)
    offs = (part * KEYS + tl.arange(0, KEYS))[:, None] * ROW + tl.arange(0, ROW)[None, :]
    tile = tl.load(cache_ptr + page * stride_page + head * stride_head + offs)
    sums = tl.sum(tl.reshape(tl.sum(tile.to(tl.float32), axis=0), [2, D]), axis=0)  # [D]
    rows = tl.arange(0, 16)
    dims = tl.arange(0, D)
    partial = sums[None, :] * (1.0 + rows[:, None].to(tl.float32))  # [16, D]
    lse = rows.to(tl.float32) + pid.to(tl.float32)
    base = (head * S + pid).to(tl.int64) * 16
    tl.store(lse_ptr + base + rows, lse)
    tl.store(partial_ptr + (base + rows)[:, None] * D + dims[None, :], partial.to(tl.bfloat16))
    if MERGE == 0:
        return
    tl.debug_barrier()
    arrivals = counters_ptr + head
    arrived = tl.atomic_add(arrivals, 1, sem="acq_rel") + 1
    if MERGE == 1:
        if arrived == S:
            tl.atomic_xchg(arrivals, 0, sem="relaxed")
            _merge_floor_columns(partial_ptr, lse_ptr, out_ptr, head, rows, dims, S, D)
    else:
        while arrived < S:
            arrived = tl.atomic_add(arrivals, 0, sem="acquire")
        W: tl.constexpr = D // S  # the columns this split merges
        _merge_floor_columns(partial_ptr, lse_ptr, out_ptr, head, rows, pid * W + tl.arange(0, W), S, D)
        departures = counters_ptr + Hkv + head
        if tl.atomic_add(departures, 1, sem="acq_rel") == S - 1:
            tl.atomic_xchg(arrivals, 0, sem="relaxed")
            tl.atomic_xchg(departures, 0, sem="relaxed")


def merge_floor_call(inp, merge: int, parts: int):
    """The floor with the split merge (``_merge_floor_kernel``) over ``inp``'s rotated sets."""
    Hkv, _, T = inp.sets[0]["topk_idx"].shape
    add_floor_pages(inp)
    cache = inp.cache
    D = cache.shape[-1] // 2
    S = T * parts
    device = cache.device
    partial = torch.empty((Hkv, S, 16, D), dtype=torch.bfloat16, device=device)
    lse = torch.empty((Hkv, S, 16), dtype=torch.float32, device=device)
    out = torch.empty((Hkv, 16, D), dtype=torch.bfloat16, device=device)
    counters = torch.zeros(2 * Hkv, dtype=torch.int32, device=device)

    def call(s):
        _merge_floor_kernel[(S, Hkv)](
            s["floor_pages"],
            cache,
            partial,
            lse,
            out,
            counters,
            cache.stride(0),
            cache.stride(1),
            T,
            ROW=cache.shape[-1],
            KEYS=128 // parts,
            MERGE=merge,
            num_warps=8,
            launch_pdl=True,
        )
        return out

    return call, partial, lse, out, counters


def graph_calls(sets) -> int:
    """Calls captured per graph: every rotated set at least once (they add up to ~4x the L2; 32 calls of a small
    step would replay an L2-resident subset), and at least ``CALLS_PER_GRAPH``."""
    return max(CALLS_PER_GRAPH, len(sets))


def replay_us(call, sets) -> tuple[float, list]:
    """Per-call time of graph replays of ``call`` over rotated ``sets`` (median of windows), and the outputs."""
    for s in sets[:2]:  # warm-up (and compile) outside the capture
        call(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    calls = graph_calls(sets)
    with torch.cuda.graph(graph):
        outs = [call(sets[i % len(sets)]) for i in range(calls)]
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(WINDOWS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (REPLAYS * calls))
    del graph
    return sorted(times)[len(times) // 2], outs


def graph_time_us(inp, op=None) -> tuple[float, bool]:
    """Per-call time of graph replays, and whether the graph's output equals eager's."""
    eager = decode_call(inp, inp.sets[(graph_calls(inp.sets) - 1) % len(inp.sets)])
    us, outs = replay_us(lambda s: decode_call(inp, s, op), inp.sets)
    return us, torch.equal(outs[-1], eager)


def op_row(inp, tokens, ref, label: str, name: str, op=None) -> dict:
    """The op (or compiled ``op``) on ``inp``: its output on rotated set 0 against ``ref`` on ``tokens``, its
    graph-replay time, and whether the graph's output equals eager's."""
    out = decode_call(inp, inp.sets[0], op)
    got = out[tokens.to(out.device)].float().cpu()
    ok, max_err = compare(got, ref)
    us, same = graph_time_us(inp, op)
    return {
        "row": label,
        "pdl": name,
        "ok": ok and same,
        "max_err": max_err,
        "mean_err": float((got - ref).abs().mean()),
        "us": us,
    }


def add_pct(rows: list[dict], moved: int, copy: float) -> None:
    """``pct`` of the rows without one: ``moved`` bytes at their time against the copy ceiling (GB/s)."""
    for r in rows:
        r.setdefault("pct", 100 * moved / (r["us"] * 1e-6) / 1e9 / copy)


def floor_row(label: str, name: str, us: float, ok="-") -> dict:
    """A floor's row: it computes no attention, so no error."""
    return {"row": label, "pdl": name, "ok": ok, "max_err": float("nan"), "mean_err": float("nan"), "us": us}


def decode_rows(quick: bool, copy: float, floors: bool) -> list[dict]:
    """Eager op rows with PDL on and off; at B1 also the op compiled on a workspace (traced with PDL on and
    off: a fresh Dynamo cache per setting) and the two floors (module docstring)."""
    import mm3_compile.ops

    rows = []
    shapes = [(1, 32768)] if quick else [(1, 32768), (32, 32768)]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    workspace = mm3_compile.ops.decode_workspace("cuda")
    for B, seq in shapes:
        for kv in ("bf16", "fp8"):
            for tp, Hq, Hkv in (("TP1", 64, 4), ("TP8", 8, 1)):
                case = bench_inputs.AttnCase("decode", tp, Hq, Hkv, 128, (1,) * B, (seq,) * B, kv)
                inp = bench_inputs.make_attn_inputs(case, torch.device("cuda"), l2, MIN_POOL_BYTES)
                tokens = sample_tokens(inp.pos.shape[0], 8, gen_seed=len(case.key))
                ref = naive_attention_on_sample(inp, inp.sets[0], tokens)
                moved = inp.kv_bytes + inp.io_bytes
                variants = [(f"eager, PDL {pdl}", pdl, False) for pdl in ("1", "0")]
                variants += [(f"compiled workspace, PDL {pdl}", pdl, True) for pdl in ("1", "0")] if B == 1 else []
                for label, pdl, compiled in variants:
                    os.environ["MM3_PDL"] = pdl
                    op = None
                    if compiled:  # traced now, under this PDL setting
                        torch._dynamo.reset()
                        op = torch.compile(workspace_decode(workspace), fullgraph=True)
                    rows.append(op_row(inp, tokens, ref, f"decode {tp} B{B} {kv}", label, op))
                    os.environ.pop("MM3_PDL", None)
                for label, mode, pdl, parts in (
                    ("floor: launch + store, PDL", 0, True, 1),
                    ("floor: page read, PDL", 1, True, 1),
                    ("floor: page read, no PDL", 1, False, 1),
                    ("floor: page read in 2 parts, PDL", 1, True, 2),
                    ("floor: page read in 4 parts, PDL", 1, True, 4),
                    ("floor: page read by TMA, PDL", 2, True, 1),
                    ("floor: page read by TMA in 2 parts, PDL", 2, True, 2),
                    ("floor: page read by TMA, descriptor made in the kernel, PDL", 3, True, 1),
                ):
                    if B != 1 or not floors:
                        break
                    try:
                        us, _ = replay_us(floor_call(inp, mode, pdl, parts), inp.sets)
                    except Exception as e:  # a floor variant the Triton build cannot compile: say why
                        print(f"{label}: {type(e).__name__}: {str(e)[:300]}")
                        continue
                    rows.append(floor_row(f"decode {tp} B{B} {kv}", label, us))
                for label, merge, parts in (
                    ("floor: page read + partial store, PDL", 0, 1),
                    ("floor: + the last arrival merges, PDL", 1, 1),
                    ("floor: + every split merges a slice, PDL", 2, 1),
                    ("floor: 2 parts, the last arrival merges, PDL", 1, 2),
                    ("floor: 2 parts, every split merges a slice, PDL", 2, 2),
                    ("floor: 4 parts, the last arrival merges, PDL", 1, 4),
                    ("floor: 4 parts, every split merges a slice, PDL", 2, 4),
                ):
                    if B != 1 or not floors:
                        break
                    programs = inp.sets[0]["topk_idx"].shape[2] * parts * Hkv
                    if merge == 2 and programs > torch.cuda.get_device_properties(0).multi_processor_count:
                        continue  # splits that wait for each other must all be resident: one wave of one per SM
                    call, partial, lse, out, counters = merge_floor_call(inp, merge, parts)
                    us, _ = replay_us(call, inp.sets)
                    torch.cuda.synchronize()
                    ok = "-"
                    if merge:  # the merged output of the last call against a float64 merge of its partials
                        w = torch.softmax(lse.double() * math.log(2), dim=1)  # [Hkv, S, 16]: weights 2^lse
                        ref = (w[..., None] * partial.double()).sum(1)
                        ok = bool(torch.allclose(out.double(), ref, rtol=1e-2, atol=1e-2)) and not counters.any().item()
                    rows.append(floor_row(f"decode {tp} B{B} {kv}", label, us, ok))
                add_pct(rows, moved, copy)
                del inp
                torch.cuda.empty_cache()
    return rows


def _upstream_softmax(logits, dim):
    """Softmax with the numerics of vLLM's M3 kernels (fp32 logits and sum, P rounded to bf16 before P.V):
    the float64 reference's softmax replaced by this one emulates them (the output is rounded after)."""
    m = logits.amax(dim, keepdim=True)
    p = torch.exp((logits - torch.where(torch.isfinite(m), m, 0.0)).float())
    return p.to(torch.bfloat16).double() / p.sum(dim, keepdim=True).double()


def stream_rows(copy: float) -> list[dict]:
    """B1 / B32 s32768 (TP1 / TP8, bf16 / FP8): the eager op with PDL on its split plan, on other split
    counts (``decode.split_plan`` replaced) and in 2-4 pipeline stages (``schedule.kernel_options`` replaced),
    then at B32 the page-stream floors (``_stream_floor_kernel``: pointer loads or TMA, 1-8 programs per token,
    2-4 stages)."""
    from mm3_compile.kernels.sparse_attn import decode as decode_kernels
    from mm3_compile.kernels.sparse_attn import schedule as attn_schedule

    rows = []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    plan = decode_kernels.split_plan
    options = attn_schedule.kernel_options
    for B in (1, 32):
        for kv in ("bf16", "fp8"):
            for tp, Hq, Hkv in (("TP1", 64, 4), ("TP8", 8, 1)):
                case = bench_inputs.AttnCase("decode", tp, Hq, Hkv, 128, (1,) * B, (32768,) * B, kv)
                inp = bench_inputs.make_attn_inputs(case, torch.device("cuda"), l2, MIN_POOL_BYTES)
                moved = inp.kv_bytes + inp.io_bytes
                tokens = sample_tokens(inp.pos.shape[0], 8, gen_seed=len(case.key))
                ref = naive_attention_on_sample(inp, inp.sets[0], tokens)
                label = f"decode {tp} B{B} {kv}"
                for splits in (None, 1, 2, 4, 8, 16):
                    if splits is not None:
                        decode_kernels.split_plan = lambda *a, n=splits, **k: (n, triton.cdiv(a[2], n))  # a[2]: T
                    name = "eager, PDL 1" + ("" if splits is None else f", {splits} splits")
                    try:
                        rows.append(op_row(inp, tokens, ref, label, name))
                    finally:
                        decode_kernels.split_plan = plan
                # the plan's split count with 1-3 pages in flight behind the one computed
                for stages in (2, 3, 4):
                    attn_schedule.kernel_options = lambda *a, st=stages, **k: {**options(*a, **k), "num_stages": st}
                    try:
                        rows.append(op_row(inp, tokens, ref, label, f"eager, PDL 1, {stages} stages"))
                    except Exception as e:  # a setting past the shared memory: say why, go on
                        print(f"{label} {stages} stages: {type(e).__name__}: {str(e)[:200]}")
                    finally:
                        attn_schedule.kernel_options = options
                stream = [(m, p, st) for m in (1, 2) for p in (1, 2, 4, 8) for st in (2, 3, 4)] if B > 1 else []
                for mode, splits, stages in stream:
                    name = f"floor: {'TMA' if mode == 2 else 'pointer'} stream, {splits} per token, {stages} stages"
                    try:
                        us, _ = replay_us(stream_floor_call(inp, mode, splits, stages), inp.sets)
                    except Exception as e:  # a setting past the shared memory: say why, go on
                        print(f"{label} {name}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    rows.append(floor_row(label, name, us))
                add_pct(rows, moved, copy)
                del inp
                torch.cuda.empty_cache()
    return rows


def prefill_rows(variants: bool) -> list[dict]:
    """TP1 1x8192 bf16: the op, and with ``variants`` the error of the same sample under an emulation of
    upstream numerics, fp32 KV-centric partials instead of fp16 ones, and the union-walk schedule."""
    from unittest import mock

    from mm3_compile.kernels.sparse_attn import kv_centric, prefill
    from mm3_compile.kernels.sparse_attn import naive as attn_naive

    case = bench_inputs.AttnCase("prefill", "TP1", 64, 4, 128, (8192,), (8192,), "bf16")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    inp = bench_inputs.make_attn_inputs(case, torch.device("cuda"), l2, MIN_POOL_BYTES)
    s = inp.sets[0]

    def call():
        return torch.ops.mm3.sparse_attn_prefill(
            s["q"],
            inp.cache,
            s["topk_idx"],
            s["block_table"],
            inp.cu_seqlens_q,
            inp.seq_lens,
            inp.sm_scale,
            inp.case.kv_cache_dtype,
            s["k_scale"],
            s["v_scale"],
        )

    tokens = sample_tokens(inp.pos.shape[0], 16, gen_seed=len(case.key))
    ref = naive_attention_on_sample(inp, s, tokens).float().cpu()

    def row(name, got, ms=None):
        ok, max_err = compare(got, ref)
        tflops = inp.flops / (ms * 1e-3) / 1e12 if ms else float("nan")
        mean = float((got - ref).abs().mean())
        return {
            "row": name,
            "pdl": "-",
            "ok": ok,
            "max_err": max_err,
            "mean_err": mean,
            "us": (ms or 0) * 1e3,
            "pct": tflops,
        }

    def measured(name):
        out = call()
        got = out[tokens.to(out.device)].float().cpu()
        return row(name, got, triton.testing.do_bench(call, warmup=3, rep=60))

    rows = [measured("prefill TP1 1x8192 bf16")]
    if not variants:
        return rows
    real_empty = kv_centric.empty_row_major

    def fp32_partials(shape, dtype, device):
        return real_empty(shape, torch.float32 if dtype == torch.float16 else dtype, device)

    def emulated(name):
        with mock.patch.object(attn_naive.torch, "softmax", _upstream_softmax):
            return row(name, naive_attention_on_sample(inp, s, tokens).to(torch.bfloat16).float().cpu())

    def with_fp32_partials(name):
        with mock.patch.object(kv_centric, "empty_row_major", fp32_partials):
            return measured(name)

    def union(name):
        with mock.patch.object(prefill, "prefill_schedule", lambda *a: "union"):
            return measured(name)

    for name, variant in (
        ("  same sample, upstream numerics emulated (fp64)", emulated),
        ("  KV-centric with fp32 partials", with_fp32_partials),
        ("  union-walk schedule", union),
    ):
        try:
            rows.append(variant(name))
        except Exception as e:  # noqa: BLE001 (a failing variant is a line of the probe, not its end)
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--prefill-variants", action="store_true", help="where the prefill error comes from")
    parser.add_argument("--floors", action="store_true", help="the B1 floor rows (module docstring)")
    parser.add_argument(
        "--stream-floors",
        action="store_true",
        help="only the op over split counts and stages, and the B32 page-stream floors",
    )
    args = parser.parse_args()
    import mm3_compile  # noqa: F401  (registers the ops)

    begin = time.time()
    copy = copy_gbps()
    if args.stream_floors:
        rows = stream_rows(copy)
    else:
        rows = decode_rows(args.quick, copy, args.floors)
        rows += prefill_rows(args.prefill_variants)
    lines = [
        (
            f"copy ceiling {copy:.0f} GB/s; {torch.cuda.get_device_name()}; torch {torch.__version__}, triton "
            f"{triton.__version__}; {time.time() - begin:.0f} s"
        ),
        "| row | PDL / variant | correct | max err | mean err | us | % copy (decode) / TFLOP/s (prefill) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['pdl']} | {r['ok']} | {r['max_err']:.2e} | {r['mean_err']:.2e} | "
            f"{r['us']:.2f} | {r['pct']:.1f} |"
        )
    table = "\n".join(lines)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attn_probe.md"), "w") as f:
            f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
