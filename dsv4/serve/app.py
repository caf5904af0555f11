"""Assemble the server (:func:`build_app`) and run it with uvicorn (:func:`serve`).

``build_app`` takes an already built LLMEngine so that tests (and embedders) can serve any
engine, including one with a scripted backend; the app exposes it as ``app.state.engine`` and
the engine loop as ``app.state.async_engine``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from .. import __version__, env
from .async_engine import AsyncEngine
from .errors import install_handlers
from .metrics import HTTPMetricsMiddleware, ServerMetrics, StatsLog
from .openai_api import KNOWN_ENDPOINTS, AuthMiddleware, RequestLogMiddleware, router
from .serving import ServerState

log = logging.getLogger("dsv4.serve")

_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class ServeOptions:
    """The server's own settings (``dsv4 serve``'s serve-only flags; the engine's are EngineConfig's)."""

    log_stats: bool = True  # the periodic stats line (--disable-log-stats)
    log_stats_interval: float = 10.0


def generation_defaults(model_dir: str) -> dict:
    """Sampling defaults from the checkpoint's generation_config.json (vLLM's ``--generation-config auto``)."""
    path = Path(model_dir, "generation_config.json")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {
        k: cfg[k] for k in _GENERATION_KEYS if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg[k], bool)
    }


def build_app(engine, *, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              options: ServeOptions | None = None) -> FastAPI:
    """An OpenAI-compatible FastAPI app serving ``engine`` (an LLMEngine); its loop starts with the app."""
    from ..chat import effort_version_for_config

    opts = options or ServeOptions()
    model_path = str(engine.config.model)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [model_path]
    metrics = ServerMetrics(names[0], engine.max_model_len)
    device = getattr(getattr(engine, "kv_cache", None), "device", None)
    stats_log = None
    if opts.log_stats:
        stats_log = StatsLog(opts.log_stats_interval, "CPU" if str(device) == "cpu" else "GPU")
    aengine = AsyncEngine(engine, metrics, stats_log=stats_log)
    cfg = engine.model_config
    state = ServerState(
        engine=aengine,
        model_names=names,
        model_path=model_path,
        max_model_len=engine.max_model_len,
        vocab_size=cfg.vocab_size,
        metrics=metrics,
        effort_version=effort_version_for_config(cfg.raw),
        generation_defaults=generation_defaults(model_path),
        api_key=api_key,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        import asyncio

        aengine.start()
        log.debug("engine loop started for %s (served as %s)", model_path, ", ".join(names))
        try:
            yield
        finally:
            await asyncio.to_thread(aengine.stop)
            # tensor-parallel workers: stopped here, before uvicorn re-raises a captured SIGTERM/SIGINT
            shutdown = getattr(engine, "shutdown", None)
            if shutdown is not None:
                await asyncio.to_thread(shutdown)

    app = FastAPI(title="dsv4 OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.dsv4 = state
    app.state.engine = engine
    app.state.async_engine = aengine
    install_handlers(app)
    app.include_router(router)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key)
    app.add_middleware(RequestLogMiddleware, metrics=metrics)  # also logs 401s
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics, routes=KNOWN_ENDPOINTS)  # outermost
    return app


def serve(args, config, options: ServeOptions) -> int:
    """``dsv4 serve``: build the engine of ``config`` (the command's flags) and serve it until interrupted."""
    import uvicorn

    from ..llm import build_engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = build_engine(config)
    api_key = args.api_key or env.api_key()
    app = build_app(engine, served_model_name=args.served_model_name, api_key=api_key, options=options)
    url = f"http://{args.host}:{args.port}"
    log.info(
        "dsv4 serve: model %s, KV cache %d tokens (max_model_len %d), listening on %s",
        args.model,
        engine.kv_cache.budget.capacity_tokens,
        engine.max_model_len,
        url,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=False,
            timeout_keep_alive=30,
        )
    )  # our request log replaces it
    aengine = app.state.async_engine

    def on_dead():  # a tensor-parallel rank died: answer what is in flight, then exit non-zero (never hang)
        server.config.timeout_graceful_shutdown = 10
        server.should_exit = True

    aengine.on_dead = on_dead
    try:
        server.run()
    finally:
        engine.shutdown()  # tensor-parallel workers (nothing at TP=1)
    if aengine.dead:
        log.critical("dsv4 serve: exiting because the engine died: %s", aengine.dead)
        return 1
    return 0 if server.started else 3  # 3: uvicorn's startup failure code (e.g. the port is taken)
