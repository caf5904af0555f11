"""OpenAI-compatible HTTP server for dsv4 (``dsv4 serve``), shaped like vLLM's.

Modules, one job each:

* :mod:`.protocol` — pydantic request models and their mapping to SamplingParams;
* :mod:`.errors` — OpenAI-style error bodies and exception handlers;
* :mod:`.async_engine` — the engine thread, command queue and per-request output streams;
* :mod:`.serving` — state and helpers the endpoints share (validation, SSE, disconnects);
* :mod:`.completions`, :mod:`.chat_completions` — the two generation endpoints;
* :mod:`.openai_api` — routes, auth and request-log middleware;
* :mod:`.metrics` — Prometheus metrics;
* :mod:`.app` — ``build_app(engine)`` and ``serve(args)``.

Server-only dependencies (fastapi, uvicorn, prometheus-client) are imported only from here, so
``import dsv4`` and the engine stay free of them. Install them with ``pip install dsv4[serve]``.
"""

__all__ = ["build_app"]


def __getattr__(name):
    if name == "build_app":
        from .app import build_app

        return build_app
    raise AttributeError(f"module 'dsv4.serve' has no attribute {name!r}")
