"""A whole decoder step of the M3 model: eager vs ``torch.compile`` step time, cold and warm compile time.

GPU: ``m3_1layer`` (one sparse + MoE layer at the real widths), a batch of 32 requests after
2048-token prompts, bf16 KV.  CPU: the tiny model after 70-token prompts, to check the harness only.  The compiled step is also
reported against its HBM floor (:func:`hbm_floor_bytes` at the run's copy ceiling: ``pct_of_ceiling``).  The step time is
the median over the decode steps after the first (which pays for compilation in the compiled
run).  Cold compile = first compiled prefill + first decode step, in a process whose Inductor
caches have not seen the model; warm = the same after ``torch._dynamo.reset()`` (Inductor's
on-disk caches hit).  Checked first: the compiled step picks the same top-k blocks as eager on at
least 99% of lists (bf16 rounding may flip near-ties), the median token's final hidden state is
within 1% of eager and at most 1/16 of the tokens differ by more than 5% (a near-tied router may
pick another expert for a token).

On a GPU the compiled decode step is also replayed from a CUDA graph (``compiled_graph``,
:class:`mm3_compile.models.graphs.GraphedDecode`: static metadata buffers updated in place, one
graph for the batch's bucket), timed per step like the launched rows (host metadata copy + replay)
and checked against eager the same way, for the batch of 32 and for a single request (``B1``, compiled
afresh with the single request traced first: the kernels' schedules are chosen from the traced sizes).
Both graph rows are reported against their HBM floors.
"""

import statistics
import time

import torch
import torch._inductor.config

from bench.harness import Check, Context


def _workload(ctx: Context):
    from mm3_compile.contract import PAGE_SIZE
    from mm3_compile.models import MiniMaxM3Config, PagedKVRuntime, build_model, random_full_state

    if ctx.cuda:
        config, batch, prompt, steps = MiniMaxM3Config.m3_1layer(), 32, 2048, 8
    else:
        config, batch, prompt, steps = MiniMaxM3Config.tiny(), 2, 70, 2  # a harness check: one page per request
    blocks = -(-(prompt + steps) // PAGE_SIZE) + 1
    state = random_full_state(config, seed=0, device=ctx.device)
    model = build_model(config, seed=0, device=ctx.device, dtype=torch.bfloat16, state=state)
    runtime = PagedKVRuntime(model, num_blocks=batch * blocks, max_blocks_per_request=blocks, kv_cache_dtype="auto")
    return config, model, runtime, batch, prompt, steps


def hbm_floor_bytes(model, batch: int, seq_len: int, kv_bytes: int = 2) -> int:
    """Bytes one decode step must read from HBM: every weight once (the routed experts only as many as a uniform
    router is expected to pick, ``E * (1 - (1 - k/E)^B)`` per MoE layer, the embedding only its B rows), the KV
    pages attention visits (the top-k blocks of a sparse layer, the whole history of a dense one) and every
    index-K row the indexer scores."""
    from mm3_compile.contract import PAGE_SIZE
    from mm3_compile.models.moe import RoutedExperts

    cfg = model.config
    H, D, Didx, Hkv = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim, cfg.num_key_value_heads
    expert_ids = set()
    total = batch * H * model.embed.element_size()
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            E, k = cfg.num_experts, cfg.num_experts_per_tok
            tensors = [module.gate_up.values, module.gate_up.scales, module.down.values, module.down.scales]
            expert_ids.update(id(t) for t in tensors)
            total += int(E * (1 - (1 - k / E) ** batch) * sum(t.nbytes for t in tensors) / E)
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in expert_ids and t is not model.embed:
            total += t.nbytes
    blocks = -(-seq_len // PAGE_SIZE)
    for i in range(cfg.num_hidden_layers):
        if cfg.is_sparse_layer(i):
            visited = min(blocks, cfg.sparse_topk_blocks) * PAGE_SIZE
            total += batch * seq_len * Didx * model.embed.element_size()  # index-K rows
        else:
            visited = seq_len
        total += batch * visited * Hkv * 2 * D * kv_bytes
    return total


def _compare(compiled, eager) -> Check:
    lists = [(a != b).any(-1) for c, e in zip(compiled.steps, eager.steps) for a, b in zip(c.topk, e.topk)]
    differ = sum(int(d.sum()) for d in lists) / max(1, sum(d.numel() for d in lists))
    last_c, last_e = compiled.steps[-1].hiddens[-1].float(), eager.steps[-1].hiddens[-1].float()  # [T, H]
    per_token = ((last_c - last_e).norm(dim=-1) / last_e.norm(dim=-1).clamp(min=1e-6)).cpu()  # [T]
    # A near-tied router may pick another expert for a token under other bf16 roundings: that token's
    # hidden then differs by a whole expert; the others must agree to bf16 noise.
    flipped = float((per_token > 0.05).float().mean())
    median = float(per_token.median())
    return Check(
        differ <= 0.01 and flipped <= 1 / 16 and median <= 1e-2,
        median,
        f"top-k lists differing {differ:.2%}, final hidden rel. err median {median:.1e}, tokens > 5%: {flipped:.1%}",
    )


def _graphed_workload(model, runtime, fns, batch, prompt, steps):
    """The demo workload's prefill (compiled, launched) then its decode steps replayed from a CUDA graph."""
    from mm3_compile.models import StepResult, WorkloadResult
    from mm3_compile.models.graphs import GraphedDecode
    from mm3_compile.models.runtime import workload_tokens

    lens = [prompt] * batch
    prompts, decode_tokens = workload_tokens(model.config.vocab_size, lens, steps, seed=0)  # run_demo_workload's
    runtime.reset()
    graphed = GraphedDecode(model, runtime, decode_fn=fns[1], batch_sizes=(batch,))
    graphed.capture()
    results = []
    with torch.no_grad():
        ids = torch.cat(prompts)
        logits, hiddens, topk = fns[0](ids.to(runtime.device), runtime.add_prompts(lens), runtime.caches)
        results.append(
            StepResult(
                "prefill", lens, ids, logits.cpu(), tuple(h.cpu() for h in hiddens), tuple(t.cpu() for t in topk), 0.0
            )
        )
        for step in range(steps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            logits, hiddens, topk = graphed.step(decode_tokens[step])
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            cpu = (logits.cpu(), tuple(h.cpu() for h in hiddens), tuple(t.cpu() for t in topk))
            results.append(StepResult("decode", [1] * batch, decode_tokens[step], *cpu, seconds))
    return WorkloadResult(results, lens)


def _single_request(ctx: Context, model, prompt: int, steps: int, base: dict) -> None:
    """B1 decode steps replayed from a CUDA graph, compiled afresh with one request traced first."""
    from mm3_compile.contract import PAGE_SIZE
    from mm3_compile.models import PagedKVRuntime, compile_model, run_demo_workload

    blocks = -(-(prompt + steps) // PAGE_SIZE) + 1
    runtime = PagedKVRuntime(model, num_blocks=blocks, max_blocks_per_request=blocks, kv_cache_dtype="auto")
    eager = run_demo_workload(model, runtime, 1, prompt, steps, compiled=False)
    torch._dynamo.reset()
    # no FX graph cache hit: a hit would bring back code traced (and scheduled) for the batch of 32
    with torch._inductor.config.patch(fx_graph_cache=False):
        graphed = _graphed_workload(model, runtime, compile_model(model, backend=ctx.compile_backend), 1, prompt, steps)
    check = _compare(graphed, eager)
    ms = 1e3 * statistics.median(s.seconds for s in graphed.steps[2:])
    floor = hbm_floor_bytes(model, 1, prompt + steps)
    ctx.record(
        **dict(base, shape=base["shape"].replace(" B32 ", " B1 "), ceiling_kind="copy"),
        provider="compiled_graph",
        mode="graph",
        bytes=floor,
        note=f"{_floor_note(ctx, floor)}; {check.note}",
        correct=check.ok,
        max_err=check.max_err,
        n_sets=1,
        graph_replay=True,
        **ctx.rates(ms, None, floor, "copy"),
    )


def _floor_note(ctx: Context, floor: int) -> str:
    floor_ms = floor / ctx.ceilings["copy"] / 1e6 if ctx.ceilings.get("copy") else None
    return f"HBM floor {floor / 1e9:.3g} GB" + (f" = {floor_ms:.3g} ms at the copy ceiling" if floor_ms else "")


def fx_graph_cache_forced_off() -> bool:
    """True when TORCHINDUCTOR_FX_GRAPH_CACHE=0 is set: a forced value that no config patch overrides.

    Compile times are not reported then: without the cache, the warm compile is a second cold one (H200: 24.6 s
    instead of ~2.3 s) and the cold one loses its in-process hits.
    """
    with torch._inductor.config.patch(fx_graph_cache=True):
        return not torch._inductor.config.fx_graph_cache


def run(ctx: Context) -> None:
    from mm3_compile.models import compile_model, run_demo_workload

    config, model, runtime, batch, prompt, steps = _workload(ctx)
    shape = f"{'m3-1layer' if ctx.cuda else 'tiny'} B{batch} prompt {prompt} decode"
    base = dict(family="layer", shape=shape, dtype="bf16", kv_dtype="bf16", ceiling_kind="-")
    if ctx.budget.expired():
        ctx.record(**base, provider="(all)", mode="-", error="skipped: time budget")
        return

    def workload(fns):
        return run_demo_workload(model, runtime, batch, prompt, steps, compiled=fns)

    def first_steps(result) -> float:
        return result.steps[0].seconds + result.steps[1].seconds

    def decode_ms(result) -> float:
        return 1e3 * statistics.median(s.seconds for s in result.steps[2:])

    eager = workload(False)
    cache_on = not fx_graph_cache_forced_off()
    # the warm compile is the FX graph cache's hit: on even where the config turned it off
    with torch._inductor.config.patch(fx_graph_cache=True):
        fns = compile_model(model, backend=ctx.compile_backend)
        cold = workload(fns)
        steady = workload(fns)
        warm_fns = fns
        if cache_on:  # without the cache a second compile measures nothing: not spent
            torch._dynamo.reset()
            warm_fns = compile_model(model, backend=ctx.compile_backend)
            started = time.perf_counter()
            warm = workload(warm_fns)
            warm_wall = time.perf_counter() - started

    check = _compare(steady, eager)
    eager_ms, compiled_ms = decode_ms(eager), decode_ms(steady)
    common = dict(correct=check.ok, max_err=check.max_err, n_sets=1, graph_replay=False)
    ctx.record(**base, provider="eager", mode="launched", ms=eager_ms, us=eager_ms * 1e3, note=check.note, **common)
    floor = hbm_floor_bytes(model, batch, prompt + steps)
    rates = ctx.rates(compiled_ms, None, floor, "copy")  # ms, us, gbps and the % of the floor's copy rate
    floor_note = _floor_note(ctx, floor)
    ctx.record(
        **dict(base, ceiling_kind="copy"),
        provider="compiled",
        mode="launched",
        bytes=floor,
        note=f"{compiled_ms / eager_ms:.2f}x eager; {floor_note}; {check.note}",
        **common,
        **rates,
    )
    if ctx.cuda:
        graphed_run = _graphed_workload(model, runtime, warm_fns, batch, prompt, steps)  # warm_fns: compiled already
        graph_check = _compare(graphed_run, eager)
        graph_ms = 1e3 * statistics.median(s.seconds for s in graphed_run.steps[2:])
        ctx.record(
            **dict(base, ceiling_kind="copy"),
            provider="compiled_graph",
            mode="graph",
            bytes=floor,
            note=f"{graph_ms / compiled_ms:.2f}x launched compiled; {floor_note}; {graph_check.note}",
            **dict(common, correct=graph_check.ok, max_err=graph_check.max_err, graph_replay=True),
            **ctx.rates(graph_ms, None, floor, "copy"),
        )
    if not cache_on:
        for provider in ("compile_cold", "compile_warm"):
            ctx.record(
                **base,
                provider=provider,
                mode="-",
                error="not timed: TORCHINDUCTOR_FX_GRAPH_CACHE forces the FX graph cache off (unset it to time compiles)",
            )
    else:
        for provider, seconds, note in (
            (
                "compile_cold",
                first_steps(cold) - first_steps(steady),
                "first compiled prefill+decode minus steady state",
            ),
            (
                "compile_warm",
                first_steps(warm) - first_steps(steady),
                f"after torch._dynamo.reset(); run wall {warm_wall:.1f} s",
            ),
        ):
            ctx.record(**base, provider=provider, mode="-", ms=seconds * 1e3, us=seconds * 1e6, note=note, **common)
    if ctx.cuda and not ctx.budget.expired():
        _single_request(ctx, model, prompt, steps, base)
