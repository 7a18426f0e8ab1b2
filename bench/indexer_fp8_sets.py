"""How often the FP8 index-K cache changes the top-16 *set*, against the bf16 cache on the same data.

``python3 bench/indexer_fp8_sets.py``: the float64 naive reference on bf16 keys vs the same keys in the
authority's e4m3 (scale 1), N(0, 1) data, CPU.

``python3 bench/indexer_fp8_sets.py --model [--batch 8 --prompt 8192 --steps 8]`` (GPU): the real-width ``m3_1layer`` model (seeded random weights:
no release checkpoint here) runs the same prompts and decode tokens twice, with ``index_cache_dtype`` "auto"
(bf16) and "fp8", eager; its index q and index-K are the model's projections (RMSNorm + RoPE of the packed
``qkv`` linear), so the two runs differ only in the index cache. Rows that see at most 16 blocks take all of
them (identical by construction) and are counted apart.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _differ(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: whether the sets differ, and how many of b's ids are not in a. a, b [..., topk] int32."""
    rows = (a.sort(-1).values != b.sort(-1).values).any(-1)
    missing = (b[..., :, None] != a[..., None, :]).all(-1).sum(-1)
    return rows, missing


def random_sets() -> None:
    from mm3_compile import platform
    from mm3_compile.kernels.indexer.naive import index_topk_ref

    torch.manual_seed(0)
    fp8 = platform.platform_for(torch.device("cpu")).kv_e4m3_dtype
    for B, q_len, seq, H in ((32, 1, 32768, 4), (32, 1, 32768, 1), (1, 512, 8192, 4)):
        nb = seq // 128
        k = torch.randn(B * nb, 128, 128).to(torch.bfloat16)
        q = torch.randn(B * q_len, H, 128).to(torch.bfloat16)
        table = torch.randperm(B * nb).to(torch.int32).view(B, nb)
        cu = torch.arange(B + 1, dtype=torch.int32) * q_len
        sl = torch.full((B,), seq, dtype=torch.int32)
        rows, missing = _differ(
            index_topk_ref(q, k, table, cu, sl, 16, 0, 1), index_topk_ref(q, k.to(fp8), table, cu, sl, 16, 0, 1)
        )
        print(
            f"B{B} q{q_len} s{seq} Hidx{H}: {int(rows.sum())}/{rows.numel()} rows differ ({100 * rows.float().mean():.1f}%), "
            f"{missing.sum().item() / rows.numel():.2f} of 16 ids differ per row"
        )


def model_sets(batch: int, prompt: int, steps: int, cpu: bool) -> None:
    from mm3_compile.contract import PAGE_SIZE
    from mm3_compile.models import MiniMaxM3Config, PagedKVRuntime, build_model, random_full_state, run_demo_workload

    device = torch.device("cpu" if cpu else "cuda")
    config = MiniMaxM3Config.tiny() if cpu else MiniMaxM3Config.m3_1layer()  # --cpu: the harness check only
    model = build_model(config, seed=0, device=device, dtype=torch.bfloat16, state=random_full_state(config, 0, device))
    blocks = -(-(prompt + steps) // PAGE_SIZE) + 1
    runs = {}
    for dtype in ("auto", "fp8"):
        runtime = PagedKVRuntime(
            model, num_blocks=batch * blocks, max_blocks_per_request=blocks, index_cache_dtype=dtype
        )
        runs[dtype] = run_demo_workload(model, runtime, batch, prompt, steps, compiled=False)
        print(f"index cache {dtype}: {next(i for _, i in runtime.caches if i is not None).dtype}", flush=True)
        del runtime
    topk = config.sparse_topk_blocks
    for kind in ("prefill", "decode"):
        pairs = []
        for step, (a, b) in enumerate(zip(runs["auto"].steps, runs["fp8"].steps)):
            if a.kind != kind:
                continue
            # prefill: positions 0..prompt-1 of each request; decode step s (1-based): position prompt + s - 1
            pos = torch.arange(prompt).repeat(batch) if kind == "prefill" else torch.full((batch,), prompt + step - 1)
            pairs.append((a.topk[0], b.topk[0], pos))
        diff = total = miss = trivial = 0
        for a, b, pos in pairs:  # a, b [Hidx, T, topk]; pos [T]: the token's position
            choice = (pos // PAGE_SIZE + 1 > topk).expand(a.shape[0], -1)  # [Hidx, T] rows that select
            rows, missing = _differ(a, b)
            assert not rows[~choice].any(), "a row seeing <= topk blocks must take all of them"
            diff += int(rows[choice].sum())
            miss += int(missing[choice].sum())
            total += int(choice.sum())
            trivial += int((~choice).sum())
        print(
            f"{'tiny' if cpu else 'm3_1layer'} B{batch} prompt {prompt} {kind}: {diff}/{total} selecting rows differ "
            f"({100 * diff / max(1, total):.1f}%), {miss / max(1, total):.2f} of {topk} ids differ per row "
            f"({trivial} rows see <= {topk} blocks)",
            flush=True,
        )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", action="store_true", help="the real-width model's projections (GPU)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cpu", action="store_true", help="with --model: the tiny model on the CPU (a harness check)")
    args = p.parse_args()
    if args.model:
        model_sets(args.batch, args.prompt, args.steps, args.cpu)
    else:
        random_sets()


if __name__ == "__main__":
    main()
