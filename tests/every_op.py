"""A small module that calls every mm3 op, and batches for it (shared by the lowering/export tests)."""

import dataclasses

import torch

import mm3_compile.ops
from mm3_compile import platform

PAGE = 128


class EveryOp(torch.nn.Module):
    """KV + index cache write, index top-k, sparse attention, fused and plain MXFP8 quant.

    The caches are module buffers mutated in place by ``mm3::kv_cache_write`` / ``index_copy_``.
    """

    def __init__(self, num_blocks=8, Hq=4, Hkv=2, D=64, index_dim=16, topk=2, kv_cache_dtype="auto", device="cpu"):
        super().__init__()
        self.Hkv, self.topk, self.kv_cache_dtype, self.sm_scale = Hkv, topk, kv_cache_dtype, D**-0.5
        storage = platform.resolve_kv_cache_dtype(kv_cache_dtype, device, torch.bfloat16)
        cache_dtype = torch.uint8 if platform.is_fp8(storage) else storage  # FP8 caches are bytes
        self.register_buffer("kv_cache", torch.zeros(num_blocks, Hkv, PAGE, 2 * D, dtype=cache_dtype, device=device))
        self.register_buffer("decode_workspace", mm3_compile.ops.decode_workspace(device), persistent=False)
        self.register_buffer(
            "index_cache", torch.zeros(num_blocks, PAGE, index_dim, dtype=torch.bfloat16, device=device)
        )

    def _write(self, k, v, index_k, slot_mapping):
        torch.ops.mm3.kv_cache_write(k, v, self.kv_cache, slot_mapping, self.kv_cache_dtype)
        self.index_cache.view(-1, self.index_cache.shape[-1]).index_copy_(0, slot_mapping, index_k)

    def _mlp(self, out, gate_up):
        act_values, act_scales = torch.ops.mm3.swiglu_oai_mxfp8_quant(gate_up, 1.702, 1.0, 7.0)
        out_values, out_scales = torch.ops.mm3.mxfp8_quantize(out.flatten(1))
        return out, act_values, act_scales, out_values, out_scales

    def prefill(self, q, k, v, index_q, index_k, gate_up, slot_mapping, block_table, cu_seqlens_q, seq_lens):
        self._write(k, v, index_k, slot_mapping)
        topk_idx = torch.ops.mm3.index_topk(
            index_q, self.index_cache, block_table, cu_seqlens_q, seq_lens, self.topk, 0, 1
        )
        out = torch.ops.mm3.sparse_attn_prefill(
            q, self.kv_cache, topk_idx, block_table, cu_seqlens_q, seq_lens, self.sm_scale, self.kv_cache_dtype
        )
        return self._mlp(out, gate_up)

    def decode(self, q, k, v, index_q, index_k, gate_up, slot_mapping, block_table, cu_seqlens_q, seq_lens):
        self._write(k, v, index_k, slot_mapping)
        topk_idx = torch.ops.mm3.index_topk(
            index_q, self.index_cache, block_table, cu_seqlens_q, seq_lens, self.topk, 0, 1
        )
        out = torch.ops.mm3.sparse_attn_decode_with_workspace(
            q, self.kv_cache, topk_idx, block_table, seq_lens, self.decode_workspace, self.sm_scale, self.kv_cache_dtype
        )
        return self._mlp(out, gate_up)

    forward = prefill


@dataclasses.dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    index_q: torch.Tensor  # [T, Hkv, index_dim]
    index_k: torch.Tensor  # [T, index_dim]
    gate_up: torch.Tensor  # [T, 2 * 64]
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [R, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32

    def args(self):
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def make_batch(module: EveryOp, context_lens, new_lens, seed=0, device="cpu") -> Batch:
    """Requests with ``context_lens[r]`` cached tokens and ``new_lens[r]`` new ones, pages in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = module.kv_cache.shape[0]
    Hkv, D = module.kv_cache.shape[1], module.kv_cache.shape[-1] // 2
    Hq, index_dim = Hkv * 2, module.index_cache.shape[-1]
    pages = torch.randperm(num_blocks, generator=g)
    seq_lens = [c + n for c, n in zip(context_lens, new_lens)]
    max_blocks = max(1, max((s + PAGE - 1) // PAGE for s in seq_lens))
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots, used = [], 0
    for r, (ctx, total) in enumerate(zip(context_lens, seq_lens)):
        n_pages = (total + PAGE - 1) // PAGE
        assert used + n_pages <= num_blocks, "not enough cache pages for this batch"
        block_table[r, :n_pages] = pages[used : used + n_pages].int()
        used += n_pages
        positions = torch.arange(ctx, total)
        slots.append(block_table[r, positions // PAGE].long() * PAGE + positions % PAGE)
    T = sum(new_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16).to(device)

    return Batch(
        q=randn(T, Hq, D),
        k=randn(T, Hkv, D),
        v=randn(T, Hkv, D),
        index_q=randn(T, Hkv, index_dim),
        index_k=randn(T, index_dim),
        gate_up=randn(T, 128) * 4,
        slot_mapping=torch.cat(slots).to(device),
        block_table=block_table.to(device),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
