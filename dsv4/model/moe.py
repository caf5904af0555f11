"""Mixture of experts: sqrt-softplus gate, hash or biased top-k routing, clamped SwiGLU experts.

Routing math is float32. The bias (``noaux_tc``) only chooses experts; weights come from the
unbiased scores, renormalised and scaled by ``routed_scaling_factor``. Hash layers take the
experts from ``tid2eid[token]``. The shared expert runs for every token at weight 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .branches import Deferred
from .linear import stable_topk
from .weights import stack_fp8_rows

# Where branches run beside the main path: the shared expert's [w1; w3] GEMM beside the routing, joined before the
# routed experts, and its activation and w2 beside the routed experts (``Deferred``: forked after their up kernel's
# launch), joined at their sum. The join before the routed experts then waits for one GEMM, not three launches
# (H200, 43 layers, CUDA graphs, one call: batch 1 8.97 against 9.28 ms a step, batch 8 13.86 against 14.25; the
# w2 GEMM beside the up kernel slows it by ~2 µs). False: the whole shared expert joined before the routed experts.
SHARED_DOWN_BESIDE_EXPERTS = True


def swiglu(ops, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float,
           act_quant: bool = False, w13=None) -> torch.Tensor:
    """w2 · (silu(min(w1·x, limit)) · clamp(w3·x, ±limit)) with the op set ``ops``' GEMMs and
    activation (a kernel: one launch instead of ~9 elementwise ones); the activation in float32.
    ``w13``: [w1; w3] stacked by rows (``stack_fp8_rows``): one GEMM, whose column halves are gate and up."""
    return swiglu_down(ops, *swiglu_up(ops, x, w1, w3, act_quant, w13), w2, limit, x.dtype, act_quant)


def swiglu_up(ops, x: torch.Tensor, w1, w3, act_quant: bool = False, w13=None):
    """``swiglu``'s first half: (w1·x, w3·x), one GEMM's column halves with ``w13``."""
    if w13 is not None:
        return tuple(ops.linear(x, w13, act_quant).split([w1.shape[0], w3.shape[0]], dim=-1))
    return ops.linear(x, w1, act_quant), ops.linear(x, w3, act_quant)


def swiglu_down(ops, gate: torch.Tensor, up: torch.Tensor, w2, limit: float, dtype: torch.dtype,
                act_quant: bool = False):
    """``swiglu``'s second half: w2 · the clamped activation of (gate, up) rounded to ``dtype`` (x's)."""
    return ops.linear(ops.swiglu_act(gate, up, limit, dtype), w2, act_quant)


def swiglu_act(gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
    """silu(min(gate, limit)) · clamp(up, ±limit), rounded to ``dtype``: the clamps in float32, the
    silu and the product in float64 (batch-invariant: see linear.py). The torch backend of
    ``swiglu_act`` (the Triton one computes the same bits)."""
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(min=-limit, max=limit)
    return (F.silu(g.double()) * u.double()).to(dtype)


def route(ops, x: torch.Tensor, gate_w: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None,
          tid2eid: torch.Tensor | None = None, token_ids: torch.Tensor | None = None):
    """Return (expert ids [T, k] long, weights [T, k] fp32). Ties break to the lowest expert id."""
    logits = ops.linear_f32(x, gate_w)
    scores = torch.sqrt(F.softplus(logits.double())).float()
    if tid2eid is not None:
        if token_ids is None:
            raise ValueError("hash-routed MoE layer needs the input token ids")
        ids = tid2eid[token_ids.clamp(0, tid2eid.shape[0] - 1)].long()
    else:
        sel = scores if bias is None else scores + bias.float()
        ids = stable_topk(torch.nan_to_num(sel, nan=-1e30), cfg.num_experts_per_tok)
    w = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        w = (w.double() / (w.double().sum(dim=-1, keepdim=True) + 1e-20)).float()
    return ids, w * cfg.routed_scaling_factor


class MoE:
    def __init__(self, weights, prefix: str, cfg: ModelConfig, hash_layer: bool, act_quant: bool, ops, tp=None,
                 ep=None):
        self.wts, self.prefix, self.cfg, self.act_quant, self.ops = weights, prefix, cfg, act_quant, ops
        self.gate = weights[f"{prefix}.gate.weight"]
        self.bias = None if hash_layer else weights[f"{prefix}.gate.bias"]
        self.tid2eid = weights[f"{prefix}.gate.tid2eid"] if hash_layer else None
        self.shared = self.shared_w13 = None
        if cfg.n_shared_experts:
            s = f"{prefix}.shared_experts"
            # w1 and w3 both read x: on the FP8 fast path one stacked weight (under TP this rank's shards), one launch
            w1, w3, self.shared_w13 = stack_fp8_rows(weights, f"{s}.w1.weight", f"{s}.w3.weight")
            self.shared = (w1, w3, weights[f"{s}.w2.weight"])
        # tensor parallelism (dsv4/parallel): this rank holds its experts (EP) or a slice of each
        # expert's intermediate dim (TP), and a slice of the shared expert; outputs are partial sums
        self.tp = tp
        # expert parallelism over data-parallel ranks (dsv4/parallel/expert.py): this rank holds its
        # share of the routed experts, everything else whole; ``ep.exchange`` reaches the others
        self.ep = ep
        self.grouped = weights.keep_quantized and ops.moe_experts is not None  # the fast path's grouped experts
        if self.grouped:
            # stacked now, not at the first forward: the engine sizes its KV cache from the memory
            # that loading leaves free, so every weight must be resident by then
            weights.stacked_experts(prefix)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        if self.ep is not None:
            return self._forward_ep(x, token_ids)
        if self.grouped:
            return self._forward_ops(x, token_ids)
        cfg, ops = self.cfg, self.ops
        ids, w = route(ops, x, self.gate, cfg, self.bias, self.tid2eid, token_ids)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        experts = torch.unique(ids).tolist()
        if self.tp is not None:
            experts = self.tp.owned_experts(experts)  # EP: only this rank's experts
        for e in experts:
            rows, slot = torch.where(ids == e)
            p = f"{self.prefix}.experts.{e}"
            y = ops.swiglu(x[rows], self.wts.expert(f"{p}.w1"), self.wts.expert(f"{p}.w3"), self.wts.expert(f"{p}.w2"),
                           cfg.swiglu_limit, self.act_quant)
            out.index_add_(0, rows, y.float() * w[rows, slot, None])
        if self.shared is not None:
            out += self._shared_expert(x).float()
        if self.tp is not None:
            out = self.tp.all_reduce(out)  # routed + shared partial sums of every rank, in fp32
        return out.to(x.dtype)

    def _shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output for every row of ``x`` (weight 1; under TP this rank's partial sum)."""
        # without a stack the op's plain call, which code that patches ``ops.swiglu`` (fault tests) expects
        stacked = {} if self.shared_w13 is None else {"w13": self.shared_w13}
        return self.ops.swiglu(x, *self.shared, self.cfg.swiglu_limit, self.act_quant, **stacked)

    def _shared_up(self, x: torch.Tensor):
        """The shared expert's (gate, up) for every row of ``x`` (``swiglu_up``)."""
        w1, w3, _ = self.shared
        return swiglu_up(self.ops, x, w1, w3, self.act_quant, self.shared_w13)

    def _shared_down(self, gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The shared expert's output from its (gate, up) (``swiglu_down``)."""
        return swiglu_down(self.ops, gate, up, self.shared[2], self.cfg.swiglu_limit, dtype, self.act_quant)

    def _gate_float(self) -> torch.Tensor:
        """The gate in fp32, converted once, for the fp32 router GEMM (not made on the bf16 fast path)."""
        if getattr(self, "_gate_f32", None) is None:
            self._gate_f32 = self.gate.float()
        return self._gate_f32

    def _route_ops(self, x: torch.Tensor, token_ids: torch.Tensor):
        """The fast path's routing: (expert ids [T, k], weights [T, k] fp32)."""
        cfg, ops = self.cfg, self.ops
        logits = ops.linear_f32(x, self.gate, self._gate_float)  # the batch-invariant GEMM on the fast path
        hash_ids = None
        if self.tid2eid is not None:
            hash_ids = self.tid2eid[token_ids.clamp(0, self.tid2eid.shape[0] - 1)]
        return ops.moe_route(logits, self.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                             cfg.norm_topk_prob, hash_ids)

    def _forward_ops(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The fast path: routing and grouped expert GEMMs on the checkpoint-format weights."""
        cfg, ops = self.cfg, self.ops
        # the shared expert beside the routing (a concurrent branch), issued after the router's launches
        # (``fork_point``): a graph launches the router first instead of behind the shared GEMM's programs. What
        # runs beside the routed experts is issued after their up kernel: the grouped kernel's programs, launched
        # into SMs the shared GEMMs still hold, land unevenly (H200, 43 layers: its batch-1 launch took 66 µs
        # against 36)
        start = ops.fork_point()
        ids, w = self._route_ops(x, token_ids)
        # (only where branches run beside the main path, a graph capture: in order the split gains nothing)
        split = SHARED_DOWN_BESIDE_EXPERTS and self.shared is not None and start is not None
        shared = None if self.shared is None else ops.fork(self._shared_up if split else self._shared_expert, x,
                                                           after=start)
        if self.tp is not None:
            ids = self.tp.local_expert_ids(ids)  # EP: index into this rank's stack, -1 = another rank's
        if split:  # [w1; w3] joined here; the activation and w2 beside the routed experts, joined at their sum
            gate_up, point = shared.result(), ops.fork_point()
            shared = Deferred(lambda later: ops.fork(lambda g, u: self._shared_down(g, u, x.dtype), *gate_up,
                                                     after=point if later is None else later))
        elif shared is not None:
            shared.result()
        out = ops.moe_experts(x, ids, w, *self.wts.stacked_experts(self.prefix), limit=cfg.swiglu_limit,
                              expert_dtype=cfg.expert_dtype, add=shared, act_quant=self.act_quant)
        return out if self.tp is None else self.tp.all_reduce(out)


    def _forward_ep(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Expert parallelism over data-parallel ranks: this rank routes its own tokens,
        ``ep.exchange`` computes every (token, expert) pair on the rank holding that expert and
        brings the outputs back, and they are summed here in the order the single-process layer
        sums them (``combine_pairs``), then the shared expert is added as there. A rank with no
        tokens (``x`` of 0 rows) still joins the exchange: the other ranks' tokens reach its experts."""
        if self.tp is not None:
            return self._forward_tp_ep(x, token_ids)
        ids, w = self._route_any(x, token_ids)
        out = combine_pairs(self.ep.exchange(x, ids, self._pair_outputs, self._slot_outputs), ids, w)
        if self.shared is None or x.shape[0] == 0:
            return out.to(x.dtype)
        shared = self._shared_expert(x)
        if self.grouped:  # as _forward_ops: the experts' sum rounded to x.dtype, then the shared expert added
            return out.to(x.dtype) + shared
        return (out + shared.float()).to(x.dtype)

    def _route_any(self, x: torch.Tensor, token_ids: torch.Tensor):
        """(ids [T, k], weights [T, k] fp32) on either path; empty for no tokens."""
        k = self.cfg.num_experts_per_tok
        if x.shape[0] == 0:
            return (torch.zeros(0, k, dtype=torch.long, device=x.device),
                    torch.zeros(0, k, dtype=torch.float32, device=x.device))
        if self.grouped:
            return self._route_ops(x, token_ids)
        return route(self.ops, x, self.gate, self.cfg, self.bias, self.tid2eid, token_ids)

    def _forward_tp_ep(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Tensor parallelism inside a data-parallel rank: every rank of the tensor-parallel group
        holds the same tokens ``x`` (the attention's all-reduce) and routes them alike; rank t sends
        only its share of them (rows [t·⌈T/N⌉, …)) through the exchange over every process, so each
        (token, expert) pair is computed once. Its share's routed sum, placed in a zero [T, H], plus
        its partial shared expert (intermediate-split), all-reduced in fp32 over the group: every
        rank ends with the whole layer output. In a decode graph (the dense exchange) every share
        is padded to ⌈T/N⌉ rows, so that every process sends one shape."""
        cfg, tp = self.cfg, self.tp
        ids, w = self._route_any(x, token_ids)
        n, k = x.shape[0], cfg.num_experts_per_tok
        per = -(-n // tp.world_size)
        lo, hi = min(n, tp.rank * per), min(n, (tp.rank + 1) * per)
        xs, ids_s = x[lo:hi], ids[lo:hi]
        if self.ep.dense and hi - lo < per:  # a decode graph's exchange: every process sends ⌈n/T⌉ rows
            xs = torch.cat([xs, x.new_zeros(per - (hi - lo), x.shape[1])])
            ids_s = torch.cat([ids_s, ids.new_full((per - (hi - lo), k), -1)])  # (-1: no expert computes it)
        y = self.ep.exchange(xs.contiguous(), ids_s.contiguous(), self._pair_outputs, self._slot_outputs)
        mine = combine_pairs(y[: hi - lo], ids[lo:hi], w[lo:hi])
        if n == 0:  # (every rank of the group has no tokens: nothing to add up)
            return x.new_zeros(0, x.shape[1])
        out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
        out[lo:hi] = mine
        if self.shared is not None:
            out += self._shared_expert(x).float()
        return tp.all_reduce(out).to(x.dtype)

    def _pair_outputs(self, xr: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Expert ``experts[p]`` (one of this rank's) of token row ``xr[rows[p]]`` for every pair p:
        [P, H] in xr's dtype, unweighted (the token's rank weights and sums them)."""
        cfg, ops = self.cfg, self.ops
        if rows.numel() == 0:
            return xr.new_zeros(0, xr.shape[1])
        if self.grouped:  # one slot per pair, weight 1: the op's fp32 sum of one term is that term exactly
            lo, _ = self.ep.expert_range(cfg.n_routed_experts)
            one = torch.ones(rows.numel(), 1, dtype=torch.float32, device=xr.device)
            return ops.moe_experts(xr[rows], (experts - lo).to(torch.int32)[:, None], one,
                                   *self.wts.stacked_experts(self.prefix), limit=cfg.swiglu_limit,
                                   expert_dtype=cfg.expert_dtype, act_quant=self.act_quant)
        y = xr.new_empty(rows.numel(), xr.shape[1])
        for e in torch.unique(experts).tolist():
            sel = torch.where(experts == e)[0]
            p = f"{self.prefix}.experts.{e}"
            y[sel] = ops.swiglu(xr[rows[sel]], self.wts.expert(f"{p}.w1"), self.wts.expert(f"{p}.w3"),
                                self.wts.expert(f"{p}.w2"), cfg.swiglu_limit, self.act_quant)
        return y

    def _slot_outputs(self, xr: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Every slot of ``local`` [R, k] (the global id of one of this rank's experts, else -1) of
        token row ``xr[r]``: [R, k, H] in xr's dtype, zeros at -1. Fixed shapes on the grouped path
        (what a CUDA graph captures: each slot a row of its own, weight 1, -1 skipped by the op)."""
        cfg = self.cfg
        r, k = local.shape
        h = xr.shape[1]
        if self.grouped:
            lo, _ = self.ep.expert_range(cfg.n_routed_experts)
            ids = torch.where(local >= 0, local - lo, torch.full_like(local, -1)).to(torch.int32).reshape(r * k, 1)
            one = torch.ones(r * k, 1, dtype=torch.float32, device=xr.device)
            y = self.ops.moe_experts(xr[:, None, :].expand(r, k, h).reshape(r * k, h), ids, one,
                                     *self.wts.stacked_experts(self.prefix), limit=cfg.swiglu_limit,
                                     expert_dtype=cfg.expert_dtype, act_quant=self.act_quant)
            return y.view(r, k, h)
        y = xr.new_zeros(r, k, h)
        rows, slots = torch.where(local >= 0)
        if rows.numel():
            y[rows, slots] = self._pair_outputs(xr, rows, local[rows, slots])
        return y


def combine_pairs(y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_j w[t, j] · y[t, j] in float32, [T, k, H] → [T, H], summed as ``MoE.forward`` (and the torch
    ``moe_experts``) sum: from zero, each token's experts in ascending id order (ties: slot order),
    each term ``y.float() * w`` — so an expert-parallel layer gives the single-process bits."""
    t = y.shape[0]
    out = torch.zeros(t, y.shape[2], dtype=torch.float32, device=y.device)
    if t == 0:
        return out
    order = torch.sort(ids.long(), dim=1, stable=True).indices
    tok = torch.arange(t, device=y.device)
    for j in range(y.shape[1]):
        s = order[:, j]
        out += y[tok, s].float() * w[tok, s, None].float()
    return out
