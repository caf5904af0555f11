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
