"""Model runner: turn a step's schedule into one batched forward and hand back logits per request.

The batch (token ids, which rows need logits, and the attention's metadata: per-request chunks
with their cache views, positions and, for the batched attention, the page tables —
``dsv4.model.step``) is built once per step; the model is called through the :class:`ModelBackend`
interface, so a GPU backend replaces the torch reference without touching the scheduler.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..cache.manager import KVCacheManager
from ..model.cache import advance_all
from ..model.step import PagedStep, SeqChunk, Step
from .scheduler import ScheduledChunk
from .staging import HostStaging


class ModelBackend(Protocol):
    cfg: object
    device: torch.device

    def forward(self, token_ids: torch.Tensor, step: Step, logits_rows: torch.Tensor | None = None): ...


@dataclass
class HostInputs:
    """A step's token ids and logits rows as built on the host, for an executor that ships the step
    to other processes without reading the device tensors (which would wait for the step before).
    ``token_ids`` holds ``request.PENDING`` where a pending token is filled on the device."""
    token_ids: array.array
    logits_rows: array.array
    # async scheduling: (token-id row, picks row) filled from the previous deferred step's greedy picks
    fill: list[tuple[int, int]] = field(default_factory=list)
    deferred: bool = False  # this step's greedy picks stay on the device for the next step


@dataclass
class StepBatch:
    token_ids: torch.Tensor  # [T]
    step: Step  # the attention's metadata: the chunks (schedule order) and, batched, the page tables
    logits_rows: torch.Tensor  # rows of the batch whose logits are needed
    graph_staged: bool = False  # the inputs were copied straight into a decode graph's static tensors
    # who owns each logits row, grouped once in ``build`` so the engine does not scan rows per request:
    sample_rows: list[tuple[int, int]] = field(default_factory=list)  # (logits row, schedule index)
    prompt_rows: dict[int, list[int]] = field(default_factory=dict)  # schedule index → its prompt rows
    prompt_logprob_seqs: list[int] = field(default_factory=list)  # schedule indices asking prompt logprobs
    # speculative decoding: schedule index → drafts in its chunk (their rows follow its sample row);
    # those chunks' caches advance only once verification says by how much (``commit``)
    draft_counts: dict[int, int] = field(default_factory=dict)
    # the proposer's input, when the runner keeps it: the forward's pre-hc_head streams [T, hc, H], or
    # with ``aux_layers`` those layers' stream means, concatenated [T, n·H]
    streams: torch.Tensor | None = None
    host: HostInputs | None = None  # the inputs as built on the host (``HostInputs``)


class ModelRunner:
    def __init__(self, backend: ModelBackend, kv: KVCacheManager, paged_attention: bool = False,
                 keep_streams: bool = False, aux_layers: tuple[int, ...] = (), host_inputs: bool = False):
        """``paged_attention``: each step is a ``PagedStep``, for the model's batched attention
        (``dsv4.model.paged_attention``); False keeps the reference's per-request attention.
        ``keep_streams``: each batch keeps the forward's pre-hc_head streams (a proposer's input),
        or with ``aux_layers`` the stream means of those layers' outputs (DSpark's input).
        ``host_inputs``: the backend's forward takes the step's ``HostInputs`` (``host=``: a
        multi-process executor's model, ``Executor.takes_host_inputs``)."""
        self.backend, self.kv, self.host_inputs = backend, kv, host_inputs
        self.keep_streams = keep_streams or bool(aux_layers)
        self.aux_layers = tuple(aux_layers)
        self.device = backend.device
        self.paged_attention = paged_attention
        self.graphs = None  # DecodeGraphs, when the engine captured CUDA graphs of the decode forward
        self.staging = HostStaging(self.device)

    def build(self, schedule: list[ScheduledChunk]) -> StepBatch:
        """The step's inputs: built on the host, then moved to the device in one copy (``staging``)."""
        ids, rows = array.array("q"), array.array("q")
        chunks = []
        sample_rows, prompt_rows, plp, draft_counts = [], {}, [], {}
        off = 0
        view, dev = self.kv.view, self.device
        for si, sc in enumerate(schedule):
            req, n = sc.req, sc.num_tokens
            alloc = req.alloc
            start = alloc.num_computed
            end = start + n
            real = min(end, req.num_tokens)
            ids.extend(req.token_slice(start, real))
            d = end - real  # drafts after the request's last token (the scheduler kept n of them)
            if d:
                ids.extend(req.drafts.tokens[:d])
                draft_counts[si] = d
            chunks.append(SeqChunk(view(alloc), start, n, off, dev))
            if req.params.prompt_logprobs is not None:
                plp.append(si)
                n_prompt = len(req.prompt_token_ids)
                if start < n_prompt - 1:
                    last = min(end, n_prompt - 1)
                    prompt_rows[si] = list(range(len(rows), len(rows) + last - start))
                    rows.extend(range(off, off + last - start))
            if real == req.num_tokens:  # the chunk reaches the end: sample the next token (verify the drafts)
                sample_rows.append((len(rows), si))
                rows.extend(range(off + n - 1 - d, off + n))
            off += n
        rowmaps = {"sample_rows": sample_rows, "prompt_rows": prompt_rows, "prompt_logprob_seqs": plp,
                   "draft_counts": draft_counts, "host": HostInputs(ids, rows)}
        parts = [(ids, (len(ids),)), (rows, (len(rows),))]
        if not self.paged_attention:
            token_ids, logits_rows = self.staging.upload(parts)
            return StepBatch(token_ids, Step.of(chunks, dev), logits_rows, **rowmaps)
        allocs = [sc.req.alloc for sc in schedule]
        staged = self._stage_for_graph(chunks, allocs, ids, len(rows), off)
        if staged is not None:
            step, token_ids = staged
            return StepBatch(token_ids, step, step.seq_ids, graph_staged=True, **rowmaps)  # seq_ids: 0..n-1
        step, (token_ids, logits_rows) = PagedStep.stage(self.kv.kvc, chunks, allocs, self.staging.upload, parts)
        return StepBatch(token_ids, step, logits_rows, **rowmaps)

    def _stage_for_graph(self, chunks, allocs, ids, n_rows: int, n_tokens: int):
        """A decode step that a captured graph will run: (its step, its token ids), staged straight
        into the graph's static buffer (``PagedStep.stage_decode``); else None."""
        target = getattr(self.graphs, "staging_target", None)
        if target is None or n_tokens != len(chunks) or n_rows != len(chunks):
            return None  # not a decode step of one sampled row per request
        found = target(len(chunks), max(c.start + 1 for c in chunks))
        if found is None:
            return None
        b, buf, n_swa, n_blk = found
        return PagedStep.stage_decode(self.kv.kvc, chunks, allocs, self.staging.upload, ids, b, n_swa, n_blk, buf)

    def run(self, schedule: list[ScheduledChunk]) -> tuple[StepBatch, torch.Tensor]:
        """The step's batch and its logits rows [rows, V], left on the model's device in its dtype
        (the engine copies to the host only the rows it must)."""
        batch = self.build(schedule)
        return batch, self.execute(batch)

    @torch.no_grad()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """One forward of a built batch (a captured decode graph where one takes it): its logits rows.
        Chunks with drafts are not advanced (``commit`` does, after verification); the others are."""
        # the step reads blocks restored from the host tier and may rewrite pages an offload reads:
        # its compute waits for the copies queued while it was scheduled
        self.kv.wait_copies()
        if self.graphs is not None and not self.keep_streams and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        extra = {}
        if self.aux_layers:
            extra["aux_layers"] = self.aux_layers
        if self.host_inputs:
            extra["host"] = batch.host
        if batch.draft_counts:
            extra["advance"] = False
        out = self.backend.forward(batch.token_ids, batch.step, logits_rows=batch.logits_rows, **extra)
        if batch.draft_counts:
            chunks = batch.step.chunks
            advance_all((c.cache, c.length) for si, c in enumerate(chunks) if si not in batch.draft_counts)
        if self.keep_streams:
            batch.streams = out.aux if self.aux_layers else out.streams
        return out.logits

    @staticmethod
    def commit(batch: StepBatch, kept: dict[int, int]) -> None:
        """Verified chunks keep their first tokens (schedule index → its last token and the accepted
        drafts), committed together."""
        advance_all((batch.step.chunks[si].cache, n) for si, n in kept.items())
