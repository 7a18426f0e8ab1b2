"""Tensor parallelism on the CPU: 2 gloo processes run the sharded model (eager and compiled); TP=2 equals TP=1.

Each rank loads the same reference-computed prefix (its own KV heads), runs a prefill chunk and decode steps
eagerly and under ``torch.compile(fullgraph=True)``; the compiled graphs must hold the functional all-reduces
(2 per layer) with no graph break.  Rank 0 saves its outputs and the parent compares them with a TP=1 run
and both with the teacher-forced reference.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mm3_compile.models import MiniMaxM3Config, PagedKVRuntime, build_model, compile_model, random_full_state
from mm3_compile.models.reference import LOCAL_SCORE, ROUTING_TIE, ReferenceModel, sub_block_errors
from mm3_compile.models.tp import HeadShard, TPInfo, split_count
from tests.numerics import relative_error

PREFIX = [300, 150]
STEPS = ([5, 3], [1, 1], [1, 1])
CONFIGS = {
    "kv_split": dict(),  # Hkv 2 over 2 ranks: one KV head each
    "kv_replicated": dict(num_key_value_heads=1, num_index_heads=1),  # tp > Hkv: the KV head is replicated
}


def _workload(config, group, backend=None):
    """Outputs of the (sharded) model on a fixed prefix + steps; backend=None runs eagerly."""
    state = random_full_state(config, seed=0)
    model = build_model(config, state=state, group=group)
    runtime = PagedKVRuntime(model, num_blocks=12, max_blocks_per_request=4, kv_cache_dtype="fp8")
    ref = ReferenceModel(config, state, model.dtype, "fp8")
    gen = torch.Generator().manual_seed(1)
    ref.step(torch.randint(config.vocab_size, (sum(PREFIX),), generator=gen), PREFIX)
    runtime.load_prefix(model, ref.history)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    prefill, decode = compile_model(model, capture) if backend else (model.prefill, model.decode)
    outputs = []
    with torch.no_grad():
        for q_lens in STEPS:
            ids = torch.randint(config.vocab_size, (sum(q_lens),), generator=gen)
            fn = prefill if q_lens[0] > 1 else decode
            logits, hiddens, topk = fn(ids, runtime.extend(q_lens), runtime.caches)
            expected = ref.step(ids, q_lens, forced=hiddens)
            errors = sub_block_errors(hiddens, expected, hiddens)
            # tokens whose router has a near-tie in some MoE layer (another bf16 rounding may swap an expert)
            ambiguous = torch.zeros(sum(q_lens), dtype=torch.bool)
            for margin in expected.route_margin.values():
                ambiguous |= margin.cpu() < ROUTING_TIE
            # ... or whose index top-k has one in some head: the k-th and (k+1)-th block scores within the
            # reference's tie bound (forced init/local blocks excluded), so a hidden state a few bf16 ulps
            # away may select another block (only rank 0's selections are compared below)
            k = config.sparse_topk_blocks
            for scores, tie in zip(expected.block_scores, expected.index_tie):
                if scores.shape[-1] > k:
                    ranked = scores.sort(-1, descending=True).values  # [Hkv, T, blocks]
                    tied = (ranked[..., k - 1] - ranked[..., k] < tie) & (ranked[..., k] < LOCAL_SCORE)
                    ambiguous |= tied.any(0).cpu()
            outputs.append(dict(logits=logits, hiddens=hiddens, topk=topk, errors=errors, ambiguous=ambiguous))
    all_reduces = [sum("all_reduce" in str(n.target) for n in gm.graph.nodes) for gm in graphs]
    return outputs, all_reduces


def _rank_main(rank, world, init_file, out_file, config_name):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        config = MiniMaxM3Config.tiny(**CONFIGS[config_name])
        torch._dynamo.utils.counters.clear()
        eager, _ = _workload(config, dist.group.WORLD)
        compiled, all_reduces = _workload(config, dist.group.WORLD, backend="capture")
        graph_breaks = dict(torch._dynamo.utils.counters["graph_break"])
        if rank == 0:
            result = dict(eager=eager, compiled=compiled, all_reduces=all_reduces, graph_breaks=graph_breaks)
            torch.save(result, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.interpreter
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_tp2_matches_tp1(config_name):
    config = MiniMaxM3Config.tiny(**CONFIGS[config_name])
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "rank0.pt")
        mp.spawn(_rank_main, args=(2, os.path.join(tmp, "init"), out_file, config_name), nprocs=2, join=True)
        tp2 = torch.load(out_file, weights_only=False)
    tp1, _ = _workload(config, None)
    assert not tp2["graph_breaks"]
    assert tp2["all_reduces"] == [2 * config.num_hidden_layers] * 2  # prefill and decode graphs
    rank0 = HeadShard.for_rank(config.num_attention_heads, config.num_key_value_heads, TPInfo(0, 2))
    for run in (tp2["eager"], tp2["compiled"]):
        for got, want in zip(run, tp1):
            # the sharded model is as close to the reference as the unsharded one (teacher forced)
            assert max(got["errors"]) <= max(want["errors"]) + 1e-2, (got["errors"], want["errors"])
            for a, b in zip(got["topk"], want["topk"]):  # rank 0's index heads are the TP1 heads it keeps
                b = b.narrow(0, rank0.kv_start, rank0.num_kv_heads)
                assert torch.equal(a.sort(-1).values, b.sort(-1).values)
            # bf16 partial sums reduce in another order: a few bf16 ulps of the logits.  Routing is
            # discontinuous, so only a token with a near-tied router (see ROUTING_TIE) may differ by more.
            per_token = relative_error(got["logits"], want["logits"], per_row=True)  # [T]
            settled = ~(got["ambiguous"] | want["ambiguous"])
            assert (per_token[settled] < 5e-2).all(), (per_token, settled)
            assert settled.float().mean() >= 0.5 and per_token.median() < 3e-2, (per_token, settled)


def test_head_sharding_rules():
    # M3 at TP8: 8 q heads per rank, KV heads replicated (rank r keeps KV head r // 2)
    shards = [HeadShard.for_rank(64, 4, TPInfo(rank, 8)) for rank in range(8)]
    assert {(s.num_q_heads, s.num_kv_heads) for s in shards} == {(8, 1)}
    assert [s.kv_start for s in shards] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(s.q_start // 16 == s.kv_start for s in shards)  # a rank's q heads use the KV head it keeps
    tp4 = [HeadShard.for_rank(64, 4, TPInfo(rank, 4)) for rank in range(4)]
    assert [(s.num_q_heads, s.num_kv_heads, s.kv_start) for s in tp4] == [(16, 1, r) for r in range(4)]
    with pytest.raises(ValueError, match="num_attention_heads"):
        HeadShard.for_rank(6, 2, TPInfo(0, 4))
    with pytest.raises(ValueError, match="intermediate size"):
        split_count(96, TPInfo(0, 5), "intermediate size")
