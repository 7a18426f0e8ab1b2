"""Graph-replayed decode (mm3_compile.models.graphs): buckets, static metadata buffers, equality with eager.

CPU: the static-buffer path without graphs (same step function, same buffers) against the runtime's own
per-step metadata, over steps that cross a page boundary, with a padding row.  GPU: compiled steps
replayed from CUDA graphs against eager decode, with no host sync and no new allocation per step.
"""

import pytest
import torch

from mm3_compile.contract import PAGE_SIZE
from mm3_compile.models import MiniMaxM3Config, PagedKVRuntime, build_model, random_full_state
from mm3_compile.models.graphs import GraphedDecode, StaticDecodeBuffers, bucket_for
from mm3_compile.models.reference import ReferenceModel
from tests.numerics import assert_relative_close, relative_error

PREFIX = [126, 60, 127]  # requests 0 and 2 cross into their second page during the decode steps
STEPS = 4


def test_bucket_for():
    sizes = (1, 2, 4, 8)
    assert [bucket_for(b, sizes) for b in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="batch: expected 1..8 requests .* got 9"):
        bucket_for(9, sizes)
    with pytest.raises(ValueError, match="got 0"):
        bucket_for(0, sizes)


def test_static_buffers_hold_the_runtime_metadata_with_padding_rows():
    buffers = StaticDecodeBuffers(max_batch=4, max_blocks=3, device=torch.device("cpu"), kv_cache_dtype="auto")
    ids, meta = buffers.views(4)
    addresses = [t.data_ptr() for t in (ids, meta.positions, meta.slot_mapping, meta.block_table, meta.seq_lens)]
    buffers.write(4, [7, 8], seq_lens=[129, 5], block_tables=[[3, 9], [4]])
    assert ids.tolist() == [7, 8, 0, 0]
    assert meta.seq_lens.tolist() == [129, 5, 0, 0]  # 0: padding request
    assert meta.positions.tolist() == [128, 4, 0, 0]
    assert meta.slot_mapping.tolist() == [9 * PAGE_SIZE + 0, 4 * PAGE_SIZE + 4, -1, -1]  # -1: not written
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert meta.block_table.tolist() == [[3, 9, 0], [4, 0, 0], [0, 0, 0], [0, 0, 0]]
    buffers.write(2, [1], seq_lens=[130], block_tables=[[3, 9]])  # a smaller bucket: views of the same rows
    small_ids, small = buffers.views(2)
    assert small_ids.data_ptr() == ids.data_ptr() and small.block_table.data_ptr() == meta.block_table.data_ptr()
    assert small.slot_mapping.tolist() == [9 * PAGE_SIZE + 1, -1] and small.seq_lens.tolist() == [130, 0]
    assert [
        t.data_ptr() for t in (ids, meta.positions, meta.slot_mapping, meta.block_table, meta.seq_lens)
    ] == addresses
    with pytest.raises(ValueError, match="block_tables: expected 1 rows .* at most 3 pages, got 1 rows of up to 4"):
        buffers.write(2, [1], seq_lens=[130], block_tables=[[3, 9, 1, 2]])
    with pytest.raises(ValueError, match="block_tables: expected 2 rows"):
        buffers.write(2, [1, 2], seq_lens=[130, 3], block_tables=[[3, 9]])
    with pytest.raises(ValueError, match=r"block_tables: request 1 has 1 pages for seq_len 130 \(needs 2\)"):
        buffers.write(2, [1, 2], seq_lens=[5, 130], block_tables=[[3], [9]])


def _prefilled(config, state, model, device):
    """A runtime whose 3 requests hold the reference's K/V of seeded prompts of PREFIX tokens."""
    runtime = PagedKVRuntime(model, num_blocks=12, max_blocks_per_request=3, kv_cache_dtype="auto")
    ref = ReferenceModel(config, state, model.dtype, "auto", device=device)
    gen = torch.Generator().manual_seed(1)
    ref.step(torch.randint(config.vocab_size, (sum(PREFIX),), generator=gen), PREFIX)
    runtime.load_prefix(model, ref.history)
    return runtime


@pytest.mark.interpreter
def test_static_buffer_decode_matches_the_runtime_path(device):
    config = MiniMaxM3Config.tiny()
    state = random_full_state(config, seed=0)
    model = build_model(config, state=state)
    plain, graphed_rt = _prefilled(config, state, model, device), _prefilled(config, state, model, device)
    graphed = GraphedDecode(model, graphed_rt, decode_fn=model.decode, batch_sizes=(1, 2, 4))
    tokens = torch.randint(config.vocab_size, (STEPS, len(PREFIX)), generator=torch.Generator().manual_seed(2))
    _, static_meta = graphed.buffers.views(4)
    address = static_meta.block_table.data_ptr()
    for step in range(STEPS):
        meta = plain.decode_step()
        want = model.decode(tokens[step], meta, plain.caches)
        got = graphed.step(tokens[step])
        # the static buffers' real rows are the runtime's own metadata for the step
        assert torch.equal(static_meta.slot_mapping[:3], meta.slot_mapping)
        assert torch.equal(static_meta.block_table[:3], meta.block_table)
        assert torch.equal(static_meta.seq_lens[:3], meta.seq_lens) and static_meta.seq_lens[3] == 0
        assert static_meta.block_table.data_ptr() == address
        assert got[0].shape == want[0].shape
        # one padding row more in the batch: GEMMs may block the rows differently, a few bf16 ulps
        assert_relative_close(got[0], want[0], 2e-2)
        for a, b in zip(got[2], want[2]):
            assert torch.equal(a.sort(-1).values, b.sort(-1).values)
    assert [len(t) for t in graphed_rt.block_tables] == [2, 1, 2]  # two requests crossed into a new page
    for (kv_a, _), (kv_b, _) in zip(plain.caches, graphed_rt.caches):
        torch.testing.assert_close(kv_a.float(), kv_b.float(), rtol=0, atol=0.05)
    with pytest.raises(ValueError, match="input_ids: expected one token per running request"):
        graphed.step([1, 2])


def test_metadata_staged_ahead_is_used_only_while_it_matches_the_runtime():
    """A step stages the next step's metadata while it runs; the next step uses it only when the runtime is as
    predicted (same rows, one more token each). Rows replaced between steps (same lengths, other pages), a page
    changed inside a row and a step that takes a new page are staged afresh."""
    config = MiniMaxM3Config.tiny()
    model = build_model(config, state=random_full_state(config, seed=0))
    runtime = PagedKVRuntime(model, num_blocks=12, max_blocks_per_request=3, kv_cache_dtype="auto")
    runtime.start_requests(2)
    runtime.advance([PAGE_SIZE - 2, 5])
    calls = []
    graphed = GraphedDecode(model, runtime, decode_fn=lambda ids, meta, caches: calls.append(1), batch_sizes=(2,))
    ids, meta = graphed.buffers.views(2)
    graphed.step([1, 2])  # staged in full, then stages the next step ahead
    writes = graphed.buffers.writes
    graphed.step([3, 4])  # as predicted: only the token ids are staged
    assert ids.tolist() == [3, 4] and meta.seq_lens.tolist() == [PAGE_SIZE, 7]
    assert meta.positions.tolist() == [PAGE_SIZE - 1, 6]
    # one write (the ids): nothing is staged ahead of a step that takes a new page (request 0's next token)
    assert graphed.buffers.writes == writes + 1 and graphed._ahead is None
    graphed.step([5, 6])
    assert meta.block_table[0, :2].tolist() == runtime.block_tables[0] and len(runtime.block_tables[0]) == 2
    assert meta.slot_mapping[0] == runtime.block_tables[0][1] * PAGE_SIZE
    # another request's pages in row 1, same lengths: the staged-ahead values are stale and not used
    runtime.block_tables[1] = [runtime.free_pages.pop()]
    graphed.step([7, 8])
    assert meta.block_table[1, 0] == runtime.block_tables[1][0]
    assert meta.slot_mapping[1] == runtime.block_tables[1][0] * PAGE_SIZE + 8
    # a page changed inside the same row list (same length): staged afresh too
    old_page, runtime.block_tables[1][0] = runtime.block_tables[1][0], runtime.free_pages.pop()
    graphed.step([9, 10])
    assert meta.block_table[1, 0] == runtime.block_tables[1][0] != old_page
    assert meta.slot_mapping[1] == runtime.block_tables[1][0] * PAGE_SIZE + 9
    assert len(calls) == 5


@pytest.mark.gpu
def test_gpu_graph_replayed_decode_matches_eager(device):
    config = MiniMaxM3Config.tiny()
    state = random_full_state(config, seed=0, device=device)
    model = build_model(config, state=state, device=device)
    plain, graphed_rt = _prefilled(config, state, model, device), _prefilled(config, state, model, device)
    graphed = GraphedDecode(model, graphed_rt, batch_sizes=(1, 2, 4, 8))
    graphed.capture([4])
    tokens = torch.randint(config.vocab_size, (8, len(PREFIX)), generator=torch.Generator().manual_seed(2))
    worst, differ, lists = 0.0, 0, 0
    for step in range(len(tokens)):
        want = model.decode(tokens[step].to(device), plain.decode_step(), plain.caches)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.set_sync_debug_mode("error")  # a host sync inside the step raises
        try:
            got = graphed.step(tokens[step])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before, "a replayed step allocated device memory"
        err = relative_error(got[0], want[0], per_row=True)  # per token, relative to the logits
        worst = max(worst, float(err.max()))
        for a, b in zip(got[2], want[2]):  # [Hkv, 3, topk] block lists
            differ += int((a.sort(-1).values != b.sort(-1).values).any(-1).sum())
            lists += a.shape[0] * a.shape[1]
    assert set(graphed.graphs) == {4}  # batch 3 replays bucket 4 only
    assert [len(t) for t in graphed_rt.block_tables] == [2, 1, 2]  # the steps crossed page boundaries
    # compiled vs eager: bf16 rounding of a few ulps; it may flip a near-tied block choice, rarely
    assert worst < 5e-2 and differ <= lists // 10, (worst, differ, lists)
