"""Errors the engine raises or reports (no torch import: the server uses them)."""

from __future__ import annotations

from collections.abc import Iterable


class EngineDeadError(RuntimeError):
    """The engine can run no more steps: a rank of a multi-process engine died, timed out or failed
    mid-step, so the ranks' collectives can no longer be matched up. Every later step raises this
    too. The server fails in-flight requests and exits; ``LLM`` re-raises."""


def _rebuild(cls, args: tuple, request_ids: tuple[str, ...]):
    e = cls.__new__(cls)
    e.args, e.request_ids = args, request_ids
    return e


class RequestError(RuntimeError):
    """A failure that belongs to some requests (one does not fit the cache, its logits are not finite):
    the engine finishes exactly the requests in ``request_ids`` with ``finish_reason="error"`` and keeps
    serving the others. The ids are a field, so which requests fail never depends on the message."""

    def __init__(self, message: str, request_ids: Iterable[str]):
        super().__init__(message)
        self.request_ids = tuple(request_ids)

    @classmethod
    def of(cls, request_id: str, message: str):
        """The error of one request, its message saying which: "request <id>: <message>"."""
        return cls(f"request {request_id}: {message}", (request_id,))

    def __reduce__(self):  # (a data-parallel rank's failures cross processes)
        return _rebuild, (type(self), self.args, self.request_ids)


class NonFiniteLogitsError(RequestError, FloatingPointError):
    """A request's logits row holds NaN or Inf: no token can be sampled from it."""

    @classmethod
    def at(cls, request_id: str, output_index: int) -> "NonFiniteLogitsError":
        return cls.of(request_id, f"non-finite logits at output token {output_index}")


class GrammarError(RequestError, ValueError):
    """A request's structured-output grammar leaves no token to sample."""


class ContextLengthError(ValueError):
    """A request's prompt and ``max_tokens`` do not fit in ``max_model_len`` (the fields let the server
    say which, in its own words)."""

    def __init__(self, prompt_len: int, max_tokens: int | None, max_model_len: int):
        wanted = max_tokens if max_tokens is not None else max_model_len - prompt_len
        super().__init__(f"prompt has {prompt_len} tokens and max_tokens={wanted}: together more than "
                         f"max_model_len={max_model_len}")
        self.prompt_len, self.max_tokens, self.max_model_len = prompt_len, max_tokens, max_model_len

    @property
    def prompt_too_long(self) -> bool:
        """The prompt alone leaves no room for a token."""
        return self.prompt_len >= self.max_model_len

    def __reduce__(self):  # (a data-parallel rank's refusal crosses processes)
        return type(self), (self.prompt_len, self.max_tokens, self.max_model_len)


def context_budget(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The tokens a request may generate: ``max_tokens``, or when None what the prompt leaves of
    ``max_model_len``. The one place a request's length is checked (the engine when it adds a request,
    the server before it sends one): raises ``ContextLengthError`` when they do not fit. A ``max_tokens``
    below 1 is returned as it is, for ``SamplingParams`` to refuse."""
    if prompt_len >= max_model_len or (max_tokens is not None and prompt_len + max(max_tokens, 1) > max_model_len):
        raise ContextLengthError(prompt_len, max_tokens, max_model_len)
    return max_model_len - prompt_len if max_tokens is None else max_tokens
