"""Properties of mm3::sparse_attn_prefill / mm3::sparse_attn_decode against kernels/sparse_attn/naive.py.

The float64 reference decodes the same cache bytes, so the error is the kernels' own rounding: the
tolerances of tests/sparse_attn/test_numerics.py (bf16: max 2e-2, mean 1.5e-3; fp16: 2e-3 / 1.5e-4), in units
of the V magnitude 2^ev.  Drawn: ragged requests straddling pages (and padding requests), GQA groups
1..16, D 64/128, every KV spec and FP8 flavour under emulated sm_90 / gfx942 / gfx950, typed and byte
caches, HND/NHD, the three scale modes, junk top-k lists (-1, ids past the query's block or the table,
repeats, 10^6), table entries outside the cache (``MM3_VALIDATE=0``), both prefill schedules, q/K/V
magnitudes 2^-30..2^30 (the logits' scale bounded, below), zeros, NaN in q and fp16 subnormals.

The q and K exponents satisfy ``eq + ek <= MAX_LOGIT_EXP``: the fp32 logit rounding (~|logit| 2^-22) then
stays inside the absolute tolerances.  Huge logits (the rule that rows past 2^28 in log2 units are NaN in
every schedule) and threaded calls have their own tests in tests/sparse_attn/test_edges.py.
"""

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mm3_compile import platform
from mm3_compile.contract import PAGE_SIZE
from mm3_compile.kernels.sparse_attn import prefill as prefill_kernels
from mm3_compile.kernels.sparse_attn.naive import sparse_attn_decode_ref, sparse_attn_ref
from tests.properties.strategies import (
    DEVICE,
    SCALE,
    adversarial,
    device_mark,
    examples,
    on_device,
    targets,
)

pytestmark = device_mark()

TOLERANCE = {torch.bfloat16: (2e-2, 1.5e-3), torch.float16: (2e-3, 1.5e-4)}  # (max, mean) abs / 2^ev
MAX_LOGIT_EXP = 8
EXPONENTS = {torch.bfloat16: (-30, 30), torch.float16: (-12, 10)}
SPECS = ("auto", "model", "fp8", "fp8_e4m3", "fp8_e5m2")


@pytest.fixture(autouse=True)
def unchecked_values(monkeypatch):
    monkeypatch.setenv("MM3_VALIDATE", "0")  # table entries outside the cache on purpose: must be skipped


@st.composite
def attention_problems(draw, decode):
    model_dtype = draw(st.sampled_from((torch.bfloat16, torch.float16)))
    D, Hkv, G = draw(st.sampled_from((64, 128))), draw(st.integers(1, 2)), draw(st.sampled_from((1, 2, 3, 8, 16)))
    T = draw(st.integers(1, 4))
    seq_choices = [1, 100, 127, 128, 129, 256, 300, 513]
    if decode:
        q_per_req = draw(st.integers(1, 2))
        seqs = [
            draw(st.sampled_from([0] + [s for s in seq_choices if s >= q_per_req]))
            for _ in range(draw(st.integers(1, 3)))
        ]
        reqs = [(s, q_per_req) for s in seqs]
    else:
        reqs = []
        for _ in range(draw(st.integers(1, 3))):
            s = draw(st.sampled_from([0] + seq_choices))
            reqs.append((s, draw(st.integers(min(1, s), min(s, 4 * SCALE)))))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    blocks = [math.ceil(s / PAGE_SIZE) for s, _ in reqs]
    num_blocks = sum(blocks) + 1
    max_blocks = max(blocks + [1])
    pages = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = pages[start : start + n].to(torch.int32)
        start += n
    if draw(st.booleans()):  # entries outside the cache: skipped
        r, b = draw(st.integers(0, len(reqs) - 1)), draw(st.integers(0, max_blocks - 1))
        table[r, b] = draw(st.sampled_from((-1, num_blocks, 2**31 - 1)))
    total_q = sum(q for _, q in reqs)
    lo, hi = EXPONENTS[model_dtype]
    eq = draw(st.integers(lo, hi))
    ek = draw(st.integers(max(lo, lo - eq), min(hi, MAX_LOGIT_EXP - eq)))
    ev = draw(st.integers(lo, hi))
    q = draw(adversarial((total_q, Hkv * G, D), model_dtype, specials=False, min_exp=eq, max_exp=eq))
    if draw(st.booleans()) and q.numel():
        q.view(-1)[torch.randint(0, q.numel(), (2,), generator=g)] = float("nan")
    values = torch.cat(
        [
            torch.randn(num_blocks, Hkv, PAGE_SIZE, D, generator=g) * 2.0**ek,
            torch.randn(num_blocks, Hkv, PAGE_SIZE, D, generator=g) * 2.0**ev,
        ],
        dim=-1,
    )
    if draw(st.booleans()):  # zeros and (fp16) subnormals in K/V
        flat = values.view(-1)
        idx = torch.randint(0, flat.numel(), (flat.numel() // 16,), generator=g)
        flat[idx] = torch.tensor([0.0, -0.0, 3 * 2.0**-24, -(2.0**-20)])[torch.randint(0, 4, idx.shape, generator=g)]
    topk = torch.zeros(total_q, Hkv, T, dtype=torch.int32)
    cu = [0]
    for _, ql in reqs:
        cu.append(cu[-1] + ql)
    for r, (s, ql) in enumerate(reqs):
        for i in range(ql):
            p = s - ql + i
            own = max(p, 0) // PAGE_SIZE
            ids = torch.randint(-1, own + 1, (Hkv, T), generator=g)
            junk = torch.tensor([-1, -5, own + 1, own + 40, max_blocks, 10**6, own, 0])
            mask = torch.rand(Hkv, T, generator=g) < 0.3
            ids = torch.where(mask, junk[torch.randint(0, len(junk), (Hkv, T), generator=g)], ids)
            topk[cu[r] + i] = ids.to(torch.int32)
    spec = draw(st.sampled_from(SPECS))
    spec = {"model": {torch.bfloat16: "bfloat16", torch.float16: "float16"}[model_dtype]}.get(spec, spec)
    storage = platform.resolve_kv_cache_dtype(spec, DEVICE, model_dtype)
    k_scale = v_scale = None
    if platform.is_fp8(storage):
        fmt = platform.fp8_format(storage)
        mode = draw(st.sampled_from(("none", "scalar", "per_token_head")))
        k_div, v_div = torch.tensor(2.0**ek), torch.tensor(2.0**ev)
        if mode == "none":
            values = torch.cat([values[..., :D] / k_div, values[..., D:] / v_div], -1)  # magnitudes ~1 unscaled
            ev_out = 0
        else:
            if mode == "scalar":
                k_scale, v_scale = k_div.reshape(1).float(), v_div.reshape(1).float()
            else:
                k_scale = (2.0**ek * (0.25 + 2 * torch.rand(Hkv, num_blocks * PAGE_SIZE, generator=g))).float()
                v_scale = (2.0**ev * (0.25 + 2 * torch.rand(Hkv, num_blocks * PAGE_SIZE, generator=g))).float()
            k_div = (
                k_scale.reshape(-1, num_blocks, PAGE_SIZE).transpose(0, 1)[..., None] if mode != "scalar" else k_scale
            )
            v_div = (
                v_scale.reshape(-1, num_blocks, PAGE_SIZE).transpose(0, 1)[..., None] if mode != "scalar" else v_scale
            )
            values = torch.cat([values[..., :D] / k_div, values[..., D:] / v_div], -1)
            ev_out = ev + (2 if mode == "per_token_head" else 0)
        physical = values.clamp(-fmt.max, fmt.max).to(fmt.dtype)
        physical = physical if draw(st.booleans()) else physical.view(torch.uint8)  # typed or bytes
    else:
        physical = values.to(storage)
        ev_out = ev
    if draw(st.booleans()):  # NHD: physical [nb, 128, Hkv, 2D] exposed as the logical view
        cache = physical.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    else:
        cache = physical
    return {
        "q": q,
        "kv_cache": cache,
        "topk_idx": topk.transpose(0, 1),
        "block_table": table,
        "cu_seqlens_q": torch.tensor(cu, dtype=torch.int32),
        "seq_lens": torch.tensor([s for s, _ in reqs], dtype=torch.int32),
        "sm_scale": D**-0.5,
        "kv_cache_dtype": spec,
        "k_scale": k_scale,
        "v_scale": v_scale,
        "storage": storage,
        "ev": ev_out,
    }


def assert_close(out, ref, q_dtype, ev):
    assert out.dtype == q_dtype and out.shape == ref.shape
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan), "NaN positions differ"
    if (~nan).any():
        err = (out.float() - ref)[~nan].abs() * 2.0**-ev
        max_tol, mean_tol = TOLERANCE[q_dtype]
        assert err.max() < max_tol and err.mean() < mean_tol, (
            f"max err {err.max():.3g}, mean {err.mean():.3g} (x 2^{ev})"
        )


@settings(max_examples=examples(8))
@given(target=targets(), schedule=st.sampled_from(("union", "kv_centric")), data=st.data())
def test_prefill_matches_reference(target, schedule, data):
    with platform.emulate(target), mock.patch.object(prefill_kernels, "prefill_schedule", lambda *args: schedule):
        p = data.draw(attention_problems(decode=False))
        q, cache, topk, table, cu, seq, k_scale, v_scale = on_device(
            p["q"],
            p["kv_cache"],
            p["topk_idx"],
            p["block_table"],
            p["cu_seqlens_q"],
            p["seq_lens"],
            p["k_scale"],
            p["v_scale"],
        )
        out = torch.ops.mm3.sparse_attn_prefill(
            q, cache, topk, table, cu, seq, p["sm_scale"], p["kv_cache_dtype"], k_scale, v_scale
        ).cpu()
    ref = sparse_attn_ref(
        p["q"],
        p["kv_cache"],
        p["topk_idx"],
        p["block_table"],
        p["cu_seqlens_q"],
        p["seq_lens"],
        p["sm_scale"],
        p["storage"],
        p["k_scale"],
        p["v_scale"],
    )
    assert_close(out, ref, p["q"].dtype, p["ev"])


@settings(max_examples=examples(8))
@given(target=targets(), data=st.data())
def test_decode_matches_reference(target, data):
    with platform.emulate(target):
        p = data.draw(attention_problems(decode=True))
        args = (p["q"], p["kv_cache"], p["topk_idx"], p["block_table"], p["seq_lens"], p["sm_scale"])
        on = (*on_device(*args[:5]), args[5], p["kv_cache_dtype"], *on_device(p["k_scale"], p["v_scale"]))
        out = torch.ops.mm3.sparse_attn_decode(*on).cpu()
    ref = sparse_attn_decode_ref(*args, p["storage"], p["k_scale"], p["v_scale"])
    assert_close(out, ref, p["q"].dtype, p["ev"])


@settings(max_examples=examples(2))
@given(target=targets(), data=st.data())
def test_compiled_matches_eager(target, data):
    with platform.emulate(target):
        p = data.draw(attention_problems(decode=True))
        args = (
            *on_device(p["q"], p["kv_cache"], p["topk_idx"], p["block_table"], p["seq_lens"]),
            p["sm_scale"],
            p["kv_cache_dtype"],
            *on_device(p["k_scale"], p["v_scale"]),
        )

        def decode(*tensors):
            return torch.ops.mm3.sparse_attn_decode(*tensors)

        torch._dynamo.reset()
        compiled = torch.compile(decode, backend="aot_eager", fullgraph=True)(*args)
        eager = decode(*args)
    assert torch.equal(compiled.view(torch.uint8), eager.view(torch.uint8))
