"""The message rank 0 broadcasts before each forward, and how a worker replays it on its own caches.

Every rank holds an identical paged cache (same budget, same page ids: the KV head, compressors
and indexer are replicated), so a step is fully described by what the engine's runner hands the
model — token ids, and per chunk its start, length and the request's block / SWA page ids, state
slot and computed-token count — plus the rows that need logits. The cache writes outside a forward
are a prefix-cache hit restoring boundary compressor rows into the request's state ring
(``BoundaryRestore``) and the host tier's transfers (``HostTransfer``: every rank copies its own
cache's blocks to and from its own host slots, the slots rank 0 chose); rank 0's cache manager
publishes them (``KVCacheManager.add_listener``), and every worker replays them first, in that order.

Async scheduling: a deferred step's token ids include placeholders whose tokens are the previous
step's greedy picks, still on rank 0's device. Every rank holds the same full logits (the head is
all-gathered), so a deferred step's plan (``keep_picks``) makes each worker pick the same greedy
tokens with the same op and keep them on its device; the next plan's ``fill`` names the token rows
to take from them. The plan is built from the host's copy of the inputs (``HostInputs``): reading
the device's token ids would wait for the step before.

Decode CUDA graphs: every rank captures its own at once (a "graphs" plan; the all-reduces inside
are matched bucket by bucket), and a step flagged ``graph`` makes each worker load the same static
inputs from the plan and replay its graph while rank 0 replays its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..cache.host_tier import HostKVStore, HostTransfer
from ..cache.paged import CacheAllocation, PagedSequenceView
from ..model.step import PagedStep, SeqChunk, Step


@dataclass
class ChunkPlan:
    start: int
    length: int
    blocks: list[int]
    swa: list[int]  # the request's SWA pages from ``swa_released`` on (every one before is -1)
    slot: int
    num_computed: int
    swa_released: int = 0

    def allocation(self) -> CacheAllocation:
        """The request's allocation as rank 0 holds it."""
        return CacheAllocation(blocks=self.blocks, swa=[-1] * self.swa_released + self.swa, slot=self.slot,
                               num_computed=self.num_computed, swa_released=self.swa_released)


@dataclass
class StepPlan:
    # "step" | "mtp" (an MTP pass of speculative drafting) | "cache" (allocate the paged cache of
    # ``budget``) | "graphs" (capture) | "idle" (a data-parallel rank's dummy forward: its MoE
    # exchanges only) | "spare" (replay ``bucket``'s decode graph with every lane spare) | "report"
    # (join the startup report) | "shutdown"
    kind: str
    token_ids: list[int] = field(default_factory=list)
    chunks: list[ChunkPlan] = field(default_factory=list)
    logits_rows: list[int] | None = None
    # cache writes before the forward, in order (``dsv4.cache.manager.CacheEvent``)
    restores: list = field(default_factory=list)
    paged: bool = False  # the runner's step was a PagedStep (the batched attention): build the same
    graph: bool = False  # rank 0 replays its decode CUDA graph of this batch: replay yours
    budget: object = None
    numerics: object = None  # "cache": the engine's CacheNumerics
    graph_sizes: tuple[int, int] | None = None  # "graphs": (max_num_seqs, max_model_len)
    host_slots: int = 0  # "cache": slots of the host tier (0: none)
    # async scheduling: (token-id row, picks row) taken from the previous step's greedy picks, and
    # whether this step's picks are kept for the next step
    fill: list[tuple[int, int]] = field(default_factory=list)
    keep_picks: bool = False
    # tensor parallelism inside a data-parallel rank: the decode graph bucket all ranks agreed on
    # (a "step" flagged ``graph``, or a "spare" replay: every lane spare)
    bucket: int | None = None
    # "mtp": the MTP layer's index and the (shape, dtype) of its input streams, which rank 0 broadcasts
    mtp: int = 0
    streams: tuple | None = None


def plan_step(token_ids: torch.Tensor, chunks: list[SeqChunk], logits_rows, restores, paged: bool,
              graph: bool = False, host=None, bucket: int | None = None) -> StepPlan:
    """``host``: the runner's ``HostInputs`` of the step (its token ids and rows as lists, no device
    read; and async scheduling's fill and deferral), else the tensors are read."""
    out = []
    for c in chunks:
        a = getattr(c.cache, "alloc", None)
        if a is None:
            raise TypeError(f"a tensor-parallel forward runs on the engine's paged cache views, got a "
                            f"{type(c.cache).__name__}: the workers cannot mirror it")
        # the released window pages are all -1: only their count travels (a long context's SWA
        # list is mostly released, and the plan is pickled and broadcast every step)
        r = a.swa_released
        out.append(ChunkPlan(c.start, c.length, list(a.blocks), a.swa[r:], a.slot, a.num_computed, r))
    if host is not None:
        return StepPlan("step", host.token_ids.tolist(), out, host.logits_rows.tolist(), list(restores), paged,
                        graph, fill=list(host.fill), keep_picks=host.deferred, bucket=bucket)
    rows = None if logits_rows is None else [int(r) for r in logits_rows.tolist()]
    return StepPlan("step", token_ids.tolist(), out, rows, list(restores), paged, graph, bucket=bucket)


def replay_restores(kvc, restores, host: HostKVStore | None = None) -> None:
    """Rank 0's cache writes outside the forward, in its order: host-tier transfers on ``host``
    (this rank's store), boundary rows into the state rings; the next compute waits for the copies."""
    transfers: list[HostTransfer] = []
    for op in restores:
        if isinstance(op, HostTransfer):
            if host is None:
                raise RuntimeError("rank 0 moved a block to or from its host tier but this worker has none")
            transfers.append(op)
            continue
        if transfers:  # the boundary rows may be read from a block those restored
            host.execute(transfers)
            host.wait()
            transfers = []
        alloc = CacheAllocation(blocks=[-1] * op.index + [op.block], slot=op.slot)
        PagedSequenceView(kvc, alloc).restore_boundary(op.index)
    if transfers:
        host.execute(transfers)
    if host is not None:
        host.wait()


@torch.no_grad()
def run_step(plan: StepPlan, model, kvc, device, graphs=None, host: HostKVStore | None = None,
             picks: torch.Tensor | None = None) -> torch.Tensor | None:
    """A worker's forward of one step (its logits are rank 0's business, except for the greedy
    picks async scheduling keeps); ``graphs``: this worker's captured decode graphs
    (``engine.cuda_graphs.DecodeGraphs``), for ``plan.graph``; ``host``: this worker's host-tier
    store; ``picks``: the previous step's kept picks. Returns this step's picks when the plan
    keeps them, else None."""
    from ..engine.overlap import fill_tokens
    from ..engine.sampler import device_picks

    replay_restores(kvc, plan.restores, host)
    if plan.paged and not model.ops.paged_attention:
        raise RuntimeError("rank 0 ran the batched paged attention but this worker's op set has no attention ops")
    step = _step(plan, kvc, device)
    ids = torch.tensor(plan.token_ids, dtype=torch.long, device=device)
    if plan.fill:
        if picks is None:
            raise RuntimeError("rank 0 filled token ids from the previous step's greedy picks, but that step "
                               "kept none on this worker")
        fill_tokens(ids, picks, plan.fill)
    rows = None if plan.logits_rows is None else torch.tensor(plan.logits_rows, dtype=torch.long, device=device)
    if plan.graph:
        if graphs is None or not plan.paged:
            raise RuntimeError("rank 0 replayed a decode CUDA graph but this worker captured none")
        logits = graphs.run(SimpleNamespace(step=step, token_ids=ids), bucket=plan.bucket)  # advances the views
    else:
        logits = model.forward(ids, step, logits_rows=rows).logits
    # rank 0's picks of the same all-gathered logits with the same op (overlap.launch)
    return device_picks(logits, model.ops.greedy_pick)[0] if plan.keep_picks else None


def _step(plan: StepPlan, kvc, device) -> Step:
    """The plan's step over this rank's cache: its chunks through views of rank 0's allocations, and
    the page tables of them when rank 0's step had them."""
    chunks, allocs = [], []
    for c in plan.chunks:
        a = c.allocation()
        allocs.append(a)
        chunks.append(SeqChunk(PagedSequenceView(kvc, a), c.start, c.length))
    return PagedStep.build(kvc, chunks, allocs) if plan.paged else Step.of(chunks, device)


def plan_mtp(token_ids: torch.Tensor, streams: torch.Tensor, step: Step, m: int, logits_rows) -> StepPlan:
    """An MTP pass of speculative drafting (``ReferenceModel.mtp_forward``): its input streams are
    broadcast by rank 0 after the plan (they are the previous pass's outputs or rows of the target's,
    the same on every rank, but only rank 0 knows which rows the proposer took)."""
    plan = plan_step(token_ids, step.chunks, logits_rows, [], isinstance(step, PagedStep))
    plan.kind, plan.mtp = "mtp", m
    plan.streams = (tuple(streams.shape), str(streams.dtype).removeprefix("torch."))
    return plan


@torch.no_grad()
def run_mtp(plan: StepPlan, model, kvc, device, tp) -> None:
    """A worker's share of an MTP pass: the streams from rank 0, then the layer over this rank's
    shard and cache (its window KV written as on rank 0; the logits are rank 0's business)."""
    step = _step(plan, kvc, device)
    shape, dtype = plan.streams
    streams = tp.broadcast(torch.empty(shape, dtype=getattr(torch, dtype), device=device))
    ids = torch.tensor(plan.token_ids, dtype=torch.long, device=device)
    rows = None if plan.logits_rows is None else torch.tensor(plan.logits_rows, dtype=torch.long, device=device)
    model.mtp_forward(ids, streams, step, plan.mtp, logits_rows=rows)
