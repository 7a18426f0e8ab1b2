"""The attention ops' contract: invalid list entries, tokens outside requests, bad inputs, platform round trips."""

import dataclasses

import pytest
import torch

from mm3_compile import platform
from mm3_compile.kernels.sparse_attn import decode as decode_kernels
from mm3_compile.ops import decode_workspace
from tests.sparse_attn.helpers import (
    FP8_ROUND_TRIP_TOLERANCE,
    OP_SCHEDULES,
    PAGE,
    PREFILL_NAMES,
    SCHEDULES,
    assert_close,
    build,
    fill_cache,
)


def _bad_inputs():
    def edit(**changes):
        def make(case):
            args = dict(zip(PREFILL_NAMES, case.prefill_args()))
            for name, fn in changes.items():
                args[name] = fn(args[name], case)
            return tuple(args.values())

        return make

    return [
        (edit(q=lambda q, c: q[0]), ValueError, "q: expected a 3-D tensor"),
        (edit(q=lambda q, c: q.float()), TypeError, "q: expected dtype"),
        (edit(q=lambda q, c: q[..., :32]), ValueError, "q: head dim must be one of"),
        (edit(q=lambda q, c: q.half()), TypeError, "kv_cache: kv_cache_dtype='auto' with model dtype torch.float16"),
        (edit(q=lambda q, c: q[:, :3]), ValueError, r"must be a multiple of the KV heads"),
        (edit(kv_cache=lambda kv, c: kv[:, :, :64]), ValueError, r"kv_cache: expected logical shape"),
        (edit(kv_cache=lambda kv, c: kv[0]), ValueError, "kv_cache: expected a 4-D tensor"),
        (edit(topk_idx=lambda t, c: t.long()), TypeError, "topk_idx: expected dtype"),
        (edit(topk_idx=lambda t, c: t[:, :1]), ValueError, r"topk_idx: expected shape \[Hkv=2, total_q=4"),
        (edit(block_table=lambda b, c: b.long()), TypeError, "block_table: expected dtype"),
        (edit(block_table=lambda b, c: b[:1]), ValueError, "block_table: expected 2 rows"),
        (edit(cu_seqlens_q=lambda cu, c: cu.long()), TypeError, "cu_seqlens_q: expected dtype"),
        (edit(cu_seqlens_q=lambda cu, c: cu[:2]), ValueError, "cu_seqlens_q: expected num_reqs"),
        (edit(seq_lens=lambda s, c: s.long()), TypeError, "seq_lens: expected dtype"),
        (edit(kv_cache_dtype=lambda s, c: "int4"), ValueError, "kv_cache_dtype: unknown spec"),
        (edit(k_scale=lambda s, c: torch.ones(1, device=c.q.device)), ValueError, "k_scale/v_scale: pass both"),
        (
            edit(
                k_scale=lambda s, c: torch.ones(1, 7, device=c.q.device),
                v_scale=lambda s, c: torch.ones(1, 7, device=c.q.device),
            ),
            ValueError,
            r"k_scale: expected one element \(scalar mode\) or shape \[Hkv, num_blocks\*128\]",
        ),
        (
            edit(
                k_scale=lambda s, c: torch.ones(1, device=c.q.device, dtype=torch.float64),
                v_scale=lambda s, c: torch.ones(1, device=c.q.device, dtype=torch.float64),
            ),
            TypeError,
            "k_scale: expected a float32 tensor",
        ),
        (
            edit(seq_lens=lambda s, c: torch.stack([s, s], 1).flatten()[::2]),
            ValueError,
            r"seq_lens: expected a contiguous 1-D tensor \(stride 1\)",
        ),
        (
            edit(cu_seqlens_q=lambda cu, c: torch.stack([cu, cu], 1).flatten()[::2]),
            ValueError,
            r"cu_seqlens_q: expected a contiguous 1-D tensor \(stride 1\)",
        ),
        (edit(sm_scale=lambda s, c: float("nan")), ValueError, "sm_scale: expected a finite number"),
        (
            edit(sm_scale=lambda s, c: -3e38),
            ValueError,
            r"sm_scale: expected \|sm_scale\| <= 2.3\d+e\+38 \(fp32 logits\)",
        ),
        (edit(cu_seqlens_q=lambda cu, c: cu - 1), ValueError, r"cu_seqlens_q: expected offsets from 0 to total_q=4"),
        (
            edit(seq_lens=lambda s, c: torch.ones_like(s) * 2),
            ValueError,
            r"seq_lens: request 0 has seq_len 2; expected 0 \(padding\) or between its 3 new tokens",
        ),
        (edit(block_table=lambda b, c: b + 1000), ValueError, r"block_table: request 0, block 0 maps to page 10\d\d"),
        (
            edit(seq_lens=lambda s, c: s[:0], block_table=lambda b, c: b[:0], cu_seqlens_q=lambda cu, c: cu[:1]),
            ValueError,
            "seq_lens: a prefill of total_q=4 tokens needs at least one request, got 0",
        ),
    ]


@OP_SCHEDULES
def test_invalid_topk_entries_are_ignored(op, schedule, device, monkeypatch):
    """-1, beyond p // 128, beyond a truncated block table, huge ids, repeats; a row with no valid slot -> 0.

    Value checks off (the GPU default; on they refuse the truncated table): the kernel alone skips them.
    """
    monkeypatch.setenv("MM3_VALIDATE", "0")
    reqs = [(300, 7), (260, 7)] if op == "prefill" else [(300, 1), (260, 1), (390, 1)]
    case = build(device, reqs, D=64, Hkv=2, G=2, corrupt=True, seed=3)
    if op == "prefill":
        out = torch.ops.mm3.sparse_attn_prefill(*case.prefill_args())
    else:
        out = torch.ops.mm3.sparse_attn_decode(*case.decode_args())
    assert (out[0, :2] == 0).all()  # token 0, KV head 0: every slot invalid
    assert_close(out, case.reference(), torch.bfloat16, op)


@SCHEDULES
def test_prefill_tokens_outside_the_requests_are_zero(schedule, device, monkeypatch):
    """Value checks off (the GPU default) and cu_seqlens_q starting after 0 and ending before total_q:
    the tokens outside it belong to no request, attend nothing and are 0, as in the reference (not
    request 0's keys at negative offsets, nor keys past seq_len)."""
    monkeypatch.setenv("MM3_VALIDATE", "0")
    case = build(device, [(300, 6), (70, 5)], Hkv=2, G=2, seed=13)
    case.cu_seqlens_q = case.cu_seqlens_q.clone()
    case.cu_seqlens_q[0] += 2
    case.cu_seqlens_q[-1] -= 2
    out = torch.ops.mm3.sparse_attn_prefill(*case.prefill_args())
    assert (out[:2] == 0).all() and (out[-2:] == 0).all()
    assert_close(out, case.reference(), torch.bfloat16)


def test_scales_refused_for_bf16_cache(device):
    """K/V scales are only read from an FP8 cache: given with a bf16 cache they are an error, not ignored."""
    case = build(device, [(200, 1), (150, 1)])
    scales = torch.tensor([4.0], device=device)
    args = case.decode_args()[:7] + (scales, scales)
    with pytest.raises(ValueError, match="k_scale/v_scale: scales are only read from an FP8 cache"):
        torch.ops.mm3.sparse_attn_decode(*args)


def test_half_cache_of_the_other_half_type_is_refused(device):
    """A bf16 cache named explicitly is read by bf16 queries only: fp16 q would meet bf16 K in the dots."""
    case = build(device, [(200, 1), (150, 1)])
    args = list(case.decode_args())
    args[0] = args[0].to(torch.float16)
    args[6] = "bfloat16"
    with pytest.raises(TypeError, match="q: a torch.bfloat16 cache .* is read by torch.bfloat16 queries"):
        torch.ops.mm3.sparse_attn_decode(*args)


def test_block_ids_below_minus_one_are_refused(device, monkeypatch):
    """-1 marks an unused slot; an id below it names no block: an error where index values are checked."""
    monkeypatch.setenv("MM3_VALIDATE", "1")  # GPU calls check values only when asked
    case = build(device, [(200, 1), (150, 1)])
    bad = case.topk_idx.clone()
    bad[0, 1, 0] = -5
    args = list(case.decode_args())
    args[2] = bad
    with pytest.raises(ValueError, match="topk_idx: KV head 0, token 1, slot 0 names block -5"):
        torch.ops.mm3.sparse_attn_decode(*args)


@OP_SCHEDULES
def test_platform_round_trip_gfx942(op, schedule, device):
    """gfx942 stores e4m3fnuz: decoding it right is within fp8 error of the bf16 cache; as e4m3fn (#45562) it is not."""
    reqs = [(300, 5), (150, 4)] if op == "prefill" else [(300, 1), (150, 1)]
    with platform.emulate("gfx942"):
        fp8 = build(device, reqs, spec="fp8", seed=7)
        assert fp8.storage_dtype == platform.FP8_E4M3_FNUZ
        bf16 = dataclasses.replace(
            fp8,
            kv_cache=fill_cache(fp8.values, torch.bfloat16, float("nan"), "HND"),
            kv_cache_dtype="auto",
            storage_dtype=torch.bfloat16,
        )
        if op == "prefill":
            out = torch.ops.mm3.sparse_attn_prefill(*fp8.prefill_args())
        else:
            out = torch.ops.mm3.sparse_attn_decode(*fp8.decode_args())
    expected = bf16.reference()  # attention on the bf16 cache the FP8 one was made from
    max_tol, mean_tol = FP8_ROUND_TRIP_TOLERANCE
    err = (out.float() - expected).abs()
    assert err.max() < max_tol and err.mean() < mean_tol, f"max {err.max():.3g} mean {err.mean():.3g}"
    wrong = fp8.reference(storage_dtype=platform.FP8_E4M3_OCP)  # the same bytes read as e4m3fn
    wrong_err = (wrong - expected).abs()
    assert wrong_err.mean() > 10 * mean_tol and wrong_err.max() > 4 * max_tol


@pytest.mark.parametrize("spec", ["auto", "fp8"])
def test_opcheck(spec, device):
    case = build(device, [(150, 2), (0, 0), (20, 1)], spec=spec, scale="scalar", D=64, Hkv=1, G=2, T=2)
    torch.library.opcheck(torch.ops.mm3.sparse_attn_prefill.default, case.prefill_args())
    case = build(device, [(150, 1), (0, 1)], spec=spec, scale="per_token_head", D=64, Hkv=1, G=2, T=2)
    torch.library.opcheck(torch.ops.mm3.sparse_attn_decode.default, case.decode_args())
    torch.library.opcheck(
        torch.ops.mm3.sparse_attn_decode_with_workspace.default, with_workspace(case, decode_workspace(device))
    )


def with_workspace(case, workspace):
    """``decode_args`` of ``case`` for ``sparse_attn_decode_with_workspace`` (the workspace follows seq_lens)."""
    args = case.decode_args()
    return args[:5] + (workspace,) + args[5:]


@pytest.mark.parametrize("spec, scale", [("auto", "none"), ("fp8", "per_token_head")])
def test_decode_with_workspace_equals_decode_and_leaves_it_zero(spec, scale, device):
    """A split call (the merge counts arrivals) through the caller's workspace gives sparse_attn_decode's bits, twice
    on the same workspace, and leaves it zero for the next call."""
    case = build(device, [(300, 1), (150, 1)], spec=spec, scale=scale, D=64, Hkv=2, G=2, T=4)
    assert decode_kernels.split_plan(2, 2, 4, case.q.device)[0] > 1
    workspace = decode_workspace(device)
    want = torch.ops.mm3.sparse_attn_decode(*case.decode_args())
    for _ in range(2):
        got = torch.ops.mm3.sparse_attn_decode_with_workspace(*with_workspace(case, workspace))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert not workspace.any()


def test_decode_workspace_bad_input(device):
    case = build(device, [(150, 1), (10, 1)], D=64)
    counters = decode_kernels.ARRIVAL_COUNTERS
    bad = [
        (decode_workspace(device).long(), TypeError, "workspace: expected dtype"),
        (decode_workspace(device)[None], ValueError, "workspace: expected a 1-D tensor"),
        (decode_workspace(device)[:100], ValueError, f"workspace: expected at least {counters} int32 counters"),
        (torch.zeros(2 * counters, dtype=torch.int32, device=device)[::2], ValueError, "workspace: expected a contig"),
        (decode_workspace(device).index_fill_(0, torch.tensor([7], device=device), 3), ValueError, "got 3 at index 7"),
    ]
    for workspace, error, match in bad:
        with pytest.raises(error, match=match):
            torch.ops.mm3.sparse_attn_decode_with_workspace(*with_workspace(case, workspace))


@pytest.mark.parametrize("make, error, match", _bad_inputs())
def test_prefill_bad_input(make, error, match, device, monkeypatch):
    monkeypatch.setenv("MM3_VALIDATE", "1")  # some cases are index values, checked on GPU tensors only when asked
    case = build(device, [(150, 3), (10, 1)], D=64, Hkv=2, G=2, T=2)
    with pytest.raises(error, match=match):
        torch.ops.mm3.sparse_attn_prefill(*make(case))


def test_fp8_cache_of_the_wrong_flavour_is_refused(device):
    with platform.emulate("gfx942"):
        case = build(device, [(150, 1)], spec="fp8")
        wrong = case.kv_cache.view(platform.FP8_E4M3_OCP)  # typed as e4m3fn on a FNUZ platform
        with pytest.raises(TypeError, match="float8_e4m3fnuz.*typed torch.float8_e4m3fn"):
            torch.ops.mm3.sparse_attn_decode(case.q, wrong, *case.decode_args()[2:])


def test_decode_bad_input(device):
    case = build(device, [(150, 2), (10, 2)], D=64)
    args = case.decode_args()
    with pytest.raises(ValueError, match=r"total_q \(3\) to be a positive multiple of num_reqs \(2"):
        torch.ops.mm3.sparse_attn_decode(case.q[:3], args[1], args[2][:, :3], *args[3:])
    with pytest.raises(ValueError, match=r"total_q \(0\) to be a positive multiple of num_reqs \(1"):
        torch.ops.mm3.sparse_attn_decode(case.q[:0], args[1], args[2][:, :0], args[3][:1], args[4][:1], *args[5:])
    with pytest.raises(TypeError, match="seq_lens: expected dtype"):
        torch.ops.mm3.sparse_attn_decode(*args[:4], args[4].long(), *args[5:])
    with pytest.raises(ValueError, match="q: query heads per KV head must be in"):
        q = torch.zeros(4, 32, 64, dtype=torch.bfloat16, device=device)
        torch.ops.mm3.sparse_attn_decode(q, *args[1:])


@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_kv_cache_write_then_attention_gfx942(op, device):
    """The issue's chain under emulated gfx942: mm3::kv_cache_write(kv_cache_dtype="fp8") then attention
    is within fp8 error of the same chain on a bf16 cache; the bytes read as e4m3fn (#45562) are not."""
    reqs = [(300, 4), (150, 3)] if op == "prefill" else [(300, 1), (150, 1)]
    with platform.emulate("gfx942"):
        fp8 = build(device, reqs, spec="fp8", seed=9)
        bf16 = dataclasses.replace(
            fp8,
            kv_cache=fill_cache(fp8.values, torch.bfloat16, float("nan"), "NHD"),
            kv_cache_dtype="auto",
            storage_dtype=torch.bfloat16,
        )
        num_blocks, Hkv, _, width = fp8.values.shape
        D = width // 2
        tokens = fp8.values.permute(0, 2, 1, 3).reshape(num_blocks * PAGE, Hkv, width).bfloat16()  # slot order
        slots = torch.arange(num_blocks * PAGE, device=device)
        for case in (fp8, bf16):
            case.kv_cache.zero_()
            torch.ops.mm3.kv_cache_write(tokens[..., :D], tokens[..., D:], case.kv_cache, slots, case.kv_cache_dtype)
        if op == "prefill":
            out, expected = (torch.ops.mm3.sparse_attn_prefill(*c.prefill_args()) for c in (fp8, bf16))
        else:
            out, expected = (torch.ops.mm3.sparse_attn_decode(*c.decode_args()) for c in (fp8, bf16))
    max_tol, mean_tol = FP8_ROUND_TRIP_TOLERANCE
    err = (out.float() - expected.float()).abs()
    assert err.max() < max_tol and err.mean() < mean_tol, f"max {err.max():.3g} mean {err.mean():.3g}"
    wrong = fp8.reference(storage_dtype=platform.FP8_E4M3_OCP)  # the written bytes read as e4m3fn
    wrong_err = (wrong - expected.float()).abs()
    assert wrong_err.mean() > 10 * mean_tol and wrong_err.max() > 4 * max_tol
