"""CUDA graphs of a greedy MTP speculative step: verify, acceptance and the draft chain in one replay.

A step of B requests, each with its last token and up to k drafts, replays the graph of the
smallest bucket ≥ B. Inside, at fixed shapes:

1. the target forward over B·(k + 1) rows: each request a chunk of k + 1 tokens (drafts padded;
   ``n_drafts`` says how many count) whose compressors pool from a closing table listing every
   token and then store every row into the rings (``model.paged_attention``);
2. each row's first-argmax pick (the ``greedy_pick`` op) and each request's accepted count: its
   leading drafts equal to the picks of the rows before them, at most ``n_drafts``;
3. the MTP layer over all rows — row j's next token is the pick at j, which up to the accepted
   count is the verified token — with logits at each request's last kept row: draft 1;
4. k − 1 more MTP passes of one row per request at the positions after it, each from the layer's
   own streams and the previous draft, their window pages looked up on the device from the
   accepted counts.

The host copies back the picks, their finite flags, the accepted counts and the drafts once per
step, appends the verified tokens with the same walk as the eager path
(``speculative.verify_picks``) and advances the caches. Rows past a request's accepted count leave
writes past its new token count (window KV, compressed entries, ring rows: the rings are sized for
them, ``cache.paged.ring_rows``), which nothing reads before the position is computed again; the
MTP layer's window at those positions is rewritten by the next step's pass 3 before any read, as
in the eager proposer. Lanes past B are spare (positions 0 .., the spare page, block and slot).
The eager path (``speculative.MTPProposer``) keeps every other step: prefills, sampled or
structured requests, logprobs.
"""

from __future__ import annotations

import array
import logging
import math
import time

import torch

from ..cache.tables import StepTables, split, verify_tables
from ..model.attention import SeqChunk
from ..model.cache import SWA_PAGE
from .cuda_graphs import buckets_for
from .sampler import device_picks
from .staging import HostStaging

log = logging.getLogger("dsv4.engine")

# verify rows of the largest captured bucket (B·(k + 1)): below the sparse attention's PREDECODE_MIN_T,
# whose keys-decoded-once path sizes its buffers on the host; larger steps run eagerly
MAX_GRAPH_TOKENS = 256


class SpecGraphs:
    """Captured greedy MTP steps for ``k`` drafts; ``run`` replays one and returns its results."""

    def __init__(self, model, kvc, k: int, max_num_seqs: int, max_model_len: int, pick=None,
                 max_tokens: int = MAX_GRAPH_TOKENS):
        if k < 1:
            raise ValueError(f"speculative graphs need at least one draft token, got k={k}")
        self.model, self.kvc, self.k, self.pick = model, kvc, k, pick
        self.max_model_len = max_model_len
        self.n_swa = -(-max_model_len // SWA_PAGE)
        self.n_blk = -(-max_model_len // 256)
        self.buckets = [b for b in buckets_for(max_num_seqs) if b * (k + 1) <= max_tokens] or [1]
        self.graphs: dict[int, tuple] = {}  # bucket → (graph or None, its result tensor or its inputs)
        self.inputs: dict[int, torch.Tensor] = {}  # bucket → its static int64 inputs, one buffer
        self.staging = HostStaging(kvc.device)
        self.capture_seconds = 0.0
        self.replays = 0  # steps run by a graph (emulated ones on the CPU too)

    def shapes(self, b: int) -> list[tuple[int, ...]]:
        """Bucket ``b``'s static inputs in their buffer: token ids, ``verify_tables``' parts, n_drafts."""
        t = b * (self.k + 1)
        return [(t,)] * 5 + [(b,), (b, self.n_swa), (b, self.n_blk), (4, t), (b,)]

    def _static(self, b: int):
        """Bucket ``b``'s static inputs, every lane spare: (buffer, ids, tables, n_drafts)."""
        kvc, shapes = self.kvc, self.shapes(b)
        flat = torch.zeros(sum(math.prod(s) for s in shapes), dtype=torch.long, device=kvc.device)
        parts = verify_tables([], [], b, self.k + 1, self.n_swa, self.n_blk, kvc)
        ids, *tables, n_drafts = split(flat, [(range(math.prod(s)), s) for s in shapes])
        for dst, (src, _) in zip(tables, parts):
            dst.copy_(torch.tensor(src, dtype=torch.long).view(dst.shape))
        positions, seq_ids, swa_page, swa_off, slots, swa_table, block_table, closing = tables
        static = StepTables(kvc, [], positions, seq_ids, swa_table, block_table, slots, swa_page, swa_off, False,
                            self.max_model_len, closing)
        return flat, ids, static, n_drafts

    def _body(self, b: int, ids: torch.Tensor, tables: StepTables, n_drafts: torch.Tensor) -> torch.Tensor:
        """The step at fixed shapes: int64 [b, 2(k + 1) + 1 + k] = picks, finite flags, accepted, drafts."""
        k, m, dev = self.k, self.model, ids.device
        per = k + 1
        out = m.forward(ids, [SeqChunk(None, 0, per) for _ in range(b)], tables=tables, advance=False)
        both = device_picks(out.logits, self.pick)  # [2, b·per]
        picks = both[0].view(b, per)
        match = (picks[:, :k] == ids.view(b, per)[:, 1:]) & (torch.arange(k, device=dev) < n_drafts[:, None])
        acc = match.long().cumprod(1).sum(1)
        lanes = torch.arange(b, device=dev)
        last = lanes * per + acc
        mo = m.mtp_forward(both[0], out.streams, [SeqChunk(None, 0, per) for _ in range(b)], logits_rows=last,
                           tables=tables)
        draft = device_picks(mo.logits, self.pick)[0]
        drafts, s = [draft], mo.streams[last]
        start = tables.positions.view(b, per)[:, 0]
        for j in range(1, k):
            pos = start + acc + j
            col = pos // SWA_PAGE
            page = tables.swa_table.gather(1, col.clamp(max=self.n_swa - 1)[:, None])[:, 0]
            page = torch.where(col < self.n_swa, page, -1)
            t = StepTables(self.kvc, [], pos, lanes, tables.swa_table, tables.block_table, tables.slots, page,
                           pos % SWA_PAGE, True, self.max_model_len)
            mo = m.mtp_forward(draft, s, [SeqChunk(None, 0, 1) for _ in range(b)], logits_rows=lanes, tables=t)
            draft = device_picks(mo.logits, self.pick)[0]
            drafts.append(draft)
            s = mo.streams
        return torch.cat([both.view(2, b, per).transpose(0, 1).reshape(b, 2 * per), acc[:, None],
                          torch.stack(drafts, 1)], 1)

    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory pool
            pool = self._capture(b, pool)
        if self.kvc.device.type == "cuda":
            torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured speculative (MTP k=%d) CUDA graphs for batch sizes %s in %.1f s", self.k, self.buckets,
                 self.capture_seconds)

    def forward_once(self) -> None:
        """Every bucket's step, eagerly, nothing captured (what ``engine.precompile`` lists)."""
        for b in reversed(self.buckets):
            _, ids, static, n_drafts = self._static(b)
            self._body(b, ids, static, n_drafts)

    def _capture(self, b: int, pool):
        flat, ids, static, n_drafts = self._static(b)
        self.inputs[b] = flat
        if self.kvc.device.type != "cuda":  # emulation (tests on CPU): the same static inputs, run at replay
            self.graphs[b] = (None, (ids, static, n_drafts))
            return pool
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile every kernel and settle the allocator before capturing
                self._body(b, ids, static, n_drafts)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            res = self._body(b, ids, static, n_drafts)
        self.graphs[b] = (graph, res, (ids, static, n_drafts))  # the inputs stay alive with the graph
        return graph.pool()

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, starts: list[int], allocs, tokens: list[list[int]]) -> list[list[int]] | None:
        """Replay the step of requests whose chunks start at ``starts`` with ``tokens`` (each: its last
        token, then its drafts): per request [picks (k + 1), finite flags (k + 1), accepted, drafts (k)];
        None if no graph takes it (too many requests, a page list wider than the tables)."""
        n, k = len(starts), self.k
        b = self.bucket(n)
        if b is None or b not in self.inputs:
            return None
        tables = verify_tables(starts, allocs, b, k + 1, self.n_swa, self.n_blk, self.kvc)
        if tables is None:
            return None
        ids, nd = [], []
        for t in tokens:
            ids += t + [0] * (k + 1 - len(t))
            nd.append(len(t) - 1)
        ids += [0] * ((b - n) * (k + 1))
        nd += [0] * (b - n)
        self.staging.upload([(array.array("q", ids), (b * (k + 1),))] + tables + [(array.array("q", nd), (b,))],
                            into=self.inputs[b])
        self.replays += 1
        graph, *rest = self.graphs[b]
        if graph is None:
            ids_t, static, n_drafts = rest[0]
            res = self._body(b, ids_t, static, n_drafts)
        else:
            graph.replay()
            res = rest[0]
        return res[:n].tolist()

    def release(self) -> None:
        for graph, *_ in self.graphs.values():
            if graph is not None:
                graph.reset()
        self.graphs.clear()
        self.inputs.clear()
        self.buckets = []
