"""Continuous batching with a token budget (vLLM v1 style, one queue of token work).

Each step: running requests first (decodes, and prefills that continue), then waiting requests
in arrival order, each taking as many of its uncomputed tokens as the budget allows (chunked
prefill; several waiting prompts share one step). When pages run out the most recently admitted
running request is preempted by recompute: its pages are freed and it re-enters the front of the
queue.

Contention: a prefill alone gets the whole budget, but while another request is running or waiting
a prefill chunk takes at most ``long_prefill_token_threshold`` tokens, so a long prompt cannot hold
up the decodes and short prompts beside it for a whole budget-sized step (vLLM's option of that name;
the single-MI300X seed stack: 3,712 tokens alone, 1,024 under contention). Chunking never changes a
token's result (the engine is chunk-invariant), only when it is computed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..cache.manager import KVCacheManager
from ..model.step import BLOCK
from .errors import RequestError
from .request import Request, Status


@dataclass
class ScheduledChunk:
    req: Request
    num_tokens: int  # new tokens computed this step, starting at req.num_computed


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 long_prefill_token_threshold: int = 0, recompute_last_hit_block: bool = False):
        """``recompute_last_hit_block``: a prefix hit gives back its last block, recomputed (what a
        speculative proposer needs: the target's streams at the hit's end, and its window entries
        there, which depend on the token after the block, are not cached — vLLM does the same)."""
        self.kv = kv
        self.recompute_last_hit_block = recompute_last_hit_block
        self.max_num_seqs, self.budget, self.max_model_len = max_num_seqs, max_num_batched_tokens, max_model_len
        self.long_prefill = long_prefill_token_threshold  # 0: no cap
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Request) -> None:
        self.kv.free(victim.alloc)
        victim.drafts.truncate(0)
        # recompute restarts from token 0: prompt-logprob rows gathered so far would be gathered twice
        victim.prompt_logits = None
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and free its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.alloc)

    def _chunk_cap(self) -> int:
        """The most prefill tokens one request takes this step: the budget alone, the long-prefill
        threshold while others are running or waiting."""
        contended = len(self.running) + len(self.waiting) > 1
        return self.long_prefill if contended and 0 < self.long_prefill < self.budget else self.budget

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.budget
        cap = self._chunk_cap()
        out: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        i = 0
        running, try_allocate = self.running, self.kv.try_allocate  # (bound once: a pass per running request)
        while i < len(running) and budget > 0:
            req = running[i]
            pending = req.num_tokens - req.alloc.num_computed
            n = min(pending + len(req.drafts), budget, cap)  # a decode: its token and its drafts, verified
            if req.drafts and n < pending + len(req.drafts):
                req.drafts.truncate(max(0, n - pending))
            if n <= 0:
                i += 1
                continue
            while not try_allocate(req.alloc, n):
                victim = running[-1]
                running.pop()
                if id(victim) in scheduled:
                    raise RuntimeError("preempted a request already scheduled this step")
                self._preempt(victim)
                if victim is req:
                    break
            else:
                out.append(ScheduledChunk(req, n))
                scheduled.add(id(req))
                budget -= n
                i += 1
                continue
            # req itself was preempted: the loop index now points past the end or at the next one
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            short = False  # host-tier blocks of the hit there was no room to restore yet
            if req.num_computed == 0 and not req.alloc.blocks and req.params.prompt_logprobs is None:
                hit = self.kv.match_prefix(req.all_token_ids, req.num_tokens - 1)
                if self.recompute_last_hit_block:
                    hit = hit[:-1]
                if hit and self.kv.free_slots:
                    got = self.kv.apply_prefix(req.alloc, hit, req.all_token_ids)  # (counts each tier's hits)
                    # computing those blocks again would evict cached blocks (the hit's own, even) to
                    # redo work the host tier holds: wait for room instead, while others hold the pages
                    short = got < len(hit) * BLOCK and bool(self.running or out)
                self.kv.count_query(req.num_tokens)
            n = min(req.num_tokens - req.num_computed, budget, cap)
            if short or not self.kv.can_allocate(req.alloc, n):
                if not self.running and not out:
                    # nothing else holds pages: the request cannot fit at all
                    raise RequestError.of(req.request_id, f"{req.num_tokens} tokens do not fit in the KV cache "
                                          f"({self.kv.blocks.n} blocks of 256 tokens)")
                if req.alloc.blocks and req.num_computed > 0 and (short or not req.num_output_tokens):
                    self.kv.free(req.alloc)  # give back the prefix hit: retried next step
                break
            self.waiting.popleft()
            self.kv.allocate(req.alloc, n)
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(ScheduledChunk(req, n))
            budget -= n
        return out
