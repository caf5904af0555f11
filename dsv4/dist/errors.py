"""The error a tensor-parallel engine raises when a rank is gone (no torch import: the server uses it)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """A rank of a tensor-parallel engine died, timed out or failed mid-step.

    The ranks' collectives can no longer be matched up, so the engine cannot continue: every
    later step raises this too. The server fails in-flight requests and exits; ``LLM`` re-raises.
    """
