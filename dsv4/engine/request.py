"""One sequence being generated: its tokens, cache holdings, sampling state and stop checks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..cache.paged import CacheAllocation
from .outputs import CompletionOutput, Logprob
from .sampling_params import SamplingParams

PENDING = -1  # the token id of a position whose token is still on the device (``Request.pending_tokens``)


@dataclass
class Drafts:
    """A request's proposed next tokens and, for a sampled request, the distribution each was drawn
    from (``q`` of the rejection rule; None when greedy); with DSpark's confidence head, each
    draft's predicted acceptance probability."""

    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] | None = None
    confidence: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        del self.tokens[n:]
        if self.probs is not None:
            del self.probs[n:]
        if self.confidence is not None:
            del self.confidence[n:]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 prompt: str | None = None, index: int = 0, eos_token_id: int | None = None,
                 detokenizer=None, arrival: float | None = None, guide=None):
        self.request_id, self.index = request_id, index
        self.prompt, self.prompt_token_ids = prompt, list(prompt_token_ids)
        self.params = params
        self.output_token_ids: list[int] = []  # sampled tokens, read back: never a placeholder
        # async scheduling: tokens after output_token_ids that the in-flight step computes and the host
        # has not read yet; the scheduler and the runner count their positions (their ids: PENDING)
        self.pending_tokens = 0
        self.status = Status.WAITING
        self.alloc = CacheAllocation()
        self.eos_token_id = eos_token_id
        self.detok = detokenizer
        self.guide = guide  # the grammar state of a structured output (dsv4.engine.structured.Guide)
        self.drafts = Drafts()  # speculative decoding: tokens proposed after the last one, to be verified
        self.text = ""
        self._emitted_chars = 0
        self._sent_tokens = 0  # output tokens the deltas returned so far (``completion(delta=True)``)
        self._stop_scanned = 0  # text before this offset was already searched for stop strings
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.exception: BaseException | None = None  # what failed the request (finish_reason "error")
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = None
        self.prompt_logits: torch.Tensor | None = None  # rows gathered so far across prefill chunks
        self.cumulative_logprob = 0.0
        self.num_preemptions = 0
        self.arrival = arrival if arrival is not None else time.monotonic()
        self.first_token_time: float | None = None
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    # ---- token bookkeeping ---------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        """The prompt, the output and a ``PENDING`` id per pending token."""
        ids = self.prompt_token_ids + self.output_token_ids
        return ids + [PENDING] * self.pending_tokens if self.pending_tokens else ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (a step needs a few tokens
        of a long context)."""
        p = self.prompt_token_ids
        n = len(p)
        if end <= n:
            return p[start:end]
        out = self.output_token_ids
        ids = out[start - n:end - n] if start >= n else p[start:] + out[:end - n]
        if self.pending_tokens:
            m = n + len(out)
            ids += [PENDING] * max(0, min(end, m + self.pending_tokens) - max(start, m))
        return ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens so far, the pending ones included (the index of the next token sampled)."""
        return len(self.output_token_ids) + self.pending_tokens

    @property
    def num_computed(self) -> int:
        return self.alloc.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token: int, logprob: dict[int, Logprob] | None, token_logprob: float | None) -> None:
        if self.guide is not None:  # first: a token the grammar rejects is not appended
            self.guide.accept(token)
        self.output_token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        if token_logprob is not None:
            self.cumulative_logprob += token_logprob
        if self.detok is not None:
            self.text += self.detok.feed(token)
        self._check_stop(token)

    def _check_stop(self, token: int) -> None:
        p = self.params
        n_out = len(self.output_token_ids)
        if n_out >= p.min_tokens:
            if token == self.eos_token_id and not p.ignore_eos:
                self.finish("stop", None)
                return
            if token in p.stop_token_ids:
                self.finish("stop", token)
                return
            hits = [(i, s) for s in p.stop_strings
                    if (i := self.text.find(s, max(0, self._stop_scanned - len(s) + 1))) >= 0]
            if hits:
                i, s = min(hits)
                self.text = self.text[: i + len(s)] if p.include_stop_str_in_output else self.text[:i]
                self.finish("stop", s)
                return
        self._stop_scanned = len(self.text)
        if self.guide is not None and self.guide.done:  # the output is a complete sentence of its grammar
            self.finish("stop", None)
            return
        if p.max_tokens is not None and n_out >= p.max_tokens:
            self.finish("length", None)

    def finish(self, reason: str, stop_reason=None) -> None:
        self.status = Status.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason

    def fail(self, e: BaseException) -> None:
        """The engine could not run this request (its sampling, its step): it ends with an error."""
        self.exception = e
        self.finish("error")

    def completion(self, delta: bool = False) -> CompletionOutput:
        """The output so far, or with ``delta`` only what the previous delta did not return (its new
        token ids, logprobs and text: a step's output then costs what the step added, not the output's
        length). While running, text that could still turn into a stop string is held back."""
        end = len(self.text)
        if not self.finished and self.params.stop_strings:
            hold = max(len(s) for s in self.params.stop_strings) - 1
            end = max(self._emitted_chars, end - hold)
        logprobs = self.logprobs
        if delta:
            ids = self.output_token_ids
            n = len(ids)
            a, text = self._sent_tokens, self.text[self._emitted_chars:end]
            self._sent_tokens = n
            ids, logprobs = ids[a:n], None if logprobs is None else logprobs[a:n]
        else:
            text, ids = self.text[:end], self.output_token_ids[:]
            logprobs = None if logprobs is None else list(logprobs)
        self._emitted_chars = max(self._emitted_chars, end)
        return CompletionOutput(self.index, text, ids, None if logprobs is None else self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason)
