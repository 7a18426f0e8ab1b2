"""Independent pure-PyTorch reference of the M3 model: no ``mm3`` op, no kernel, no code shared with the op model.

Dense fp32 math per request: explicit causal masks, a lightning indexer written as "score every key, max per
block, sort", explicit top-k block masks, dequantized MXFP8 weights (attention projections, MLPs, experts; its own MXFP8 quantizer), contiguous
per-request K/V histories instead of pages.

It models the network *as deployed in a model dtype*: values are rounded to the model dtype where the
op model stores a tensor (linear outputs, norm/RoPE outputs, attention output, residual stream, GEMM1 output)
and K/V are rounded to the KV-cache storage dtype (FP8 with saturation for FP8 caches), while every
operation in between is fp32.  So the op model and the reference see the same quantization points and differ
only by accumulation order and the attention kernel's bf16 P (tolerances in tests/models/test_models.py).

Teacher forcing: ``step(..., forced=hiddens)`` feeds each sub-block (attention, MLP/MoE) the op model's
input to that sub-block, so a sub-block is compared on identical inputs (a near-tie in routing or block
selection upstream cannot cascade into an O(1) difference downstream).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from mm3_compile import platform
from mm3_compile.contract import E8M0_BIAS, E8M0_MAX_FINITE, MX_BLOCK_SIZE, PAGE_SIZE
from mm3_compile.models.config import MiniMaxM3Config

BLOCK = PAGE_SIZE  # one sparse block is one KV page
# Routing scores closer than this are a tie when comparing logits of two op-model runs (TP shards): at M3
# widths, one-ulp bf16 changes in 2% of a router input move the scores by up to ~1e-3 (measured on random
# weights) and swapped experts only where the gap was < 2.2e-4; about 8% of random tokens fall under 1e-3.
ROUTING_TIE = 1e-3
# Tokens whose k-th and (k+1)-th routing scores are closer than this get a second reference output, with
# those two experts swapped, and a teacher-forced MoE output may match either (the swap is verified, not
# excused).  1.5x the widest margin a rounding-level swap was seen at: 1.05e-3, Inductor-compiled tiny model
# (hidden 128) on the H200.  Wider would let router bugs through: with the correction bias scaled by 0.9
# the op model swapped a token at 1.94e-3.
ROUTE_SWAP_WINDOW = 1.5e-3
# Index block scores closer than this fraction of the row's largest |q|.|k| dot are a tie: the op model's
# index q/k may differ from the reference's by one bf16 ulp where accumulation order changes a rounding.
# Measured at M3 widths (D 128, hidden 6144): one-ulp changes in 2-5% of the projection outputs moved a score
# by at most 2.2e-3 of that dot (about 0.2; the median gap between the 16th and 17th block is ~0.56).
INDEX_TIE = 2.0**-8
INIT_SCORE, LOCAL_SCORE, NAN_SCORE = 1e30, 1e29, -1e30


def mx_quant_dequant(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """MXFP8 round trip (fp32 in, fp32 out): per 32 values ``sb = clamp(ceil(log2(amax / max)) + 127, 0, 254)``,
    values ``x * 2^(127 - sb)`` saturated and rounded to the platform's MX element dtype."""
    fmt = platform.fp8_format(platform.mxfp8_value_dtype(device))
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK_SIZE))  # [..., K/32, 32]
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny).double()
    sb = (torch.ceil(torch.log2(amax / fmt.max)) + E8M0_BIAS).clamp(0, E8M0_MAX_FINITE)
    values = (blocks.double() * torch.exp2(E8M0_BIAS - sb)).clamp(-fmt.max, fmt.max).float().to(fmt.dtype)
    return (values.double() * torch.exp2(sb - E8M0_BIAS)).float().flatten(-2)


def to_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 values to a storage dtype and back (FP8: saturate first, torch casts do not)."""
    if platform.is_fp8(dtype):
        fmax = platform.fp8_format(dtype).max
        return x.clamp(-fmax, fmax).to(dtype).float()
    return x.to(dtype).float()


def gemma_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1 + w)


def rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Partial NeoX RoPE on x [T, heads, dim] with angles computed in float64."""
    half = rotary_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / rotary_dim)
    ang = positions.double()[:, None] * inv_freq[None]  # [T, half]
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
    a, b = x[..., :half], x[..., half:rotary_dim]
    out = x.clone()
    out[..., :half] = a * cos - b * sin
    out[..., half:rotary_dim] = b * cos + a * sin
    return out


def swiglu_oai(gate_up: torch.Tensor, alpha: float, beta: float, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)


def block_scores(scores: torch.Tensor, positions: torch.Tensor, cfg: MiniMaxM3Config) -> torch.Tensor:
    """Lightning indexer block scores [heads, q, blocks] from token scores [heads, q, S]: max over visible
    keys, NaN -> -1e30, init/local blocks forced (1e30 / 1e29), blocks past the query's own -inf."""
    H, Q, S = scores.shape
    nblk = -(-S // BLOCK)
    key_pos = torch.arange(nblk * BLOCK, device=scores.device)
    padded = torch.full((H, Q, nblk * BLOCK), -math.inf, device=scores.device)
    padded[..., :S] = scores
    padded = torch.where(key_pos[None, None] <= positions[None, :, None], padded, -math.inf)
    per_block = padded.view(H, Q, nblk, BLOCK).amax(-1)  # [H, Q, nblk]
    visible = (positions // BLOCK + 1)[:, None]  # [Q, 1]
    b = torch.arange(nblk, device=scores.device)[None]  # [1, nblk]
    per_block = torch.where(torch.isnan(per_block), NAN_SCORE, per_block)
    per_block = torch.where(b < cfg.sparse_init_blocks, INIT_SCORE, per_block)
    per_block = torch.where(b >= visible - cfg.sparse_local_blocks, LOCAL_SCORE, per_block)
    return torch.where(b < visible, per_block, -math.inf)


def select_blocks(scores: torch.Tensor, positions: torch.Tensor, cfg: MiniMaxM3Config) -> torch.Tensor:
    """Lightning indexer on token scores [heads, q, S] -> block ids [heads, q, topk] (-1 padded)."""
    return pick_blocks(block_scores(scores, positions, cfg), positions, cfg)


def pick_blocks(per_block: torch.Tensor, positions: torch.Tensor, cfg: MiniMaxM3Config) -> torch.Tensor:
    """Stable descending sort of :func:`block_scores` [heads, q, blocks] (ties toward the lower block id),
    the first min(topk, visible blocks) kept -> [heads, q, topk] int32, -1 padded."""
    H, Q, nblk = per_block.shape
    visible = (positions // BLOCK + 1)[:, None]  # [Q, 1]
    order = torch.sort(per_block, dim=-1, descending=True, stable=True).indices  # [H, Q, nblk]
    k = cfg.sparse_topk_blocks
    if nblk < k:
        order = torch.cat([order, order.new_full((H, Q, k - nblk), -1)], dim=-1)
    chosen = order[..., :k]
    slot = torch.arange(k, device=per_block.device)[None, None]
    return torch.where(slot < torch.clamp(visible, max=k)[None], chosen, -1).to(torch.int32)


@dataclasses.dataclass
class RefStep:
    logits: torch.Tensor  # [T, V] fp32
    hiddens: list[torch.Tensor]  # sub-block outputs, fp32 values of model-dtype numbers; hiddens[0] = embedding
    topk: list[torch.Tensor]  # per sparse layer [Hkv, T, topk] int32
    block_scores: list[torch.Tensor]  # per sparse layer [Hkv, T, max blocks] fp32, -inf past a request's blocks
    index_tie: list[torch.Tensor]  # per sparse layer [Hkv, T]: block scores closer than this are a tie
    route_margin: dict[int, torch.Tensor]  # per MoE layer [T]: k-th minus (k+1)-th routing score
    # per MoE layer: (tokens [n] with a margin under ROUTE_SWAP_WINDOW, their sub-block outputs [n, H] with the
    # k-th and (k+1)-th experts swapped)
    route_swaps: dict[int, tuple[torch.Tensor, torch.Tensor]]


class ReferenceModel:
    """The reference M3 model over a batch of requests with contiguous per-request histories."""

    def __init__(
        self, config: MiniMaxM3Config, state: dict, model_dtype=torch.bfloat16, kv_cache_dtype="auto", device="cpu"
    ):
        self.cfg, self.model_dtype = config, model_dtype
        self.device = torch.device(device)
        self.kv_dtype = platform.resolve_kv_cache_dtype(kv_cache_dtype, self.device, model_dtype)
        # fp32 copies of every weight; MXFP8 weights as their dequantized values
        self.w = {}
        for name, t in state.items():
            if name.endswith("_proj.weight") or ".mlp." in name or ".moe.experts." in name or ".moe.shared." in name:
                # one expert at a time, into one fp32 buffer: the real-width experts are 18 GiB in fp32, so no
                # whole-tensor fp32 copy or stacked list (the fp64 temporaries are one expert's)
                out = torch.empty(t.shape, dtype=torch.float32, device=self.device)
                for e_out, e in zip(out.view(-1, *t.shape[-2:]), t.view(-1, *t.shape[-2:])):
                    e_out.copy_(mx_quant_dequant(e.to(self.device), self.device))
                t = out
            self.w[name] = t.to(self.device).float()
        self.reset(0)

    def reset(self, num_requests: int) -> None:
        # history[layer][request] = dict(k [L, Hkv, D], v [L, Hkv, D], ik [L, Didx]) in cache-rounded fp32
        self.history = [
            [{"k": None, "v": None, "ik": None} for _ in range(num_requests)] for _ in range(self.cfg.num_hidden_layers)
        ]
        self.seq_lens = [0] * num_requests

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.model_dtype).float()

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self._round(x @ self.w[name].T)

    # ---- sub-blocks ------------------------------------------------------------------------------

    def _attention(self, layer: int, h: torch.Tensor, q_lens: Sequence[int]):
        """Residual stream after attention [T, H], and the selected blocks [Hkv, T, topk] (sparse layers)."""
        cfg, p = self.cfg, f"layers.{layer}."
        sparse = cfg.is_sparse_layer(layer)
        D, Didx, Hq, Hkv = cfg.head_dim, cfg.index_head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        G = Hq // Hkv
        x = self._round(gemma_norm(h, self.w[p + "input_norm.weight"], cfg.rms_norm_eps))
        sizes = [Hq * D, Hkv * D, Hkv * D] + ([Hkv * Didx, Didx] if sparse else [])
        parts = self._linear(x, p + "attn.qkv_proj.weight").split(sizes, dim=-1)
        T = h.shape[0]
        positions = torch.cat(
            [torch.arange(self.seq_lens[r], self.seq_lens[r] + n, device=self.device) for r, n in enumerate(q_lens)]
        )

        def norm_rope(t, heads, dim, name):
            t = gemma_norm(t.reshape(T, heads, dim), self.w[p + f"attn.{name}.weight"], cfg.rms_norm_eps)
            return self._round(rope(t, positions, cfg.rotary_dim, cfg.rope_theta))

        q = norm_rope(parts[0], Hq, D, "q_norm")
        k = to_storage(norm_rope(parts[1], Hkv, D, "k_norm"), self.kv_dtype)
        v = to_storage(parts[2].reshape(T, Hkv, D), self.kv_dtype)
        if sparse:
            iq = norm_rope(parts[3], Hkv, Didx, "index_q_norm")
            ik = norm_rope(parts[4], 1, Didx, "index_k_norm")[:, 0]
        outs, topks, scored, ties, start = [], [], [], [], 0
        for r, n in enumerate(q_lens):
            rows = slice(start, start + n)
            start += n
            hist = self.history[layer][r]
            for key, new in (("k", k[rows]), ("v", v[rows])) + ((("ik", ik[rows]),) if sparse else ()):
                hist[key] = new if hist[key] is None else torch.cat([hist[key], new])
            K, V = hist["k"], hist["v"]  # [S, Hkv, D]
            S = K.shape[0]
            pos = positions[rows]  # [n]
            allowed = torch.arange(S, device=self.device)[None, None] <= pos[None, :, None]  # [1, n, S]
            allowed = allowed.expand(Hkv, n, S)
            if sparse:
                scores = torch.einsum("qhd,sd->hqs", iq[rows], hist["ik"])  # raw dot, no softmax scale
                per_block = block_scores(scores, pos, cfg)  # [Hkv, n, blocks]
                chosen = pick_blocks(per_block, pos, cfg)  # [Hkv, n, topk]
                topks.append(chosen)
                scored.append(per_block)
                absolute = torch.einsum("qhd,sd->hqs", iq[rows].abs(), hist["ik"].abs())  # [Hkv, n, S]
                ties.append(INDEX_TIE * absolute.amax(-1))
                key_block = torch.arange(S, device=self.device) // BLOCK
                in_list = (key_block[None, None, None] == chosen[..., None].long()).any(2)  # [Hkv, n, S]
                allowed = allowed & in_list
            qh = q[rows].view(n, Hkv, G, D)
            logits = torch.einsum("nhgd,shd->hgns", qh, K) * cfg.sm_scale  # [Hkv, G, n, S]
            logits = logits.masked_fill(~allowed[:, None], -math.inf)
            o = torch.einsum("hgns,shd->nhgd", torch.softmax(logits, dim=-1), V)
            outs.append(o.reshape(n, Hq * D))
        attn = self._round(torch.cat(outs))
        out = self._linear(attn, p + "attn.o_proj.weight")
        if not sparse:
            return self._round(h + out), None
        width = max(t.shape[-1] for t in scored)
        scored = [torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=-math.inf) for t in scored]
        selection = (torch.cat(topks, dim=1), torch.cat(scored, dim=1), torch.cat(ties, dim=1))
        return self._round(h + out), selection

    def _mlp(self, x: torch.Tensor, prefix: str, expert: int | None = None) -> torch.Tensor:
        cfg = self.cfg
        w1, w2 = self.w[prefix + "gate_up.weight"], self.w[prefix + "down.weight"]
        if expert is not None:
            w1, w2 = w1[expert], w2[expert]
        gate_up = self._round(x @ w1.T)
        act = mx_quant_dequant(swiglu_oai(gate_up, cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit), self.device)
        return self._round(act @ w2.T)

    def _ffn(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        cfg, p = self.cfg, f"layers.{layer}."
        x = self._round(gemma_norm(h, self.w[p + "post_attn_norm.weight"], cfg.rms_norm_eps))
        if not cfg.is_sparse_layer(layer):
            return self._round(h + self._mlp(x, p + "mlp."))
        scores = torch.sigmoid(x @ self.w[p + "moe.gate.weight"].T)  # [T, E]
        choice = scores + self.w[p + "moe.e_score_correction_bias"]
        ranked = torch.sort(choice, dim=-1, descending=True, stable=True)
        k = cfg.num_experts_per_tok
        ids = ranked.indices[:, :k]  # [T, k]
        shared = self._mlp(x, p + "moe.shared.") if cfg.num_shared_experts else torch.zeros_like(x)
        out = self._routed(x, ids, scores, p) + shared
        if k < cfg.num_experts:
            margin = ranked.values[:, k - 1] - ranked.values[:, k]  # [T]
            self.route_margin[layer] = margin
        if k < cfg.num_experts and self.forced:  # free-running steps are not compared per sub-block
            swap = (margin < ROUTE_SWAP_WINDOW).nonzero().squeeze(1)  # [n]
            swap_ids = torch.cat([ids[swap, : k - 1], ranked.indices[swap, k : k + 1]], dim=1)  # [n, k]
            swap_out = self._routed(x[swap], swap_ids, scores[swap], p) + shared[swap]
            self.route_swaps[layer] = (swap, self._round(h[swap] + self._round(swap_out)))
        return self._round(h + self._round(out))

    def _routed(self, x: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor, prefix: str) -> torch.Tensor:
        """sum over a token's experts ``ids`` [T, k] of its renormalised sigmoid weight x expert(x)."""
        weights = scores.gather(-1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * self.cfg.routed_scaling_factor  # [T, k]
        out = torch.zeros_like(x)
        for e in range(self.cfg.num_experts):
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, weights[token, slot, None] * self._mlp(x[token], prefix + "moe.experts.", e))
        return out

    # ---- a whole step ----------------------------------------------------------------------------

    def step(self, input_ids: torch.Tensor, q_lens: Sequence[int], forced: Sequence[torch.Tensor] | None = None):
        """Run ``q_lens[r]`` new tokens per request (packed request-major) and append them to the histories.

        ``forced``: the op model's ``hiddens`` of the same step; sub-block i then reads ``forced[i]``
        instead of the reference's own previous output.
        """
        if len(q_lens) != len(self.seq_lens):
            if any(self.seq_lens):
                raise ValueError("step: the number of requests changed mid-run")
            self.reset(len(q_lens))

        def inp(i, own):
            return own if forced is None else forced[i].to(self.device).float()

        h = self._round(self.w["embed.weight"][input_ids.to(self.device)])
        hiddens, selections = [h], []
        self.route_margin, self.route_swaps, self.forced = {}, {}, forced is not None
        for layer in range(self.cfg.num_hidden_layers):
            h_mid, selection = self._attention(layer, inp(2 * layer, hiddens[-1]), q_lens)
            hiddens.append(h_mid)
            if selection is not None:
                selections.append(selection)
            hiddens.append(self._ffn(layer, inp(2 * layer + 1, h_mid)))
        last = inp(len(hiddens) - 1, hiddens[-1])
        final = self._round(gemma_norm(last, self.w["final_norm.weight"], self.cfg.rms_norm_eps))
        logits = self._round(final @ self.w["lm_head.weight"].T)
        self.seq_lens = [s + n for s, n in zip(self.seq_lens, q_lens)]
        topks, scored, ties = (list(x) for x in zip(*selections)) if selections else ([], [], [])
        return RefStep(logits, hiddens, topks, scored, ties, dict(self.route_margin), dict(self.route_swaps))


@dataclasses.dataclass
class Comparison:
    """Errors of an op-model run against the reference, per step."""

    logits_max_err: list[float]  # end to end (reference chained on its own outputs)
    logits_token_err: list[torch.Tensor]  # the same per token [T], over the step's max |reference logit|
    sub_block_max_err: list[list[float]]  # teacher forced, per step per sub-block, relative to the block's update
    topk_mismatch: list[int]  # teacher-forced selections worse than the reference's beyond a tie, per step
    topk_near_ties: list[int]  # selections that differ from the reference's only by near-tied blocks, per step
    route_swaps: list[int]  # teacher-forced (token, MoE layer) pairs on their near-tied swapped route, per step

    @property
    def worst_logits(self) -> float:
        return max(self.logits_max_err)

    @property
    def worst_sub_block(self) -> float:
        return max(max(s) for s in self.sub_block_max_err)


def _token_excess(op: torch.Tensor, ref: torch.Tensor, eps: float) -> torch.Tensor:
    """Per token [T]: max over the row of ``|op - ref|`` beyond ``eps`` (one model-dtype ulp) of ``|ref|``."""
    return ((op - ref).abs() - eps * ref.abs()).clamp(min=0).amax(-1)


def _swap_excess(op: torch.Tensor, ref: RefStep, sub_block: int, eps: float):
    """(tokens [n], excess [n] against the swapped-route outputs) of an MoE sub-block, or None."""
    layer = (sub_block - 2) // 2
    if sub_block % 2 or layer not in ref.route_swaps:
        return None
    tokens, rows = ref.route_swaps[layer]
    tokens = tokens.cpu()
    return tokens, _token_excess(op[tokens], rows.cpu(), eps)


def sub_block_errors(op_hiddens, ref: RefStep, forced) -> list[float]:
    """Per sub-block: max over tokens and elements of ``|op - ref|`` beyond one model-dtype ulp of ``ref``,
    over max ``|update|`` (update = sub-block output - input).

    The ulp allowance absorbs the residual add's rounding: a small update added to a large residual can
    round one ulp either way, which says nothing about the sub-block's accuracy.  In an MoE sub-block a
    token with near-tied k-th and (k+1)-th experts (``ROUTE_SWAP_WINDOW``) is measured against whichever
    of its two routes it is closer to: the op model rounds its router input differently, so it may
    legitimately take the other expert, and must then be as accurate for that route.  Only that one
    swap is allowed: a token with three experts within the window (rare: ~0.6% of tokens at M3 widths
    have two neighbouring margins under 1e-3) that takes the (k+2)-th counts as an error.
    """
    errs = []
    for i in range(1, len(op_hiddens)):
        op, r, inp = op_hiddens[i].cpu().float(), ref.hiddens[i].cpu(), forced[i - 1].cpu().float()
        if not r.numel():
            errs.append(0.0)
            continue
        eps = torch.finfo(op_hiddens[i].dtype).eps
        excess = _token_excess(op, r, eps)  # [T]
        swapped = _swap_excess(op, ref, i, eps)
        if swapped is not None:
            tokens, swap_excess = swapped
            excess[tokens] = torch.minimum(excess[tokens], swap_excess)
        errs.append((excess.max() / (r - inp).abs().max().clamp(min=1e-6)).item())
    return errs


def route_swaps_taken(op_hiddens, ref: RefStep) -> int:
    """(token, MoE layer) pairs whose op output follows the swapped route: at most a quarter of the excess
    against the reference's route (an output that matches neither route is not counted)."""
    taken = 0
    for i in range(1, len(op_hiddens)):
        op = op_hiddens[i].cpu().float()
        eps = torch.finfo(op_hiddens[i].dtype).eps
        swapped = _swap_excess(op, ref, i, eps)
        if swapped is not None:
            tokens, swap_excess = swapped
            taken += int((swap_excess <= 0.25 * _token_excess(op[tokens], ref.hiddens[i].cpu()[tokens], eps)).sum())
    return taken


def topk_set_mismatches(op_topk, ref: RefStep) -> tuple[int, int]:
    """(mismatches, near ties) between the op model's selections [Hkv, T, topk] and the reference's, per row.

    A row whose block set differs from the reference's is a near tie when the reference's scores of the op's
    picks, sorted, are within ``ref.index_tie`` of its own best scores, slot by slot (the op read index q/k
    one bf16 ulp apart); otherwise, or when the padding differs, it is a mismatch.
    """
    bad = near = 0
    for got, want, scores, tie in zip(op_topk, ref.topk, ref.block_scores, ref.index_tie):
        got, want, scores, tie = got.cpu().long(), want.cpu().long(), scores.cpu(), tie.cpu()
        differs = (got.sort(-1).values != want.sort(-1).values).any(-1)  # [Hkv, T]
        for h, t in differs.nonzero().tolist():
            g, w = got[h, t], want[h, t]
            if not torch.equal(g < 0, w < 0) or bool((g >= scores.shape[-1]).any()):
                bad += 1
                continue
            picked = scores[h, t, g[g >= 0]].sort(descending=True).values
            best = scores[h, t, w[w >= 0]].sort(descending=True).values
            gap = torch.where(picked == best, 0.0, best - picked)  # forced blocks: equal huge scores, no inf-inf
            if bool((gap <= tie[h, t]).all()):
                near += 1
            else:
                bad += 1
    return bad, near


def compare_with_reference(
    result, config: MiniMaxM3Config, state: dict, model_dtype, kv_cache_dtype: str, device="cpu"
) -> Comparison:
    """Replay a :class:`~mm3_compile.models.runtime.WorkloadResult` through two references (teacher forced
    and free running) and collect the errors."""
    forced_ref = ReferenceModel(config, state, model_dtype, kv_cache_dtype, device)
    free_ref = ReferenceModel(config, state, model_dtype, kv_cache_dtype, device)
    logits_err, token_err, block_err, mismatch, near_ties, swaps = [], [], [], [], [], []
    for step in result.steps:
        ids = step.input_ids
        tf = forced_ref.step(ids, step.q_lens, forced=step.hiddens)
        free = free_ref.step(ids, step.q_lens)
        diff = (step.logits - free.logits.cpu()).abs()  # [T, V]
        logits_err.append(diff.max().item())
        token_err.append(diff.amax(-1) / free.logits.abs().max().cpu())
        block_err.append(sub_block_errors(step.hiddens, tf, step.hiddens))
        swaps.append(route_swaps_taken(step.hiddens, tf))
        bad, near = topk_set_mismatches(step.topk, tf)
        mismatch.append(bad)
        near_ties.append(near)
    return Comparison(logits_err, token_err, block_err, mismatch, near_ties, swaps)
