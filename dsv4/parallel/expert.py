"""Expert parallelism over data-parallel ranks: each rank holds 1/N of the routed experts, and every
MoE layer sends each token to the ranks holding its experts and brings the outputs back.

Data-parallel attention (``data_parallel_size`` N, ``enable_expert_parallel``): every rank runs the
whole model on its own requests' tokens — attention over its own KV cache, the dense layers, the
shared expert, the router and the head, all with whole (replicated) weights — except the routed
experts: rank r holds experts [r·E/N, (r+1)·E/N) and loads only those.

One MoE layer (``EPGroup.exchange``), with ``torch.distributed.all_to_all_single`` on the compute
group (NCCL on CUDA, gloo on CPU):

1. **counts**: each rank tells every other how many token rows and (token, expert) pairs it will
   send it — one all-to-all of an [N, 2] tensor, then one host read of the counts;
2. **dispatch**: a token goes once to each rank that holds any of its experts (its hidden row),
   with its k expert ids (those of other ranks as −1) — two all-to-alls with per-rank split sizes;
3. **compute**: the receiving rank runs each (row, expert) pair of its experts (the model's
   ``compute``);
4. **combine**: each pair's output goes back to its token's rank — one all-to-all — and lands in
   its token's slot, [T, k, H]; the model sums the slots in its own order (``moe.combine_pairs``:
   ascending expert id from fp32 zero, as the single-process layer does), so on CPU the layer's
   output is bitwise the single process's.

A rank with no tokens still joins every exchange with zero counts (its experts serve the other
ranks' tokens): a data-parallel rank without work runs a dummy forward (``idle_forward``).

The decode CUDA graphs capture the *dense* exchange instead (``dense_mode``; every rank replays a
graph of the same T lanes): every rank's rows and ids are all-gathered, each rank computes its
experts' slots of all of them with fixed shapes, and an all-to-all of equal splits brings each
token's slots back, where the token's rank takes each slot from its expert's rank. No count is
read on the host, and the combine is the same, so the bits are too.

An exchange that fails half-way leaves the ranks' collectives out of step: it marks the group
``broken`` and raises :class:`~dsv4.engine.errors.EngineDeadError`. A forward that fails *between*
exchanges (say in an attention layer) is finished with empty exchanges for the layers it did not
reach (``finish_forward``), so the other ranks' forward completes and only this rank's requests
fail.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from ..engine.errors import EngineDeadError
from .group import CommTimer

_EXPERT = re.compile(r"^(?:layers|mtp)\.\d+\.ffn\.experts\.(\d+)\.")


class EPGroup(CommTimer):
    """One data-parallel rank's share of the routed experts and the all-to-all that reaches the others.

    ``group``: the compute process group (None: the default group). Without a process group
    (``world_size`` 1, or a test that only reads shards) nothing is exchanged."""

    def __init__(self, rank: int, world_size: int, n_experts: int, device, group=None, tp=None):
        """``tp``: tensor parallelism inside the data-parallel rank (a ``TPGroup`` of its processes;
        ``rank`` / ``world_size`` then count every process): the experts are split over all of
        them, every other weight is the tensor-parallel shard, and each MoE layer's tokens are
        shared out over the group's ranks for the exchange (``MoE._forward_tp_ep``)."""
        super().__init__()
        self.tp = tp
        self.read_bytes = 0  # what this rank has read of the checkpoint (its startup report)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a data-parallel group of {world_size}")
        if n_experts % world_size:
            raise ValueError(f"n_routed_experts={n_experts} is not divisible by data_parallel_size={world_size} "
                             "(each rank holds an equal share of the routed experts)")
        self.rank, self.world_size, self.n_experts = rank, world_size, n_experts
        self.per_rank = n_experts // world_size
        self.device = torch.device(device)
        self.group = group
        self.exchanges = 0  # MoE layers exchanged in the forward in progress
        self.forwards = 0  # forwards run since the counter was last reset (an engine step's, by dp_rank)
        self.broken: str | None = None
        self.dense = False  # the fixed-shape exchange (decode graphs), see dense_mode

    # ---- what ModelWeights calls (the ``shard`` hook): experts split, everything else whole ----
    def expert_range(self, n_experts: int) -> tuple[int, int]:
        if n_experts != self.n_experts:
            raise ValueError(f"the checkpoint has {n_experts} routed experts, the group was made for {self.n_experts}")
        return self.rank * self.per_rank, (self.rank + 1) * self.per_rank

    def read(self, ckpt, name: str) -> torch.Tensor:
        m = _EXPERT.match(name)
        if m is not None:
            lo, hi = self.expert_range(ckpt.config.n_routed_experts)
            if not lo <= int(m.group(1)) < hi:
                raise ValueError(f"expert-parallel rank {self.rank} holds experts [{lo}, {hi}); '{name}' belongs "
                                 "to another rank")
        t = ckpt.get(name) if m is not None or self.tp is None else self.tp.read(ckpt, name)
        self.read_bytes += t.numel() * t.element_size()
        return t

    def check(self, cfg) -> None:
        """A model of ``cfg`` can be split this way (the ReferenceModel built with this group asks)."""
        self.expert_range(cfg.n_routed_experts)
        if self.tp is not None:
            self.tp.shard_plan(cfg)

    # ---- one MoE layer ---------------------------------------------------------------------
    def exchange(self, x: torch.Tensor, ids: torch.Tensor, pairs, slots) -> torch.Tensor:
        """Every (token, expert) pair of ``ids`` [T, k] computed on the rank holding the expert;
        returns their outputs [T, k, H] in ``x``'s dtype, each in its token's slot.

        ``pairs(xr, rows, experts)`` runs on every rank for the pairs it received: ``xr`` [R, H]
        the token rows that reached it, ``rows`` / ``experts`` [P] each pair's row of ``xr`` and
        global expert id (this rank's experts only); it returns the pairs' outputs [P, H].
        ``slots(xr, local)``: the same for every slot of ``local`` [R, k] (this rank's experts'
        ids, -1 elsewhere), [R, k, H] with zeros at -1 — what the dense exchange calls."""
        if self.broken is not None:
            raise EngineDeadError(self.broken)
        self.exchanges += 1
        try:
            return self._exchange_dense(x, ids, slots) if self.dense else self._exchange(x, ids, pairs)
        except Exception as e:  # noqa: BLE001 - the ranks are mid-exchange: nothing can be re-matched
            self.broken = (f"the expert-parallel exchange of MoE layer {self.exchanges - 1} failed on data-parallel "
                           f"rank {self.rank}: {type(e).__name__}: {e}")
            raise EngineDeadError(self.broken) from e

    def _exchange(self, x, ids, compute):
        n, (t, k), h = self.world_size, ids.shape, x.shape[1]
        dev = x.device
        ids = ids.long()
        dest = torch.div(ids, self.per_rank, rounding_mode="floor")  # [T, k] the rank holding each expert
        hit = torch.zeros(t, n, dtype=torch.bool, device=dev)
        hit.scatter_(1, dest, True)
        to_rank, rows = hit.t().nonzero(as_tuple=True)  # the rows each rank gets, rank by rank, rows ascending
        send_ids = torch.where(dest[rows] == to_rank[:, None], ids[rows], torch.full_like(ids[rows], -1))
        counts = torch.stack([hit.sum(0), torch.bincount(dest.flatten(), minlength=n)], dim=1)  # [N, 2]
        got = torch.empty_like(counts)
        self._a2a(got, counts)
        both = torch.cat([counts, got]).tolist()  # the step's one host read per layer
        sent, recv = both[:n], both[n:]
        send_rows, send_pairs = [c[0] for c in sent], [c[1] for c in sent]
        recv_rows, recv_pairs = [c[0] for c in recv], [c[1] for c in recv]
        xr = x.new_empty(sum(recv_rows), h)
        self._a2a(xr, x[rows].contiguous(), recv_rows, send_rows)
        idr = ids.new_empty(sum(recv_rows), k)
        self._a2a(idr, send_ids.contiguous(), recv_rows, send_rows)
        # each received row's pairs in row-major order: per source rank, its tokens in its order and
        # each token's slots ascending — the order the source expects them back in
        prow, pslot = (idr >= 0).nonzero(as_tuple=True)
        y = compute(xr, prow, idr[prow, pslot])
        if tuple(y.shape) != (prow.numel(), h):
            raise RuntimeError(f"the experts returned {tuple(y.shape)} for {prow.numel()} pairs of width {h}")
        back = x.new_empty(t * k, h)
        self._a2a(back, y.to(x.dtype).contiguous(), send_pairs, recv_pairs)
        # the pairs came back rank by rank, each rank's in (token, slot) order: a stable sort by rank
        order = torch.sort(dest.flatten(), stable=True).indices
        out = x.new_empty(t * k, h)
        out[order] = back
        return out.view(t, k, h)

    def _exchange_dense(self, x, ids, slots):
        """The exchange with fixed shapes, for a CUDA graph (every rank replays the same bucket T):
        every rank's rows and ids reach every rank (all-gather), each computes the slots of its
        own experts, and each slot's output comes back from the rank holding its expert (an
        all-to-all of equal splits; the token's rank picks, per slot, the one of its expert's rank —
        the others sent zeros there). No count is read on the host."""
        n, (t, k), h = self.world_size, ids.shape, x.shape[1]
        ids = ids.long()
        xs = x.new_empty(n * t, h)
        self._gather(xs, x.contiguous())
        every = ids.new_empty(n * t, k)
        self._gather(every, ids.contiguous())
        lo, hi = self.expert_range(self.n_experts)
        local = torch.where((every >= lo) & (every < hi), every, torch.full_like(every, -1))
        y = slots(xs, local).to(x.dtype).contiguous()  # [N·T, k, H]: rank r's tokens are rows r·T …
        back = torch.empty_like(y)
        self._a2a(back, y)
        dest = torch.div(ids, self.per_rank, rounding_mode="floor")
        tok = torch.arange(t, device=x.device)[:, None]
        return back.view(n, t, k, h)[dest, tok, torch.arange(k, device=x.device)[None, :]]

    def dense_mode(self):
        """While in this context, exchanges are dense (a decode graph's capture, or its emulation)."""
        import contextlib

        @contextlib.contextmanager
        def ctx():
            old, self.dense = self.dense, True
            try:
                yield
            finally:
                self.dense = old

        return ctx()

    def _gather(self, out, inp) -> None:
        t0 = self._tick()
        dist.all_gather_into_tensor(out, inp, group=self.group)  # (NCCL since torch 1.13; gloo too)
        self._tock(t0)

    def _a2a(self, out, inp, out_splits=None, in_splits=None) -> None:
        t0 = self._tick()
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        self._tock(t0)

    # ---- a forward's exchanges ---------------------------------------------------------------
    def begin_forward(self) -> None:
        self.exchanges = 0
        self.forwards += 1

    def finish_forward(self, model) -> None:
        """A forward that raised between exchanges: join the exchanges of the MoE layers it did
        not reach, with no tokens, so that the other ranks' forward completes."""
        if self.broken is not None:
            raise EngineDeadError(self.broken)
        for b in model.blocks[self.exchanges:]:
            b.moe.forward(torch.zeros(0, model.cfg.hidden_size, dtype=model.dtype, device=model.device),
                          torch.zeros(0, dtype=torch.long, device=model.device))


def idle_forward(model) -> None:
    """A dummy forward of a rank with no tokens this step: every MoE layer's exchange, with zero
    counts, in the layers' order (a rank's forward is all of its MoE layers, one exchange each)."""
    ep = model.ep
    ep.begin_forward()
    ep.finish_forward(model)
