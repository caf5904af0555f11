"""Result objects shaped like vLLM's (``outputs[0].text``, ``.token_ids``, ``.finish_reason`` …)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: dict = field(default_factory=dict)
    exception: BaseException | None = field(default=None, repr=False)  # the engine failed the request

    @property
    def error(self) -> str | None:
        """What failed the request (its outputs end with ``finish_reason="error"``), or None."""
        e = self.exception
        return None if e is None else f"{type(e).__name__}: {e}"


def merge_delta(into: RequestOutput, more: RequestOutput) -> RequestOutput:
    """``into`` (a delta output, modified in place) followed by the later delta ``more`` of the same
    request: each completion's token ids, logprobs and text appended, the rest (finish, cumulative
    logprob, metrics, exception) the later one's. Returns ``into``."""
    by_index = {c.index: c for c in into.outputs}
    for c in more.outputs:
        mine = by_index.get(c.index)
        if mine is None:
            into.outputs.append(c)
            continue
        mine.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if mine.logprobs is None:
                mine.logprobs = list(c.logprobs)
            else:
                mine.logprobs.extend(c.logprobs)
        mine.text += c.text
        mine.cumulative_logprob, mine.finish_reason, mine.stop_reason = (c.cumulative_logprob, c.finish_reason,
                                                                         c.stop_reason)
    into.finished, into.metrics, into.exception = more.finished, more.metrics, more.exception
    if into.prompt_logprobs is None:
        into.prompt_logprobs = more.prompt_logprobs
    return into


class DeltaAccumulator:
    """The cumulative output of a request from its delta outputs, in O(total output): text pieces are
    joined once, at ``result()``."""

    def __init__(self):
        self.out: RequestOutput | None = None
        self._pieces: dict[int, list[str]] = {}

    def add(self, delta: RequestOutput) -> None:
        for c in delta.outputs:
            self._pieces.setdefault(c.index, []).append(c.text)
            c.text = ""
        self.out = delta if self.out is None else merge_delta(self.out, delta)

    def result(self) -> RequestOutput | None:
        if self.out is not None:
            for c in self.out.outputs:
                c.text = "".join(self._pieces.get(c.index, ()))
        return self.out
