"""Errors the engine raises or reports (no torch import: the server uses them)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine can run no more steps: a rank of a multi-process engine died, timed out or failed
    mid-step, so the ranks' collectives can no longer be matched up. Every later step raises this
    too. The server fails in-flight requests and exits; ``LLM`` re-raises."""


class RequestError(RuntimeError):
    """A failure that belongs to one request (it does not fit the cache, its logits are not finite):
    the engine finishes that request with ``finish_reason="error"`` and keeps serving the others."""

    def __init__(self, request_id: str, message: str):
        super().__init__(f"request {request_id}: {message}")
        self.request_id = request_id
