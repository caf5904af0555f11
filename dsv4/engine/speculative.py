"""Speculative decoding: a proposer drafts tokens, the target verifies them all in one forward.

A step with speculation:

1. the scheduler gives a decoding request its last sampled token and its drafts (``Request.drafts``)
   as one chunk, like a prefill chunk: the target computes logits at every row of it in one forward
   over the paged caches;
2. ``verify`` walks the rows in order, appending each draft the target accepts, then one token of
   the target's own (the replacement of the first rejected draft, or the bonus after the last) —
   greedy: a draft is accepted when it is the target's pick, so the output is the one without
   speculation; sampling: the standard rejection rule (accept with probability min(1, p/q), else
   draw from the normalized max(0, p − q)), so the output follows the target's distribution;
3. the request's cache keeps the accepted tokens only (``PagedSequenceView.advance`` with their
   count: the rejected tokens' writes lie past it, unread until overwritten);
4. the proposer sees every row of the step that stays in the cache (prefill rows too: the MTP
   layer keeps its own window cache of them) and drafts the next tokens.

A proposer is anything with ``propose(rows, streams)`` (``Proposer``): ``MTPProposer`` runs the
checkpoint's MTP layer on the target's pre-hc_head streams, reusing the one layer for every draft
past the first as vLLM does; ``DSparkProposer`` (the 0731 release) writes its stages' context KV
from the target layers' stream means and drafts a whole block in one pass (``dsv4.model.dspark``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..model.step import PagedStep, SeqChunk, Step
from .request import Drafts, Request
from .sampler import Sampler, _first_argmax, filter_logits, greedy_picks
from .structured import bitmask_rows


@dataclass
class StepRows:
    """What a proposer sees of one scheduled chunk after verification: its rows ``chunk.offset ..
    + num_valid`` are in the cache (positions ``chunk.start ..``), and ``num_drafts`` tokens are
    wanted after them (0: the rows only feed the proposer's own caches)."""

    req: Request
    chunk: SeqChunk
    num_valid: int
    num_drafts: int


def unread_rows(r: StepRows, window: int) -> int:
    """How many of ``r``'s first rows no draft will read: a draft layer attends to the ``window``
    positions up to its query, and its first query of the request is at the last computed token
    (≥ ``num_tokens`` − 2), so rows before num_tokens − window − 2 are never read (a long prompt's
    drafter pass covers its last window, not all of it; a prefix hit recomputes a whole block)."""
    return min(r.num_valid, max(0, r.req.num_tokens - window - 2 - r.chunk.start))


def pass_step(proposer, chunks: list[SeqChunk], allocs) -> Step:
    """A drafter pass's attention metadata: over the pages (the batched attention) or through the
    chunks' views (the reference's), as the proposer's engine runs its steps."""
    if proposer.paged:
        return PagedStep.build(proposer.kv.kvc, chunks, allocs)
    return Step.of(chunks, proposer.device)


class Proposer(Protocol):
    num_speculative_tokens: int
    without_pages: int  # the drafts a request still gets when ``ahead``'s pages cannot be had

    def ahead(self, want: int) -> int:
        """Positions past a request's computed tokens whose window pages ``want`` drafts write."""

    def propose(self, rows: list[StepRows], streams: torch.Tensor) -> None:
        """Set ``req.drafts`` of every row that wants drafts; ``streams``: what the runner kept of
        the step's forward for the proposer, all rows (MTP: the pre-hc_head streams [T, hc, H];
        DSpark: the target layers' stream means [T, n·H])."""


CONFIDENCE_CUTS = tuple(i / 20 for i in range(20))  # the thresholds SpecStats evaluates: 0, 0.05 … 0.95


@dataclass
class SpecStats:
    """Counters with vLLM's meaning: a draft is one request's proposal for one step.

    Drafts that carry confidences (DSpark's head) also feed, per threshold t of ``CONFIDENCE_CUTS``,
    the tokens that would have been drafted and accepted had each draft ended before its first
    confidence below t (``confidence_cuts``): exact, since whether the first n drafts are accepted
    does not depend on the drafts after them."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_confident_drafts: int = 0
    cut_draft_tokens: list[int] = field(default_factory=lambda: [0] * len(CONFIDENCE_CUTS))
    cut_accepted_tokens: list[int] = field(default_factory=lambda: [0] * len(CONFIDENCE_CUTS))

    def record(self, proposed: int, accepted: int, confidence: list[float] | None = None) -> None:
        if not proposed:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        if confidence is not None and len(confidence) == proposed:
            self.num_confident_drafts += 1
            for j, t in enumerate(CONFIDENCE_CUTS):
                n = next((i for i, c in enumerate(confidence) if c < t), proposed)
                self.cut_draft_tokens[j] += n
                self.cut_accepted_tokens[j] += min(n, accepted)

    def confidence_cuts(self) -> list[tuple[float, float, float]]:
        """Per threshold t: (t, draft tokens per step, tokens per step) over the drafts with
        confidences, had they been cut at t — the verify work a cut saves against the tokens it
        loses (t = 0: no cut; a step always adds one token of the target's own)."""
        n = self.num_confident_drafts
        if not n:
            return []
        return [(t, d / n, 1.0 + a / n) for t, d, a in zip(CONFIDENCE_CUTS, self.cut_draft_tokens,
                                                            self.cut_accepted_tokens)]

    @property
    def acceptance_length(self) -> float:
        """Tokens per verify step: 1 + accepted drafts per draft (vLLM's mean acceptance length)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Per draft position, the share of drafts whose tokens up to it were all accepted (vLLM's
        per-position acceptance rate: every draft is in each denominator)."""
        return [n / self.num_drafts for n in self.accepted_per_position] if self.num_drafts else []

    def since(self, before: "SpecStats") -> "SpecStats":
        """The counts added after the snapshot ``before`` (a copy of these stats taken earlier)."""
        pos = [n - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0)
               for i, n in enumerate(self.accepted_per_position)]
        return SpecStats(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                         self.num_accepted_tokens - before.num_accepted_tokens, pos,
                         self.num_confident_drafts - before.num_confident_drafts,
                         [a - b for a, b in zip(self.cut_draft_tokens, before.cut_draft_tokens)],
                         [a - b for a, b in zip(self.cut_accepted_tokens, before.cut_accepted_tokens)])


def verify(sampler: Sampler, req: Request, rows: torch.Tensor, drafts: Drafts, vocab_size: int,
           stats: SpecStats | None = None) -> int:
    """Append the tokens the target gives ``req`` from its verify rows (``rows`` [1 + d, V] on the
    host: the logits after its last token and after each of its d drafts); returns how many of the
    chunk's tokens stay in the cache (1 + the accepted drafts).

    Each row is processed with the request as it is after the tokens before it (penalties, min_tokens,
    the grammar's mask and its stop checks see exactly what they would without speculation)."""
    d = len(drafts)

    def token_at(j: int):
        raw = sampler.checked(req, rows[j])
        mask = bitmask_rows([req.guide], vocab_size)[0] if req.guide is not None else None
        x = sampler.target_logits(req, raw, mask)
        if j == d:  # every draft accepted: the bonus token
            token = sampler.draw(req, x)
        else:
            token = _judge(sampler, req, x, drafts.tokens[j], None if drafts.probs is None else drafts.probs[j])
        return token, sampler.logprobs(req, raw, token)

    return _walk(req, drafts, token_at, stats)


def verify_picks(req: Request, picks: list[int], drafts: Drafts, stats: SpecStats | None = None) -> int:
    """``verify`` for a plain-greedy request (``sampler.plain_greedy``: its token is the first argmax of
    the raw row) from its 1 + d rows' picks made on the device (``greedy_picks``): the same tokens and
    count, with no logits row copied to the host."""
    return _walk(req, drafts, lambda j: (picks[j], (None, None)), stats)


def _walk(req: Request, drafts: Drafts, token_at, stats: SpecStats | None) -> int:
    """Append the target's token at each verify row in order (``token_at(j)`` → (token, (logprobs,
    token logprob))) until one differs from its draft, the request finishes or the bonus row is
    reached; returns how many of the chunk's tokens stay (1 + the accepted drafts)."""
    d = len(drafts)
    accepted = 0
    try:
        for j in range(d + 1):
            token, lps = token_at(j)
            if j < d:
                accepted += token == drafts.tokens[j]
            req.append_token(token, *lps)
            if req.finished or j == d or token != drafts.tokens[j]:
                return j + 1
        raise AssertionError("unreachable")
    finally:
        if stats is not None:
            stats.record(d, accepted, drafts.confidence)


def _judge(sampler: Sampler, req: Request, x: torch.Tensor, draft: int, q: torch.Tensor | None) -> int:
    """The token at a draft's place: the draft if accepted, else the target's replacement."""
    if req.params.greedy:
        return _first_argmax(x)  # (the draft exactly when it is the target's pick)
    p = torch.softmax(x, dim=-1)
    q = q.to(p.device)  # (a graph step's drafts keep their distributions on the device)
    gen = sampler.generator_of(req)
    u = float(torch.rand(1, generator=gen))
    if u * float(q[draft]) <= float(p[draft]):
        return draft
    residual = (p - q).clamp(min=0)
    if float(residual.sum()) <= 0.0:  # p ≤ q everywhere: p = q, and the draft would have been accepted
        residual = p
    return int(torch.multinomial(residual, 1, generator=gen))


def draft_pick(sampler: Sampler, req: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """A draft token from the proposer's logits row (host, float32): greedy its first argmax; else
    a draw from q = its distribution at the request's temperature, top-k, top-p and min-p."""
    p = req.params
    if p.greedy:
        return _first_argmax(logits), None
    q = torch.softmax(filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p), dim=-1)
    return int(torch.multinomial(q, 1, generator=sampler.generator_of(req))), q


def draft_picks(sampler: Sampler, reqs: list[Request], logits: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """Each request's draft from its logits row: greedy rows picked on the device in one batch."""
    greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
    picked = greedy_picks(logits, greedy)
    rest = [i for i in range(len(reqs)) if i not in picked]
    host = dict(zip(rest, logits[rest].float().cpu())) if rest else {}
    return [(picked[i], None) if i in picked else draft_pick(sampler, r, host[i]) for i, r in enumerate(reqs)]


class MTPProposer:
    """Drafts from the checkpoint's MTP layer (``ReferenceModel.mtp_forward``).

    Draft 1 of a request comes from its last valid row: the target's streams there and the token
    just appended. Every valid row of the step also goes through the layer (its window KV at that
    row's position, from the row's streams and the next token), so the layer's cache holds every
    position of the sequence as a run without rejections would. Drafts 2..k re-feed the layer's own
    output streams with the previous draft at the next position; those window entries are
    provisional and are rewritten from the target's streams once the position is verified."""

    def __init__(self, model, kv, sampler: Sampler, num_speculative_tokens: int, paged_attention: bool):
        self.model, self.kv, self.sampler = model, kv, sampler
        self.num_speculative_tokens = num_speculative_tokens
        self.paged = paged_attention
        self.device = model.device

    without_pages = 1  # draft 1 comes from the last computed row: no new position

    def ahead(self, want: int) -> int:
        return want - 1  # drafts 2.. write the layer's window at the positions after it

    def _forward(self, next_ids: list[int], streams: torch.Tensor, chunks: list[SeqChunk], allocs,
                 logits_rows: list[int]):
        ids = torch.tensor(next_ids, dtype=torch.long, device=self.device)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        with torch.no_grad():
            return self.model.mtp_forward(ids, streams, pass_step(self, chunks, allocs), logits_rows=rows)

    def propose(self, rows: list[StepRows], streams: torch.Tensor) -> None:
        view, window = self.kv.view, self.model.cfg.sliding_window
        chunks, allocs, ids, src, want, last = [], [], [], [], [], []
        off = 0
        for r in rows:
            req, c = r.req, r.chunk
            skip = unread_rows(r, window)
            n, start = r.num_valid - skip, c.start + skip
            if n <= 0:
                continue
            chunks.append(SeqChunk(view(req.alloc), start, n))
            allocs.append(req.alloc)
            ids.extend(req.token_slice(start + 1, start + n + 1))
            src.extend(range(c.offset + skip, c.offset + skip + n))
            if r.num_drafts:
                want.append(r)
                last.append(off + n - 1)
            off += n
        if not chunks:
            return
        index = torch.tensor(src, dtype=torch.long, device=streams.device)
        out = self._forward(ids, streams[index], chunks, allocs, last)
        if not want:
            return
        drafts = [Drafts([], None if r.req.params.greedy else []) for r in want]
        active = list(range(len(want)))  # the requests still drafting; ``s`` and ``logits`` rows follow it
        s, logits = out.streams[torch.tensor(last, dtype=torch.long, device=streams.device)], out.logits
        for step in range(self.num_speculative_tokens):
            for i, (tok, q) in zip(active, draft_picks(self.sampler, [want[i].req for i in active], logits)):
                drafts[i].tokens.append(tok)
                if drafts[i].probs is not None:
                    drafts[i].probs.append(q)
            keep = [j for j, i in enumerate(active) if want[i].num_drafts > step + 1]
            if not keep:
                break
            active = [active[j] for j in keep]
            # draft step+2 of each: the previous draft at the next position, the layer's own streams
            chunks = [SeqChunk(view(want[i].req.alloc), want[i].chunk.start + want[i].num_valid + step, 1)
                      for i in active]
            out = self._forward([drafts[i].tokens[-1] for i in active], s[keep], chunks,
                                [want[i].req.alloc for i in active], list(range(len(active))))
            s, logits = out.streams, out.logits
        for r, d in zip(want, drafts):
            r.req.drafts = d


class DSparkProposer:
    """Drafts from the checkpoint's DSpark stages (``dsv4.model.dspark``).

    Every valid row of the step writes its position's context KV into each stage's window cache (from
    the target layers' stream means at that row), so those caches hold exactly the verified positions,
    as a run without rejections would. The paged path also stores the draft block's own KV at the
    block's positions (its attention reads it from there); they lie past the request's computed tokens,
    and the context write of the step that verifies them comes before any read. A request that wants
    drafts then gets one block ``[last token, noise × (k − 1)]`` at the positions after its context; its
    k rows' logits, each with the Markov bias of the token before it (the last token, then each draft),
    give the drafts in order. With the confidence head the drafts carry its acceptance probabilities
    (``Drafts.confidence``), and ``min_confidence`` > 0 ends them before the first draft below it.

    The block always has ``num_speculative_tokens`` rows (non-causal attention makes a row depend on
    the block's length): a request nearer its max_tokens keeps the first drafts."""

    def __init__(self, model, kv, sampler: Sampler, num_speculative_tokens: int, min_confidence: float = 0.0,
                 paged_attention: bool = False):
        drafter = model.dspark
        if drafter is None:
            raise ValueError("DSpark drafting needs a checkpoint with DSpark stages (config.json dspark_* fields)")
        if min_confidence and not drafter.has_confidence:
            raise ValueError(f"dspark_min_confidence={min_confidence}: the checkpoint has no confidence head "
                             f"(mtp.{len(drafter.stages) - 1}.confidence_head.proj.weight)")
        self.model, self.kv, self.sampler, self.drafter = model, kv, sampler, drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.min_confidence = min_confidence
        self.paged = paged_attention
        self.device = model.device

    without_pages = 0

    def ahead(self, want: int) -> int:
        return self.num_speculative_tokens if self.paged else 0  # the paged pass stores the block's KV

    def propose(self, rows: list[StepRows], streams: torch.Tensor) -> None:
        view, window = self.kv.view, self.model.cfg.sliding_window
        chunks, allocs, src, want = [], [], [], []
        for r in rows:
            c = r.chunk
            skip = unread_rows(r, window)
            n = r.num_valid - skip
            if n <= 0:
                continue
            chunks.append(SeqChunk(view(r.req.alloc), c.start + skip, n))
            allocs.append(r.req.alloc)
            src.extend(range(c.offset + skip, c.offset + skip + n))
            if r.num_drafts:
                want.append(r)
        if not chunks:
            return
        with torch.no_grad():
            aux = streams[torch.tensor(src, dtype=torch.long, device=streams.device)]
            self.model.dspark_context(aux, pass_step(self, chunks, allocs))
            if want:
                self._draft(want)

    def _draft(self, want: list[StepRows]) -> None:
        k, dev = self.num_speculative_tokens, self.device
        noise = self.drafter.noise_token_id
        anchors = [r.req.token_slice(r.chunk.start + r.num_valid, r.chunk.start + r.num_valid + 1)[0] for r in want]
        ids = torch.tensor([t for a in anchors for t in [a] + [noise] * (k - 1)], dtype=torch.long, device=dev)
        blocks = [SeqChunk(self.kv.view(r.req.alloc), r.chunk.start + r.num_valid, k) for r in want]
        logits, h = self.model.dspark_block(ids, pass_step(self, blocks, [r.req.alloc for r in want]))
        reqs = [r.req for r in want]
        drafts = [Drafts([], None if q.params.greedy else [], [] if self.drafter.has_confidence else None)
                  for q in reqs]
        prev = torch.tensor(anchors, dtype=torch.long, device=dev)
        active = list(range(len(want)))  # the requests still drafting
        for i in range(k):
            bias, e = self.drafter.markov(prev)
            rows = torch.tensor([j * k + i for j in active], dtype=torch.long, device=dev)
            conf = self.drafter.confidence(h[rows], e)
            sel = list(range(len(active)))
            if conf is not None:
                conf = conf.tolist()
                sel = [a for a in sel if conf[a] >= self.min_confidence]  # the others end here
            picks = draft_picks(self.sampler, [reqs[active[a]] for a in sel], (logits[rows] + bias)[sel]) if sel else []
            keep = []
            for a, (tok, q) in zip(sel, picks):
                d = drafts[active[a]]
                d.tokens.append(tok)
                if d.probs is not None:
                    d.probs.append(q)
                if d.confidence is not None:
                    d.confidence.append(conf[a])
                if want[active[a]].num_drafts > i + 1:
                    keep.append(active[a])
            if not keep:
                break
            active = keep
            prev = torch.tensor([drafts[j].tokens[-1] for j in active], dtype=torch.long, device=dev)
        for r, d in zip(want, drafts):
            r.req.drafts = d
