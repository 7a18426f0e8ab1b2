"""The attention launch schedules (tiles, splits, warps, stages, PDL): pure functions of shapes and the device."""

import functools

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from mm3_compile import platform
from mm3_compile.kernels.sparse_attn import decode as decode_kernels
from mm3_compile.kernels.sparse_attn import kv_centric, prefill
from mm3_compile.kernels.sparse_attn import schedule as attn_schedule
from mm3_compile.kernels.sparse_attn.naive import sparse_attn_decode_ref
from tests.sparse_attn.helpers import assert_close, build


@pytest.mark.parametrize("spec", ["auto", "fp8"])
def test_prefill_tile_follows_the_block_table_width(spec, device):
    """Wide block tables (lists drawn from many blocks) switch prefill to 16-row tiles (one token per
    program at 16 query heads per KV head); narrower ones take 128 rows (bf16) or 64 (FP8).  A table
    padded past the threshold with real pages must give the reference's output."""
    assert prefill.prefill_block_q(16, 64, fp8=False) == 8 and prefill.prefill_block_q(8, 64, fp8=False) == 16
    assert prefill.prefill_block_q(16, 64, fp8=True) == 4 and prefill.prefill_block_q(8, 64, fp8=True) == 8
    for fp8 in (False, True):
        wide = prefill.WIDE_TABLE_BLOCKS
        assert prefill.prefill_block_q(16, wide, fp8) == 1 and prefill.prefill_block_q(8, wide, fp8) == 2
        assert prefill.prefill_block_q(3, 1024, fp8) == 4  # 4 padded heads x 4 tokens
    case = build(device, [(300, 9), (263, 6)], D=64, Hkv=1, G=16, spec=spec, scale="scalar")
    pad = case.block_table[:, :1].expand(-1, prefill.WIDE_TABLE_BLOCKS)  # columns no list can name
    case.block_table = torch.cat([case.block_table, pad], dim=1)
    assert_close(torch.ops.mm3.sparse_attn_prefill(*case.prefill_args()), case.reference(), torch.bfloat16, "wide")


def test_prefill_schedule_follows_the_hardware_and_list_length(monkeypatch):
    """KV-centric for lists of up to KV_CENTRIC_MAX_SLOTS slots; the union walk for longer ones (dense
    layers list every block: a T x output workspace would grow with the context) and on ROCm (its
    LDS cannot hold a converted block pair and a query tile).  Never from sizes that vary per call."""
    cpu = torch.device("cpu")
    limit = prefill.KV_CENTRIC_MAX_SLOTS
    assert prefill.prefill_schedule(cpu, 16) == prefill.prefill_schedule(cpu, limit) == "kv_centric"
    assert prefill.prefill_schedule(cpu, limit + 1) == "union"
    monkeypatch.setattr(platform, "hardware_vendor", lambda device: "nvidia")
    assert prefill.prefill_schedule(torch.device("cuda", 0), 16) == "kv_centric"
    monkeypatch.setattr(platform, "hardware_vendor", lambda device: "amd")
    assert prefill.prefill_schedule(torch.device("cuda", 0), 16) == "union"


@pytest.mark.parametrize("pair_rows, tiles", [(16, 1), (16, 2), (32, 4)])
def test_kv_centric_runs_split_across_programs(pair_rows, tiles, device, monkeypatch):
    """Programs take fixed slices of the sorted pairs, so a block's run is cut across programs and a
    program holds the tail of one run and the head of the next (tiny tiles make every case occur),
    including ids listed twice and slots that do not count."""
    monkeypatch.setattr(kv_centric, "PAIR_ROWS", pair_rows)
    monkeypatch.setattr(kv_centric, "TILES_PER_PROGRAM", tiles)
    monkeypatch.setattr(prefill, "prefill_schedule", lambda *args: "kv_centric")
    case = build(device, [(700, 13), (390, 5), (140, 0), (263, 7)], D=64, Hkv=2, G=4, T=5, seed=5)
    case.topk_idx[:, ::3, 2] = case.topk_idx[:, ::3, 1]  # repeats: counted once
    assert_close(torch.ops.mm3.sparse_attn_prefill(*case.prefill_args()), case.reference(), torch.bfloat16)


@pytest.mark.parametrize(
    "num_splits, block_q, q_per_req", [(1, 1, 1), (3, 1, 1), (4, 1, 1), (7, 1, 1), (2, 4, 2), (3, 2, 3)]
)
def test_decode_split_counts(num_splits, block_q, q_per_req, device):
    """Any split count merges to the same answer, including splits that own no block (3 or 7 splits of
    4 slots); token tiles (block_q > 1) split the union of their blocks and may straddle requests."""
    case = build(device, [(400, q_per_req), (0, q_per_req), (200, q_per_req)], D=64, Hkv=1, G=4, T=4)

    def run(q):
        return case.split_decode(num_splits, q=q, block_q=block_q)

    out = run(case.q)
    assert (out[q_per_req : 2 * q_per_req] == 0).all()
    ref = sparse_attn_decode_ref(*case.decode_args()[:6], case.storage_dtype)
    assert_close(out, ref, torch.bfloat16, f"{num_splits} splits, {block_q} tokens per program")
    # On CUDA the in-kernel merge's arrival counters are shared between calls: the merging programs
    # left them at zero, so a call with other queries merges correctly too.
    if device.type == "cuda":
        counters = decode_kernels._arrival_counters(1, case.q)
        assert counters.numel() == decode_kernels.ARRIVAL_COUNTERS and not counters.any()
    q2 = torch.randn_like(case.q)
    ref2 = sparse_attn_decode_ref(q2, *case.decode_args()[1:6], case.storage_dtype)
    assert_close(run(q2), ref2, torch.bfloat16, f"second call, {num_splits} splits")


def test_merge_unroll_bounds_every_split_count():
    """The merger's unrolled loop (``MAX_SPLITS``) covers the launch's splits: an int count rounded up to a power
    of two (7 splits -> 8, the 8th masked), a symbolic one bounded by T, which the shape-derived plan never
    exceeds at any batch."""
    from mm3_compile.kernels.sparse_attn import union

    assert [union.max_splits(n, 16) for n in (1, 3, 7, 16)] == [1, 4, 8, 16]
    for tokens in (1, 2, 5, 33, 1000):
        for T in (4, 16):
            splits, _ = decode_kernels.split_plan(tokens, 1, T, torch.device("cpu"))
            assert splits <= union.max_splits(T, T)


def test_split_plan_fills_the_target_grid():
    """Splits grow until (tokens x KV heads x splits) reaches the device's target program count, at most T."""
    cpu = torch.device("cpu")
    assert decode_kernels.split_plan(1, 1, 16, cpu) == (8, 2)  # 8 programs in the interpreter
    assert decode_kernels.split_plan(1000, 4, 16, cpu) == (1, 16)
    assert decode_kernels.split_plan(3, 1, 4, cpu) == (2, 2)


def test_one_token_decode_options_follow_the_wave(monkeypatch):
    """H200 rule (132 SMs): bf16 one-token decode splits to one program per SM and runs 4 warps in 3 stages
    while the grid fits one wave, 8 warps in 2 above; FP8 decode aims at two programs per SM and runs 4 warps
    in 1 stage while its grid fits one wave of one-block programs (B1), in 3 stages above."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(platform, "interpreting", lambda: False)
    monkeypatch.setattr(decode_kernels, "interpreting", lambda: False)
    monkeypatch.setattr(platform, "hardware_vendor", lambda device: "nvidia")
    monkeypatch.setattr(platform, "platform_for", lambda device=None: platform._platform_for_target("sm_90", False))
    monkeypatch.setattr(decode_kernels, "sm_count", lambda index: 132)
    monkeypatch.setattr(attn_schedule, "sm_count", lambda index: 132)
    bf16, fp8 = decode_kernels.BF16_PROGRAMS_PER_SM, decode_kernels.PROGRAMS_PER_SM
    assert decode_kernels.split_plan(32, 4, 16, cuda, bf16) == (1, 16)  # TP1 B32: 128 programs
    assert decode_kernels.split_plan(32, 1, 16, cuda, bf16) == (4, 4)  # TP8 B32
    assert decode_kernels.split_plan(32, 1, 16, cuda, fp8) == (8, 2)
    assert decode_kernels.split_plan(128, 4, 16, cuda, bf16) == (1, 16)  # TP1 B128: 4 programs per SM
    options = functools.partial(attn_schedule.kernel_options, cuda, 16, False)
    assert options(decode_programs=132)["num_stages"] == 3
    assert options(decode_programs=133)["num_stages"] == 2
    assert options(decode_programs=None)["num_stages"] == 2  # prefill, multi-token tiles
    assert decode_kernels.split_plan(1, 4, 16, cuda, fp8) == (16, 1)  # TP1 B1: 64 programs, one wave
    one_block = dict(fp8_decode=True, decode_programs=64, blocks_per_program=1)
    assert options(**one_block) == dict(DOT_FP32=False, CONVERT_V_FIRST=True, V_PAIRS=False, num_warps=4, num_stages=1)
    assert options(fp8_decode=True, decode_programs=64) == dict(
        DOT_FP32=False, CONVERT_V_FIRST=True, V_PAIRS=False, num_warps=4, num_stages=2
    )
    # over fp16 dots (scalar or no scales) V is read as int16 pairs
    assert options(fp8_decode=True, decode_programs=64, blocks_per_program=2, fp16_dots=True) == dict(
        DOT_FP32=False, CONVERT_V_FIRST=False, V_PAIRS=True, num_warps=4, num_stages=2
    )
    assert options(**one_block, fp16_dots=True)["V_PAIRS"]
    assert options(decode_programs=64)["num_warps"] == 4  # bf16, one wave
    assert options(decode_programs=133)["num_warps"] == 8
    assert options(fp8_decode=True, decode_programs=256, blocks_per_program=8, fp16_dots=True) == dict(
        DOT_FP32=False, CONVERT_V_FIRST=False, V_PAIRS=True, num_warps=4, num_stages=3
    )
    assert options(fp8_decode=True, decode_programs=256, fp16_dots=True) == dict(  # block count unknown
        DOT_FP32=False, CONVERT_V_FIRST=False, V_PAIRS=True, num_warps=4, num_stages=3
    )
    assert options(fp8_decode=True) == dict(
        DOT_FP32=False, CONVERT_V_FIRST=True, V_PAIRS=False, num_warps=4, num_stages=3
    )
    # programs of at most 2 blocks in a larger grid: 2 stages; FP8 V transposed as int16 pairs over fp16 dots,
    # else converted after its transpose (Triton's order)
    short = dict(fp8_decode=True, decode_programs=256, blocks_per_program=2)
    assert options(**short, fp16_dots=True) == dict(
        DOT_FP32=False, CONVERT_V_FIRST=False, V_PAIRS=True, num_warps=4, num_stages=2
    )
    assert options(**short) == dict(DOT_FP32=False, CONVERT_V_FIRST=False, V_PAIRS=False, num_warps=4, num_stages=2)
    # bf16 caches and prefill never take the asm
    assert not any(options(decode_programs=64, fp16_dots=True)[k] for k in ("CONVERT_V_FIRST", "V_PAIRS"))
    assert not options(decode_programs=None, fp16_dots=True)["V_PAIRS"]
    # a symbolic grid (a trace at one request runs every batch): bf16 follows the hint, FP8 takes the multi-wave options
    env = ShapeEnv()
    programs = env.create_symintnode(env.create_symbol(64, ConstantSource("programs")), hint=64)
    assert options(decode_programs=programs)["num_stages"] == 3
    blocks = env.create_symintnode(env.create_symbol(16, ConstantSource("blocks")), hint=16)
    assert options(fp8_decode=True, decode_programs=programs, blocks_per_program=blocks, fp16_dots=True) == dict(
        DOT_FP32=False, CONVERT_V_FIRST=False, V_PAIRS=True, num_warps=4, num_stages=3
    )
    assert options(fp8_decode=True, decode_programs=programs, blocks_per_program=blocks)["CONVERT_V_FIRST"]


def test_shared_counters_are_real_cuda_tensors_only():
    """A trace with fake tensors gets its own zeros; CPU calls (which threads may run concurrently)
    get fresh counters every call, never the shared buffer."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode() as mode:
        fake_q = mode.from_tensor(torch.zeros(2, 4, 64, dtype=torch.bfloat16))
        assert isinstance(decode_kernels._arrival_counters(2, fake_q), FakeTensor)
    cpu_q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    first, second = (decode_kernels._arrival_counters(2, cpu_q) for _ in range(2))
    assert first.numel() == second.numel() == 2 and first.data_ptr() != second.data_ptr()
    assert not first.any() and not second.any()


def test_decode_never_splits_on_rocm(monkeypatch):
    """The in-kernel merge relies on NVIDIA's ordering of a CTA's stores before one thread's release."""
    monkeypatch.setattr(platform, "hardware_vendor", lambda device: "amd")
    assert decode_kernels.split_plan(1, 1, 16, torch.device("cuda", 0)) == (1, 16)


def test_pdl_only_for_nvidia_launches(monkeypatch):
    """Programmatic dependent launch: never under the interpreter or on the CPU, on sm_90+ NVIDIA devices
    for eager launches and launches traced into a graph alike, off with ``MM3_PDL=0``."""
    from mm3_compile.kernels._launch import traced_launches, use_pdl

    assert not use_pdl(torch.device("cpu"))
    monkeypatch.setattr(platform, "interpreting", lambda: False)
    monkeypatch.setattr(platform, "hardware_vendor", lambda device: "nvidia")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert use_pdl(cuda)
    with traced_launches():
        assert use_pdl(cuda)
    monkeypatch.setenv("MM3_PDL", "0")
    assert not use_pdl(cuda)
    monkeypatch.setenv("MM3_PDL", "1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    assert not use_pdl(cuda)
    monkeypatch.setattr(platform, "hardware_vendor", lambda device: "amd")
    assert not use_pdl(cuda)


def test_v_pairs_need_even_v_rows():
    """``V_PAIRS`` reads V as int16: a cache whose rows may start at odd bytes keeps the byte tile."""
    from mm3_compile.kernels.sparse_attn.union import pairs_aligned

    buffer = torch.zeros(2 * 2 * 128 * 257, dtype=torch.uint8)
    shape, strides = (2, 2, 128, 256), (2 * 128 * 256, 128 * 256, 256, 1)
    assert pairs_aligned(buffer[: 2 * 2 * 128 * 256].view(shape))
    assert not pairs_aligned(buffer.as_strided(shape, strides, storage_offset=1))  # odd start
    assert not pairs_aligned(buffer.as_strided(shape, (2 * 128 * 257, 128 * 257, 257, 1)))  # odd rows
    assert pairs_aligned(buffer.as_strided(shape, strides, storage_offset=2))
