"""Block-sparse attention benchmarks: decode (split-K) and prefill, bf16 and FP8 (scalar scale) KV.

FLOPs count ``4*Hq*D`` per attended (query, key) pair under the contract's causal/top-k rule,
computed from the actual top-k lists; decode bytes are the K and V bytes of the keys in the
selected pages (per KV head) plus q and out.  The indexer is not timed here: the lists are
synthetic (own block first, then distinct random older blocks).
"""

import torch

from bench import inputs as bench_inputs
from bench.harness import Check, Context
from bench.refs import (
    _attend_chunk,
    chunk_tokens,
    compare,
    dense_causal_on_sample,
    naive_attention_on_sample,
    sample_tokens,
    sparse_attn_torch,
)
from mm3_compile.ops import decode_workspace

MIN_POOL_BYTES = 1 << 30  # physical pages scattered over >= 1 GiB: rotated sets do not share L2 lines


def _op_decode(
    q, cache, topk_idx, block_table, seq_lens, workspace, k_scale, v_scale, sm_scale: float, kv_cache_dtype: str
):
    # the attention layer's decode op: its counters live in a workspace, so a compiled call zeroes none
    return torch.ops.mm3.sparse_attn_decode_with_workspace(
        q, cache, topk_idx, block_table, seq_lens, workspace, sm_scale, kv_cache_dtype, k_scale, v_scale
    )


def _op_prefill(
    q, cache, topk_idx, block_table, cu_seqlens_q, seq_lens, k_scale, v_scale, sm_scale: float, kv_cache_dtype: str
):
    return torch.ops.mm3.sparse_attn_prefill(
        q, cache, topk_idx, block_table, cu_seqlens_q, seq_lens, sm_scale, kv_cache_dtype, k_scale, v_scale
    )


class _Family:
    """Shared by decode and prefill: inputs per case, the naive check on sampled tokens, our op and
    the vectorised PyTorch provider eager and compiled."""

    name = ""
    op = None

    def __init__(self, ctx: Context):
        self.ctx = ctx
        # dynamic=True: one graph per dtype/scale mode across batch sizes, token counts and head
        # counts, as a serving engine compiles (also keeps the run's compile time bounded).
        self.op_compiled = ctx.compile(self.op, dynamic=True)
        self.attend_compiled = ctx.compile(_attend_chunk, dynamic=True)
        self.expected = {}  # case key -> (sampled tokens, naive reference on them)

    def inputs(self, case):
        return bench_inputs.make_attn_inputs(
            case, self.ctx.device, self.ctx.l2_bytes, MIN_POOL_BYTES if self.ctx.cuda else 0, self.ctx.topk_share
        )

    def reference(self, inp):
        if inp.case.key not in self.expected:
            n = 8 if self.name == "decode" else 16  # the naive loop runs on the CPU in float64
            tokens = sample_tokens(inp.pos.shape[0], n if self.ctx.cuda else 8, gen_seed=len(inp.case.key))
            self.expected[inp.case.key] = (tokens, naive_attention_on_sample(inp, inp.sets[0], tokens))
        return self.expected[inp.case.key]

    def checker(self, inp):
        tokens, ref = self.reference(inp)

        def check(out):
            ok, err = compare(out[tokens.to(out.device)], ref)
            return Check(ok, err)

        return check

    def base(self, inp) -> dict:
        share = inp.case.share or self.ctx.topk_share
        return dict(family=self.name, shape=inp.case.shape, dtype="bf16", kv_dtype=inp.case.kv, topk_share=share)

    def op_fns(self, inp, fn):
        raise NotImplementedError

    def torch_fns(self, inp, attend):
        chunk = chunk_tokens(inp.case, self.ctx.device)
        return [lambda s=s: sparse_attn_torch(attend, inp, s, chunk) for s in inp.sets]

    def run(self, passes=("ours", "baselines")) -> None:
        cases = self.cases()
        for pass_name in passes:
            for case in cases:
                if pass_name == "baselines" and case.share:
                    continue  # the shared-list variants are informational rows of our op only
                if self.ctx.budget.expired():
                    self.skip(case, pass_name)
                    continue
                try:
                    inp = self.inputs(case)
                    check = self.checker(inp)
                except Exception as e:  # inputs or the reference failed: one error row
                    base = dict(family=self.name, shape=case.shape, dtype="bf16", kv_dtype=case.kv)
                    self.ctx._failed(dict(base, provider="(inputs/reference)"), ("launched",), e)
                    continue
                getattr(self, pass_name)(inp, check)
                del inp
                if self.ctx.cuda:
                    torch.cuda.empty_cache()

    def skip(self, case, pass_name) -> None:
        base = dict(family=self.name, shape=case.shape, dtype="bf16", kv_dtype=case.kv)
        self.ctx.record(**base, provider=f"({pass_name})", mode="-", error="skipped: time budget")


class Decode(_Family):
    name = "decode"
    op = staticmethod(_op_decode)

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.workspace = decode_workspace(ctx.device)  # one per process, like a layer's buffer

    def cases(self):
        return bench_inputs.decode_cases(not self.ctx.cuda, self.ctx.quick)

    def op_fns(self, inp, fn):
        return [
            lambda s=s: fn(
                s["q"],
                inp.cache,
                s["topk_idx"],
                s["block_table"],
                inp.seq_lens,
                self.workspace,
                s["k_scale"],
                s["v_scale"],
                inp.sm_scale,
                inp.case.kv_cache_dtype,
            )
            for s in inp.sets
        ]

    def _common(self, inp):
        return dict(
            modes=("launched", "graph"), nbytes=inp.kv_bytes + inp.io_bytes, flops=inp.flops, ceiling_kind="copy"
        )

    def ours(self, inp, check):
        base, kw = self.base(inp), self._common(inp)
        self.ctx.provider(base, "op", self.op_fns(inp, self.op), check, **kw)
        self.ctx.provider(base, "op_compiled", self.op_fns(inp, self.op_compiled), check, **kw)

    def baselines(self, inp, check):
        base, kw = self.base(inp), self._common(inp)
        self.ctx.provider(base, "torch_ref", self.torch_fns(inp, _attend_chunk), check, **kw)
        self.ctx.provider(base, "torch_ref_compiled", self.torch_fns(inp, self.attend_compiled), check, **kw)


class Prefill(_Family):
    name = "prefill"
    op = staticmethod(_op_prefill)

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        from torch.nn.attention.flex_attention import flex_attention

        if ctx.cuda:
            self.flex = ctx.compile(flex_attention, dynamic=False)
        else:  # the interpreter check runs Flex's unfused path; its "use torch.compile" warning is expected
            import warnings

            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            self.flex = flex_attention

    def cases(self):
        return bench_inputs.prefill_cases(not self.ctx.cuda, self.ctx.quick)

    def op_fns(self, inp, fn):
        return [
            lambda s=s: fn(
                s["q"],
                inp.cache,
                s["topk_idx"],
                s["block_table"],
                inp.cu_seqlens_q,
                inp.seq_lens,
                s["k_scale"],
                s["v_scale"],
                inp.sm_scale,
                inp.case.kv_cache_dtype,
            )
            for s in inp.sets
        ]

    def ours(self, inp, check):
        base = self.base(inp)
        self.ctx.provider(base, "op", self.op_fns(inp, self.op), check, flops=inp.flops, ceiling_kind="matmul")
        self.ctx.provider(
            base, "op_compiled", self.op_fns(inp, self.op_compiled), check, flops=inp.flops, ceiling_kind="matmul"
        )

    def baselines(self, inp, check):
        base = self.base(inp)
        # Cheapest first: a run that reaches its deadline loses the compile-heavy rows.
        if inp.case.kv == "bf16":  # Flex and SDPA read bf16 K/V: their fp8-KV figures would be the bf16 rows
            try:
                dense = _DenseContext(inp)
            except Exception as e:
                self.ctx._failed(dict(base, provider="flex/sdpa inputs"), ("launched",), e)
            else:
                self._sdpa(inp, base, dense)
                self._flex(inp, base, dense, check)
                del dense
        kw = dict(flops=inp.flops, ceiling_kind="matmul", slow=self.ctx.cuda)
        self.ctx.provider(base, "torch_ref", self.torch_fns(inp, _attend_chunk), check, **kw)
        self.ctx.provider(base, "torch_ref_compiled", self.torch_fns(inp, self.attend_compiled), check, **kw)

    def _flex(self, inp, base, dense, check):
        from torch.nn.attention.flex_attention import create_block_mask

        case = inp.case
        compile_mask = self.ctx.cuda

        def make_mask():
            return create_block_mask(
                dense.mask_mod,
                dense.B,
                case.Hkv,
                dense.Lq * dense.G,
                dense.S,
                device=str(self.ctx.device),
                BLOCK_SIZE=128,
                _compile=compile_mask,
            )

        def mask_check(block_mask):
            kept = float(block_mask.sparsity()) if hasattr(block_mask, "sparsity") else float("nan")
            return Check(True, None, f"block sparsity {kept:.1f}%")

        self.ctx.provider(base, "flex_create_block_mask", [make_mask], mask_check, note="per-step BlockMask build cost")
        try:
            block_mask = make_mask()
        except Exception as e:
            self.ctx._failed(dict(base, provider="flex_attention"), ("launched",), e)
            return

        def run_flex():
            out = self.flex(dense.q_flex, dense.k, dense.v, block_mask=block_mask, scale=inp.sm_scale)
            return dense.unflex(out)

        self.ctx.provider(
            base,
            "flex_attention",
            [run_flex],
            check,
            flops=inp.flops,
            ceiling_kind="matmul",
            note="compiled flex_attention, BlockMask from the same top-k lists; excl. mask build",
        )

    def _sdpa(self, inp, base, dense):
        import torch.nn.functional as F

        case = inp.case
        tokens = sample_tokens(inp.pos.shape[0], 8 if self.ctx.cuda else 4, gen_seed=1)
        expected = dense_causal_on_sample(
            inp.sets[0]["q"], dense.k, dense.v, tokens, case.q_lens, case.seq_lens, inp.sm_scale
        )
        q_s = dense.q_sdpa
        k_s = dense.k.repeat_interleave(dense.G, dim=1)  # [B, Hq, S, D]: plain MHA for every backend
        v_s = dense.v.repeat_interleave(dense.G, dim=1)
        if dense.Lq == dense.S:

            def run_sdpa():
                return dense.unsdpa(F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True, scale=inp.sm_scale))
        else:
            from torch.nn.attention.bias import causal_lower_right

            bias = causal_lower_right(dense.Lq, dense.S)

            def run_sdpa():
                return dense.unsdpa(F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=bias, scale=inp.sm_scale))

        def check(out):
            ok, err = compare(out[tokens.to(out.device)], expected)
            return Check(ok, err, "vs dense causal reference")

        self.ctx.provider(
            base,
            "sdpa_dense_causal",
            [run_sdpa],
            check,
            flops=bench_inputs.dense_causal_flops(case),
            ceiling_kind="matmul",
            note="flops = dense causal work it does (all keys j <= p)",
        )


class _DenseContext:
    """Contiguous per-request K/V (what Flex and SDPA read) and the equivalent Flex mask.

    Flex sees GQA folded into the query axis: q [B, Hkv, Lq*G, D] token-major (row = t*G + g), so
    one 128-row query block holds 128/G tokens and a BlockMask per KV head expresses each token's
    own top-k blocks exactly: ``selected[b, h, t, kv // 128] and kv <= p(t)``.
    """

    def __init__(self, inp):
        case = inp.case
        if len(set(case.q_lens)) != 1 or len(set(case.seq_lens)) != 1:
            raise ValueError("dense baselines need uniform requests")
        self.B, self.Lq, self.S = len(case.q_lens), case.q_lens[0], case.seq_lens[0]
        self.G = case.Hq // case.Hkv
        D, Hkv = case.D, case.Hkv
        s = inp.sets[0]
        n_blocks = -(-self.S // 128)
        pages = s["block_table"][:, :n_blocks].long()  # [B, nblk]
        kv = inp.cache[pages]  # [B, nblk, Hkv, 128, 2D]
        kv = kv.permute(0, 2, 1, 3, 4).reshape(self.B, Hkv, n_blocks * 128, 2 * D)[:, :, : self.S]
        self.k = kv[..., :D].contiguous()  # [B, Hkv, S, D]
        self.v = kv[..., D:].contiguous()
        q = s["q"].view(self.B, self.Lq, Hkv, self.G, D)
        self.q_flex = q.permute(0, 2, 1, 3, 4).reshape(self.B, Hkv, self.Lq * self.G, D)
        self.q_sdpa = s["q"].view(self.B, self.Lq, case.Hq, D).transpose(1, 2).contiguous()  # [B, Hq, Lq, D]
        ids = s["topk_idx"].long().view(Hkv, self.B, self.Lq, -1).permute(1, 0, 2, 3)  # [B, Hkv, Lq, T]
        pos = inp.pos.view(self.B, self.Lq)
        own = (pos // 128)[:, None, :, None]
        slots = torch.arange(ids.shape[-1], device=ids.device)
        valid = (slots < torch.clamp(own + 1, max=ids.shape[-1])) & (ids >= 0) & (ids <= own)
        selected = torch.zeros((self.B, Hkv, self.Lq, n_blocks + 1), dtype=torch.bool, device=ids.device)
        selected.scatter_(-1, torch.where(valid, ids, n_blocks), True)  # invalid slots land in a spare column
        self.selected = selected[..., :n_blocks].contiguous()
        self.offset = (pos[:, 0]).contiguous()  # [B] position of each request's first new token
        G, selected_t, offset = self.G, self.selected, self.offset

        def mask_mod(b, h, q_idx, kv_idx):
            t = q_idx // G
            return selected_t[b, h, t, kv_idx // 128] & (kv_idx <= offset[b] + t)

        self.mask_mod = mask_mod

    def unflex(self, out):  # [B, Hkv, Lq*G, D] -> [B*Lq, Hq, D]
        B, Hkv = out.shape[:2]
        return out.view(B, Hkv, self.Lq, self.G, -1).permute(0, 2, 1, 3, 4).reshape(B * self.Lq, Hkv * self.G, -1)

    def unsdpa(self, out):  # [B, Hq, Lq, D] -> [B*Lq, Hq, D]
        return out.transpose(1, 2).reshape(self.B * self.Lq, out.shape[1], -1)
