"""CUDA graphs of the decode forward, one per batch-size bucket up to ``max_num_seqs``.

A decode step of B requests replays the graph of the smallest bucket ≥ B. Everything
data-dependent is computed outside the graph, on the host, before the replay: the page tables,
positions and slots are copied into the graph's static tensors, and the lanes past B are
*spare lanes* — position 0, every table entry pointing at the spare page/block/slot that each
cache tensor has past its last real one — so whatever they compute and write never touches a
request's pages. Inside the graph every shape is fixed: the compressed-entry lists have the width
``max_model_len`` implies and the ops bound their loops by each token's own counts. After the
replay the caches' host bookkeeping (``advance``: token counts, boundary rows of closed blocks)
runs eagerly. A bucket's static int64 inputs (token ids, positions, tables) live in one buffer,
so the runner stages a step's inputs straight into them with its one host→device copy.

Batch invariance makes the spare lanes harmless for the real ones: every op computes a row
without looking at the others (``dsv4.ops.invariance``).
"""

from __future__ import annotations

import logging
import math
import time

import torch

from ..model.step import PagedStep, decode_shapes, split, table_widths

log = logging.getLogger("dsv4.engine")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def buckets_for(max_num_seqs: int) -> list[int]:
    return [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]


def capture_buckets(buckets: list[int], capture_one) -> float:
    """``capture_one(b, pool) → pool`` for every bucket, largest first (the smaller ones reuse its
    memory pool); returns the seconds it took."""
    t0 = time.perf_counter()
    pool = None
    for b in reversed(buckets):
        pool = capture_one(b, pool)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def record(run, pool):
    """(a CUDA graph of ``run()``, its output): run twice on a side stream first (every kernel compiled,
    the allocator settled), then captured into ``pool``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


class DecodeGraphs:
    """Captured decode forwards; ``run(batch)`` replays the right one and returns its logits."""

    def __init__(self, model, kvc, max_num_seqs: int, max_model_len: int):
        self.model, self.kvc = model, kvc
        self.max_model_len = max_model_len
        self.n_swa, self.n_blk = table_widths(max_model_len)
        self.buckets = buckets_for(max_num_seqs)
        self.graphs: dict[int, tuple] = {}
        self._keep: dict[int, tuple] = {}  # the graphs' other inputs, kept alive
        self.inputs: dict[int, torch.Tensor] = {}  # bucket → its static int64 inputs, one buffer
        self.capture_seconds = 0.0

    def capture(self) -> None:
        self.capture_seconds = capture_buckets(self.buckets, self._capture)
        log.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.buckets, self.capture_seconds)

    def shapes(self, b: int) -> list[tuple[int, ...]]:
        """The static int64 inputs of bucket ``b`` as laid out in its one buffer: the token ids,
        then a decode step's tables (``model.step.decode_tables``)."""
        return [(b,)] + decode_shapes(b, self.n_swa, self.n_blk)

    def _static(self, b: int):
        """Bucket ``b``'s static inputs, every lane spare: (flat buffer, token ids, step, logits rows)."""
        kvc, dev = self.kvc, self.kvc.device
        shapes = self.shapes(b)
        flat = torch.zeros(sum(math.prod(s) for s in shapes), dtype=torch.long, device=dev)
        ids, *tables = split(flat, [(range(math.prod(s)), s) for s in shapes])
        return flat, ids, PagedStep.spare(kvc, tables, self.max_model_len), torch.arange(b, device=dev)

    def forward_once(self) -> None:
        """Every bucket's forward, eagerly, nothing captured: the launches a capture makes (what
        ``engine.precompile`` lists before building them in parallel)."""
        for b in reversed(self.buckets):
            _, ids, static, rows = self._static(b)
            self.model.forward(ids, static, logits_rows=rows, advance=False)

    def _capture(self, b: int, pool):
        dev = self.kvc.device
        flat, ids, static, rows = self._static(b)
        self.inputs[b] = flat
        if dev.type != "cuda":  # emulation (tests on CPU): the same static inputs, run eagerly at replay
            self.graphs[b] = (None, static, ids, rows)
            return pool
        graph, out = record(lambda: self.model.forward(ids, static, logits_rows=rows, advance=False), pool)
        # every tensor the graph reads must stay alive with it: a freed input's memory gets reused
        # and the replay would read whatever lives there then (rows did: duplicated logits rows)
        self.graphs[b] = (graph, static, ids, out.logits)
        self._keep[b] = rows
        return graph.pool()

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def staging_target(self, n: int, max_end: int):
        """(bucket, its static input buffer, table widths) for a decode step of ``n`` requests
        whose tokens end by ``max_end``, or None if no graph takes it: the runner then stages the
        step's inputs straight into the graph's tensors (``PagedStep.stage_decode``)."""
        b = self.bucket(n)
        if b is None or max_end > self.max_model_len or b not in self.inputs:
            return None
        return b, self.inputs[b], self.n_swa, self.n_blk

    def release(self) -> None:
        """Reset every captured graph now. Graphs holding NCCL launches keep the communicator busy:
        destroying the process group while one lives hangs in ncclCommDestroy (pytorch#115388)."""
        for graph, *_ in self.graphs.values():
            if graph is not None:
                graph.reset()
        self.graphs.clear()
        self._keep.clear()
        self.inputs.clear()
        self.buckets = []

    def can_run(self, batch) -> bool:
        p = batch.step
        return (isinstance(p, PagedStep) and p.decode_only and self.bucket(len(p.chunks)) is not None
                and batch.logits_rows.numel() == len(p.chunks)  # one sampled row per request
                and p.max_end <= self.max_model_len)

    def run(self, batch, bucket: int | None = None) -> torch.Tensor:
        """Replay the graph of the batch's bucket (or of ``bucket``, a larger one: data-parallel
        ranks replay the bucket they agreed on) and advance the requests' caches; the logits rows."""
        n = len(batch.step.chunks)
        own = self.bucket(n)
        b = own if bucket is None else bucket
        if b < n:
            raise ValueError(f"a decode step of {n} requests cannot replay the graph of bucket {b}")
        graph, static, ids, logits = self.graphs[b]
        if not (getattr(batch, "graph_staged", False) and b == own):  # else the step's copy put them there
            static.load(batch.step)
            ids.zero_()
            ids[:n].copy_(batch.token_ids)
        if graph is None:  # (emulated: ``logits`` holds the logits rows)
            logits = self.model.forward(ids, static, logits_rows=logits, advance=False).logits
        else:
            graph.replay()
        for c in batch.step.chunks:
            c.cache.advance(c.length)
        return logits[:n]

    def replay_spare(self, b: int) -> None:
        """Bucket ``b``'s graph with every lane spare: what a data-parallel rank without requests
        replays while the others replay theirs (the collectives inside pair up); it writes only the
        spare pages."""
        graph, static, ids, logits = self.graphs[b]
        static.load(None)
        ids.zero_()
        if graph is None:
            self.model.forward(ids, static, logits_rows=logits, advance=False)
        else:
            graph.replay()
