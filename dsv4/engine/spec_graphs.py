"""CUDA graphs of a greedy speculative step (MTP or DSpark): verify, acceptance and the drafts in one replay.

A step of B requests, each with its last token and up to k drafts, replays the graph of the
smallest bucket ≥ B. Inside, at fixed shapes:

1. the target forward over B·(k + 1) rows: each request a chunk of k + 1 tokens (drafts padded;
   ``n_drafts`` says how many count) whose compressors pool from a closing table listing every
   token and then store every row into the rings (``model.paged_attention``);
2. each row's first-argmax pick (the ``greedy_pick`` op) and each request's accepted count: its
   leading drafts equal to the picks of the rows before them, at most ``n_drafts``;
3. the drafts of the next step —
   MTP: the MTP layer over all rows (row j's next token is the pick at j, which up to the accepted
   count is the verified token) with logits at each request's last kept row: draft 1; then k − 1
   more passes of one row per request at the positions after it, each from the layer's own
   streams and the previous draft, their window pages looked up on the device;
   DSpark: every row's context KV into the stages' windows (from the target layers' stream means),
   then one block pass of ``[bonus pick, noise × (k − 1)]`` per request at the positions after its
   kept tokens, each row's logits plus the Markov bias of the token before it picked in turn; with
   the confidence head, the drafts end before the first whose confidence is below the cut;
4. the next step's inputs written over this step's: each chunk moved past its kept tokens, its
   tokens the pick after them and the new drafts, ``n_drafts`` what the request's max_tokens (and
   the confidence cut) leaves.

So a graph can be replayed again before the host has read the step before (async scheduling):
the host then stages only the page tables (``continue_step``; pages are taken ahead for it). The
host copies back the picks, their finite flags, the accepted counts, the drafts (and their
confidences) once per step, appends the verified tokens with the same walk as the eager path
(``speculative.verify_picks``) and advances the caches. Rows past a request's accepted count leave
writes past its new token count (window KV, compressed entries, ring rows: the rings are sized for
them, ``model.step.ring_rows``), which nothing reads before the position is computed again; the
drafter's windows at those positions are rewritten by the next step's pass before any read, as in
the eager proposers. Lanes past B are spare (positions 0 .., the spare page, block and slot). The
step's other requests — prefills, sampled or structured ones, logprobs — take the eager path
(``speculative.MTPProposer`` / ``DSparkProposer``) beside the replay.
"""

from __future__ import annotations

import array
import logging
import math
import struct
from dataclasses import dataclass, field

import torch

from ..model.step import PagedStep, SeqChunk, request_rows, split, table_widths, window_slots
from .cuda_graphs import buckets_for, capture_buckets, record
from .sampler import device_dists, device_picks, inverse_cdf
from .staging import HostStaging

log = logging.getLogger("dsv4.engine")

# verify rows of the largest captured bucket (B·(k + 1)): below the sparse attention's PREDECODE_MIN_T,
# whose keys-decoded-once path sizes its buffers on the host; larger steps run eagerly
MAX_GRAPH_TOKENS = 256


@dataclass
class Launched:
    """A replayed step whose results are on their way to the host: ``rows()`` waits for them."""

    schedule: list  # the engine's ScheduledChunks, in lane order
    host: torch.Tensor  # int64 [n, 2(k + 1) + 1 + k (+ k)], filled by the copy behind ``done``
    done: object  # torch.cuda.Event, or None (emulated: already there)
    after: "Launched | None" = None  # the step this one continued from (``continue_step``)
    # request ids whose host state, once this step was read, is the one the graph's next inputs assume
    consistent: set = field(default_factory=set)
    probs: torch.Tensor | None = None  # sampled steps: the new drafts' distributions [n, k, V] (device)

    @property
    def sampled(self) -> bool:
        """Whether the step ran the sampled graph (a continuation must run the same one)."""
        return self.probs is not None

    def rows(self) -> list[list[int]]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


@dataclass
class Sampling:
    """A sampled request's part of a step: (temperature, top_k, top_p, min_p), the uniforms its
    rejection rule and draws use (``SpecGraphs.uniforms`` of them, from its generator) and its
    drafts' distributions (host or device rows [V], one per draft)."""

    settings: tuple[float, float, float, float]
    uniforms: list[float]
    probs: list[torch.Tensor]


def accept_drafts(u: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """The rejection rule's test, on the device: keep a draft drawn from q with probability
    min(1, p/q) (``speculative._judge``'s comparison, for all drafts at once)."""
    return u * q_draft <= p_draft


class SpecGraphs:
    """Captured speculative steps for ``k`` drafts; ``launch`` / ``continue_step`` replay one.

    ``method``: "mtp" or "dspark" (``min_confidence``: DSpark's confidence cut). Each bucket has a
    greedy graph and, with ``sampled``, one that also samples (``Sampling``): its lanes with a
    temperature draw their drafts, judge them by the rejection rule and draw the replacement or
    bonus token on the device, from uniforms the host drew from each request's generator."""

    def __init__(self, model, kvc, k: int, max_num_seqs: int, max_model_len: int, pick=None,
                 max_tokens: int = MAX_GRAPH_TOKENS, method: str = "mtp", min_confidence: float = 0.0,
                 sampled: bool = True):
        if k < 1:
            raise ValueError(f"speculative graphs need at least one draft token, got k={k}")
        if method not in ("mtp", "dspark") or (method == "dspark") != (model.dspark is not None):
            raise ValueError(f"speculative graphs: method {method!r} does not match the model "
                             f"({'DSpark stages' if model.dspark is not None else 'no DSpark stages'})")
        self.model, self.kvc, self.k, self.pick = model, kvc, k, pick
        self.dspark = model.dspark if method == "dspark" else None
        self.min_confidence = min_confidence
        self.sampled = sampled
        # the drafts' confidences travel back beside them (as the bits of float64 values)
        self.confidences = self.dspark is not None and self.dspark.has_confidence
        # positions past a request's computed tokens a step writes: the verify chunk (k + 1), then
        # MTP's chain up to k − 1 past the kept ones, DSpark's block of k
        self.reach = 2 * k + (self.dspark is not None)
        self.uniforms = 2 * k + 1  # per sampled request and step: k tests, the replacement or bonus, k drafts
        self.max_model_len = max_model_len
        self.n_swa, self.n_blk = table_widths(max_model_len)
        self.buckets = [b for b in buckets_for(max_num_seqs) if b * (k + 1) <= max_tokens] or [1]
        # (bucket, sampled) → (graph or None, result tensor or None, static inputs)
        self.graphs: dict[tuple[int, bool], tuple] = {}
        self.inputs: dict[int, torch.Tensor] = {}  # bucket → its static int64 inputs, one buffer
        self.q: dict[int, torch.Tensor] = {}  # bucket → the drafts' distributions [b, k, V] fp32 (sampled)
        self.staging = HostStaging(kvc.device)
        self.capture_seconds = 0.0
        self.replays = 0  # steps run by a graph (emulated ones on the CPU too)
        self.continued = 0  # of which launched from the graph's own next inputs

    def shapes(self, b: int) -> list[tuple[int, ...]]:
        """Bucket ``b``'s static inputs in their buffer: first what a continued step stages —
        ``request_rows``' parts (slots, window and block tables) and the sampled lanes' uniforms —
        then token ids, positions, n_drafts, the tokens each request may still produce (its
        max_tokens left) and the sampling settings (uniforms and settings: float64 bits)."""
        t = b * (self.k + 1)
        return [(b,), (b, self.n_swa), (b, self.n_blk), (b, self.uniforms), (t,), (t,), (b,), (b,), (b, 4)]

    def _staged_len(self, b: int) -> int:
        return sum(math.prod(s) for s in self.shapes(b)[:4])

    def _static(self, b: int):
        """Bucket ``b``'s static inputs, every lane spare: (buffer, its tensors)."""
        kvc, shapes, per = self.kvc, self.shapes(b), self.k + 1
        flat = torch.zeros(sum(math.prod(s) for s in shapes), dtype=torch.long, device=kvc.device)
        views = split(flat, [(range(math.prod(s)), s) for s in shapes])
        for dst, (src, _) in zip(views, request_rows([], b, self.n_swa, self.n_blk, kvc)):
            dst.copy_(torch.tensor(src, dtype=torch.long).view(dst.shape))
        views[5].copy_(torch.arange(per).repeat(b))  # spare lanes: positions 0 .. k
        return flat, views

    def _body(self, b: int, st: list[torch.Tensor], sampled: bool) -> torch.Tensor:
        """The step at fixed shapes (see the module docstring): int64 [b, 2(k + 1) + 1 + k (+ k)] =
        each row's token (a greedy lane's pick; a sampled lane's draft where kept, then the
        replacement or bonus), finite flags, accepted counts, drafts (and their confidences' float64
        bits); the next step's inputs are written over ``st``'s."""
        slots, swa_table, block_table, uni, ids, positions, n_drafts, left, settings = st
        uni, settings = uni.view(torch.float64), settings.view(torch.float64)
        k, m, dev = self.k, self.model, ids.device
        per = k + 1
        lanes = torch.arange(b, device=dev)
        seq = lanes.repeat_interleave(per)
        start = positions.view(b, per)[:, 0]
        tok = torch.arange(b * per, device=dev)
        closing = torch.stack([tok, start.repeat_interleave(per), seq * per, seq])
        step = self._step(positions, seq, st, False, static_closing=closing)
        aux = m.cfg.dspark_target_layer_ids if self.dspark is not None else ()
        out = m.forward(ids, step, advance=False, aux_layers=aux)
        both = device_picks(out.logits, self.pick)  # [2, b·per]
        picks = both[0].view(b, per)
        drafted = ids.view(b, per)[:, 1:]
        within = torch.arange(k, device=dev) < n_drafts[:, None]
        if not sampled:
            acc = ((picks[:, :k] == drafted) & within).long().cumprod(1).sum(1)
            tokens, nxt = picks, picks.gather(1, acc[:, None])[:, 0]
        else:
            acc, tokens, nxt = self._judge(b, out.logits, picks, drafted, within, n_drafts, uni, settings)
        draw = self._drawer(b, sampled, uni, settings)
        if self.dspark is not None:
            drafts, extra, n_ok = self._dspark_drafts(b, out.aux, step, nxt, acc, start, st, draw)
        else:
            drafts, extra, n_ok = self._mtp_drafts(b, out, step, tokens.reshape(-1), acc, start, st, draw), None, None
        parts = [tokens, both[1].view(b, per), acc[:, None], drafts]
        res = torch.cat(parts + ([extra] if extra is not None else []), 1)
        # the next step's inputs: the chunk after the kept tokens, its bonus token and the new drafts
        # (a spare lane, ``left`` 0, stays where it is)
        left_next = (left - acc - 1).clamp(min=0)
        positions.add_(((acc + 1) * (left > 0)).repeat_interleave(per))
        ids.copy_(torch.cat([nxt[:, None], drafts], 1).view(-1))
        nd = (left_next - 1).clamp(0, k)
        n_drafts.copy_(nd if n_ok is None else torch.minimum(nd, n_ok))
        left.copy_(left_next)
        return res

    def _judge(self, b: int, logits: torch.Tensor, picks: torch.Tensor, drafted: torch.Tensor, within: torch.Tensor,
               n_drafts: torch.Tensor, uni: torch.Tensor, settings: torch.Tensor):
        """(accepted counts [b], each row's token [b, k + 1], the token after the kept drafts [b]):
        greedy lanes by their picks; sampled lanes by the rejection rule against their drafts'
        distributions (``self.q``), the replacement drawn from the normalized max(0, p − q) at the
        first rejected draft, or the bonus from p after the last."""
        k, per = self.k, self.k + 1
        lanes = torch.arange(b, device=picks.device)
        sampling = settings[:, 0] > 0
        p = device_dists(logits, settings.repeat_interleave(per, 0)).view(b, per, -1)
        q = self.q[b]
        ok = torch.where(sampling[:, None],
                         accept_drafts(uni[:, :k], p[:, :k].gather(2, drafted[..., None])[..., 0],
                                       q.gather(2, drafted[..., None])[..., 0]),
                         picks[:, :k] == drafted)
        acc = (ok & within).long().cumprod(1).sum(1)
        p_acc = p[lanes, acc]
        r = (p_acc - q[lanes, acc.clamp(max=k - 1)] * (acc < n_drafts)[:, None]).clamp(min=0)
        r = torch.where(r.sum(-1, keepdim=True) > 0, r, p_acc)  # p = q: the draft would have been kept
        nxt = torch.where(sampling, inverse_cdf(r, uni[:, k]), picks.gather(1, acc[:, None])[:, 0])
        j = torch.arange(per, device=picks.device)
        kept = torch.cat([drafted, nxt[:, None]], 1)  # row j < acc: its draft, kept
        mine = torch.where(j < acc[:, None], kept, torch.where(j == acc[:, None], nxt[:, None], picks))
        return acc, torch.where(sampling[:, None], mine, picks), nxt

    def _drawer(self, b: int, sampled: bool, uni: torch.Tensor, settings: torch.Tensor):
        """``draw(logits [b, V], i)`` → draft i of every lane: the first argmax, or (a sampled lane)
        a draw from its distribution, kept in ``self.q`` for the next step's rejection rule."""
        k = self.k

        def draw(logits: torch.Tensor, i: int) -> torch.Tensor:
            g = device_picks(logits, self.pick)[0]
            if not sampled:
                return g
            q = device_dists(logits, settings)
            self.q[b][:, i].copy_(q)  # (this step's rule has read the row already)
            return torch.where(settings[:, 0] > 0, inverse_cdf(q, uni[:, k + 1 + i]), g)

        return draw

    def _mtp_drafts(self, b: int, out, step: PagedStep, tokens: torch.Tensor, acc: torch.Tensor,
                    start: torch.Tensor, st: list[torch.Tensor], draw) -> torch.Tensor:
        """[b, k] drafts: the MTP layer over every verify row (row j's next token: ``tokens`` at j),
        then k − 1 passes of one row each."""
        k, m, per = self.k, self.model, self.k + 1
        lanes = torch.arange(b, device=tokens.device)
        last = lanes * per + acc
        mo = m.mtp_forward(tokens, out.streams, step, logits_rows=last)
        draft = draw(mo.logits, 0)
        drafts, s = [draft], mo.streams[last]
        for j in range(1, k):
            mo = m.mtp_forward(draft, s, self._step(start + acc + j, lanes, st, True), logits_rows=lanes)
            draft = draw(mo.logits, j)
            drafts.append(draft)
            s = mo.streams
        return torch.stack(drafts, 1)

    def _dspark_drafts(self, b: int, aux: torch.Tensor, step: PagedStep, anchor: torch.Tensor, acc: torch.Tensor,
                       start: torch.Tensor, st: list[torch.Tensor], draw):
        """([b, k] drafts, their confidences' float64 bits [b, k] and the confident drafts per request
        [b], or None and None): every verify row's context KV, then one block pass per request from
        its ``anchor`` (the token after the kept ones)."""
        k, m, d, dev = self.k, self.model, self.dspark, anchor.device
        lanes = torch.arange(b, device=dev)
        m.dspark_context(aux, step)
        ids = torch.cat([anchor[:, None], anchor.new_full((b, k - 1), d.noise_token_id)], 1).view(-1)
        pos = ((start + acc + 1)[:, None] + torch.arange(k, device=dev)).view(-1)
        block = self._step(pos, lanes.repeat_interleave(k), st, False, [SeqChunk(None, 0, k) for _ in range(b)])
        logits, h = m.dspark_block(ids, block)
        prev, drafts, confs = anchor, [], []
        for i in range(k):
            rows = lanes * k + i
            bias, e = d.markov(prev)
            c = d.confidence(h[rows], e)
            if c is not None:
                confs.append(c)
            prev = draw(logits[rows] + bias, i)
            drafts.append(prev)
        drafts = torch.stack(drafts, 1)
        if not confs:
            return drafts, None, None
        conf = torch.stack(confs, 1).double()  # compared as the eager proposer compares its Python floats
        return drafts, conf.view(torch.int64), (conf >= self.min_confidence).long().cumprod(1).sum(1)

    def read_row(self, row: list[int]):
        """A request's row of the step's results: (tokens, finite flags, accepted count, drafts, their
        confidences or None)."""
        k = self.k
        conf = None
        if self.confidences:
            conf = list(struct.unpack(f"{k}d", struct.pack(f"{k}q", *row[3 * k + 3:])))
        return row[:k + 1], row[k + 1:2 * k + 2], row[2 * k + 2], row[2 * k + 3:3 * k + 3], conf

    def _step(self, positions: torch.Tensor, seq_ids: torch.Tensor, st: list[torch.Tensor], decode_only: bool,
              chunks: list[SeqChunk] = (), static_closing: torch.Tensor | None = None) -> PagedStep:
        """A pass of the graph over the static page tables ``st``, its tokens at ``positions`` of
        the lanes ``seq_ids`` (window pages looked up on the device); ``chunks`` only give a DSpark
        block pass its block length."""
        slots, swa_table, block_table = st[:3]
        swa_page, swa_off = window_slots(swa_table, seq_ids, positions)
        return PagedStep(list(chunks), positions, kvc=self.kvc, seq_ids=seq_ids, swa_table=swa_table,
                         block_table=block_table, slots=slots, swa_page=swa_page, swa_off=swa_off,
                         decode_only=decode_only, max_end=self.max_model_len, static_closing=static_closing)

    def capture(self) -> None:
        self.capture_seconds = capture_buckets(self.buckets, self._capture)
        log.info("captured speculative (%s k=%d%s) CUDA graphs for batch sizes %s in %.1f s",
                 "DSpark" if self.dspark is not None else "MTP", self.k, ", greedy and sampled" if self.sampled else "",
                 self.buckets, self.capture_seconds)

    def _families(self) -> list[bool]:
        return [False, True] if self.sampled else [False]

    def forward_once(self) -> None:
        """Every bucket's step, eagerly, nothing captured (what ``engine.precompile`` lists)."""
        for b in reversed(self.buckets):
            st = self._static(b)[1]
            for sampled in self._families():
                self._alloc_q(b, sampled)
                self._body(b, st, sampled)

    def _alloc_q(self, b: int, sampled: bool) -> None:
        if sampled and b not in self.q:
            self.q[b] = torch.zeros(b, self.k, self.model.cfg.vocab_size, device=self.kvc.device)

    def _capture(self, b: int, pool):
        flat, st = self._static(b)
        self.inputs[b] = flat
        for sampled in self._families():
            self._alloc_q(b, sampled)
            if self.kvc.device.type != "cuda":  # emulation (tests on CPU): the same static inputs, run at replay
                self.graphs[(b, sampled)] = (None, None, st)
                continue
            graph, res = record(lambda: self._body(b, st, sampled), pool)
            self.graphs[(b, sampled)] = (graph, res, st)  # the inputs stay alive with the graph
            pool = graph.pool()
        return pool

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def launch(self, schedule, starts: list[int], tokens: list[list[int]], left: list[int],
               sampling: list[Sampling | None] | None = None) -> Launched | None:
        """Replay the step of the scheduled requests whose chunks start at ``starts`` with ``tokens``
        (each: its last token, then its drafts), ``left`` tokens each may still produce and, for a
        sampled one, its ``Sampling``; None if no graph takes it (too many requests, a page list
        wider than the tables, sampling without the sampled graphs)."""
        n, k = len(schedule), self.k
        b = self.bucket(n)
        sampling = sampling or [None] * n
        sampled = any(x is not None for x in sampling)
        rows = None if b is None or (b, sampled) not in self.graphs else self._rows(schedule, b)
        if rows is None:
            return None
        pad = b - n
        ids = array.array("q", (t for tk in tokens for t in tk + [0] * (k + 1 - len(tk)))) \
            + array.array("q", [0]) * (pad * (k + 1))
        pos = array.array("q", (p for s in starts for p in range(s, s + k + 1))) \
            + array.array("q", range(k + 1)) * pad
        nd = array.array("q", (len(tk) - 1 for tk in tokens)) + array.array("q", [0]) * pad
        lf = array.array("q", left) + array.array("q", [0]) * pad
        settings = _bits([v for x in sampling for v in (x.settings if x is not None else (0.0,) * 4)]
                         + [0.0] * (4 * pad))
        t = b * (k + 1)
        uniforms = [None if x is None else x.uniforms for x in sampling]
        self.staging.upload(rows + [(self._uniform_bits(uniforms, b), (b, self.uniforms)), (ids, (t,)), (pos, (t,)),
                                    (nd, (b,)), (lf, (b,)), (settings, (b, 4))], into=self.inputs[b])
        if sampled:  # the drafts' distributions, for the rule (the eager proposer's, or an earlier step's)
            q = self.q[b]
            for i, x in enumerate(sampling):
                if x is not None and x.probs:
                    q[i, :len(x.probs)].copy_(torch.stack([r.to(q.device) for r in x.probs]), non_blocking=True)
        return self._replay(schedule, b, sampled)

    def continue_step(self, schedule, uniforms: list[list[float] | None] | None = None,
                      sampled: bool = False) -> Launched | None:
        """Replay the step after ``schedule``'s last one (of the ``sampled`` family) from the graph's
        own next inputs (the host has not read that step yet); only the page tables and the sampled
        requests' new ``uniforms`` are staged, the requests' pages must cover the chunks and drafts
        of both steps. None if the graph cannot take it."""
        b = self.bucket(len(schedule))
        rows = None if b is None or (b, sampled) not in self.graphs else self._rows(schedule, b)
        if rows is None:
            return None
        uniforms = uniforms or [None] * len(schedule)
        self.staging.upload(rows + [(self._uniform_bits(uniforms, b), (b, self.uniforms))],
                            into=self.inputs[b][:self._staged_len(b)])
        self.continued += 1
        return self._replay(schedule, b, sampled)

    def _uniform_bits(self, uniforms: list[list[float] | None], b: int) -> array.array:
        u = self.uniforms
        return _bits([v for x in uniforms for v in (x if x is not None else [0.0] * u)]
                     + [0.0] * (u * (b - len(uniforms))))

    def _rows(self, schedule, b: int):
        return request_rows([sc.req.alloc for sc in schedule], b, self.n_swa, self.n_blk, self.kvc)

    def _replay(self, schedule, b: int, sampled: bool) -> Launched:
        self.replays += 1
        graph, res, st = self.graphs[(b, sampled)]
        n = len(schedule)
        if graph is None:
            res = self._body(b, st, sampled)
            return Launched(schedule, res[:n], None, probs=self.q[b][:n].clone() if sampled else None)
        graph.replay()
        probs = self.q[b][:n].clone() if sampled else None  # (the next replay overwrites the buffer)
        host = torch.empty(res[:n].shape, dtype=res.dtype, pin_memory=True)
        host.copy_(res[:n], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Launched(schedule, host, done, probs=probs)

    def release(self) -> None:
        for graph, *_ in self.graphs.values():
            if graph is not None:
                graph.reset()
        self.graphs.clear()
        self.inputs.clear()
        self.q.clear()
        self.buckets = []


def _bits(values: list[float]) -> array.array:
    """float64 values as the int64 words of the graphs' one static buffer."""
    out = array.array("q")
    out.frombytes(array.array("d", values).tobytes())
    return out
