"""Assemble the server (:func:`build_app`) and run it with uvicorn (:func:`serve`).

``build_app`` takes an already built LLMEngine so that tests (and embedders) can serve any
engine, including one with a scripted backend; the app exposes it as ``app.state.engine`` and
the engine loop as ``app.state.async_engine``.

``serve`` runs on a socket ``dsv4 serve`` bound before the model loaded (a taken port fails at once,
not after minutes of loading), and bounds the graceful shutdown: on SIGTERM the requests in flight
get ``--shutdown-timeout`` seconds, then their streams end with an error event and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from .. import __version__, env
from .async_engine import AsyncEngine
from .errors import install_handlers
from .metrics import HTTPMetricsMiddleware, ServerMetrics, StatsLog
from .openai_api import KNOWN_ENDPOINTS, AuthMiddleware, RequestLogMiddleware, router
from .serving import MAX_BODY_BYTES, ServerState

log = logging.getLogger("dsv4.serve")

_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class ServeOptions:
    """The server's own settings (``dsv4 serve``'s serve-only flags; the engine's are EngineConfig's)."""

    log_stats: bool = True  # the periodic stats line (--disable-log-stats)
    log_stats_interval: float = 10.0
    log_requests: bool = True  # one line per HTTP request (--disable-log-requests)
    log_prompts: bool = False  # each request's prompt and parameters (--enable-log-requests)
    max_log_len: int | None = None
    generation_config: str = "auto"
    engine_stall_timeout: float = 30.0
    shutdown_timeout: float = 5.0
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies get a 413 (--max-request-body-mb)


def generation_defaults(model_dir: str, generation_config: str = "auto") -> dict:
    """Sampling defaults, as vLLM's ``--generation-config``: ``auto`` reads the model's
    generation_config.json (none: no defaults), ``vllm`` uses none, a folder reads its file."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        path = Path(model_dir, "generation_config.json")
        if not path.is_file():
            return {}
    else:
        folder = Path(generation_config)
        if not folder.is_dir():
            raise ValueError(f"--generation-config {generation_config}: not 'auto', 'vllm' or a directory")
        path = folder / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"--generation-config {generation_config}: the directory has no generation_config.json")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config {generation_config}: cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--generation-config {generation_config}: {path} is not a JSON object")
    return {
        k: cfg[k] for k in _GENERATION_KEYS if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg[k], bool)
    }


def build_app(engine, *, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              options: ServeOptions | None = None, model_root: str | None = None) -> FastAPI:
    """An OpenAI-compatible FastAPI app serving ``engine`` (an LLMEngine); its loop starts with the app.

    Without ``served_model_name`` the model is served by its directory's name (no absolute path in
    /v1/models and /metrics); ``model_root`` is what /v1/models reports as its ``root`` (default: the
    model path)."""
    from ..chat import effort_version_for_config

    opts = options or ServeOptions()
    model_path = str(engine.config.model)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [Path(model_path).resolve().name]
    root = model_root or model_path
    spec = engine.config.speculative
    metrics = ServerMetrics(names[0], engine.max_model_len, spec.num_speculative_tokens if spec is not None else 0)
    stats_log = None
    if opts.log_stats:
        stats_log = StatsLog(opts.log_stats_interval, "CPU" if str(engine.device) == "cpu" else "GPU")
    aengine = AsyncEngine(engine, metrics, stats_log=stats_log, stall_timeout=opts.engine_stall_timeout,
                          log_prompts=opts.log_prompts, max_log_len=opts.max_log_len)
    cfg = engine.model_config
    defaults = generation_defaults(model_path, opts.generation_config)
    if defaults:
        log.info("sampling defaults from %s/generation_config.json: %s (requests override them; "
                 "--generation-config vllm ignores the file)",
                 model_path if opts.generation_config == "auto" else opts.generation_config, defaults)
    state = ServerState(
        engine=aengine,
        model_names=names,
        model_path=root,
        max_model_len=engine.max_model_len,
        vocab_size=cfg.vocab_size,
        metrics=metrics,
        effort_version=effort_version_for_config(cfg.raw),
        generation_defaults=defaults,
        api_key=api_key,
        max_body_bytes=opts.max_body_bytes,
    )

    # built now, not by the first request that needs them: the plain-text tokenizer of chat prompts
    # (~1 s), and on a thread the grammar engine's vocabulary (~1.5 s, needed by structured outputs)
    plain = getattr(engine.tokenizer, "encode_plain", None)
    if plain is not None:
        plain("")
    grammars = getattr(engine, "grammars", None)
    if grammars is not None:
        threading.Thread(target=grammars.warm, name="dsv4-grammar-vocabulary", daemon=True).start()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        log.debug("engine loop started for %s (served as %s)", model_path, ", ".join(names))
        try:
            yield
        finally:
            await asyncio.to_thread(aengine.stop, 10.0)
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
    if opts.log_requests:
        app.add_middleware(RequestLogMiddleware)  # also logs 401s
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics, routes=KNOWN_ENDPOINTS)  # outermost
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown with a bound: the engine takes no new requests, those in flight get
    ``grace`` seconds, then the open streams end with an error event (and ``[DONE]``)."""

    def __init__(self, config: uvicorn.Config, aengine: AsyncEngine, grace: float):
        super().__init__(config)
        self.aengine, self.grace = aengine, grace

    async def shutdown(self, sockets=None):
        self.aengine.drain()
        n = self.aengine.open_streams
        if n:
            log.info("shutting down: %d request(s) in flight get %g s to finish (--shutdown-timeout)", n, self.grace)
        cut = asyncio.ensure_future(self._cut_off())
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    async def _cut_off(self):
        await asyncio.sleep(self.grace)
        n = self.aengine.fail_open_streams(
            503, f"the server is shutting down: requests still running after {self.grace:g} s were stopped")
        if n:
            log.warning("shutting down: stopped %d request(s) still running after %g s", n, self.grace)


def serve(args, config, options: ServeOptions, sock: socket.socket, model_root: str | None = None) -> int:
    """``dsv4 serve``: build the engine of ``config`` (the command's flags) and serve it on ``sock``
    (bound already, see ``dsv4.cli``) until interrupted."""
    from ..llm import build_engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    generation_defaults(config.model, options.generation_config)  # a bad --generation-config fails before loading
    engine = build_engine(config)
    # the engine lives as long as the server: what start-up made (weights, graphs, kernel caches) is frozen
    # out of the garbage collector's scans, so a full collection while serving walks only what requests
    # made (vLLM does the same; the canary engine with MTP: 183K objects, a 37 ms pause on the dev CPU)
    gc.collect()
    gc.freeze()
    try:
        api_key = args.api_key or env.api_key()
        app = build_app(engine, served_model_name=args.served_model_name, api_key=api_key, options=options,
                        model_root=model_root)
        state = app.state.dsv4
        host, port = sock.getsockname()[:2]
        log.info(
            "dsv4 serve: model %s served as %s, KV cache %d tokens (max_model_len %d), listening on http://%s:%d",
            args.model, ", ".join(state.model_names), engine.stats.kv_capacity_tokens, engine.max_model_len,
            f"[{host}]" if ":" in host else host, port,
        )
        aengine = app.state.async_engine
        server = DrainingServer(
            uvicorn.Config(app, host=args.host, port=port, log_level=args.uvicorn_log_level, access_log=False,
                           timeout_keep_alive=30, timeout_graceful_shutdown=options.shutdown_timeout + 10),
            aengine, options.shutdown_timeout)  # our request log replaces uvicorn's access log

        def on_dead():  # a tensor-parallel rank died: answer what is in flight, then exit non-zero (never hang)
            server.should_exit = True

        aengine.on_dead = on_dead
        server.run(sockets=[sock])
    finally:
        engine.shutdown()  # tensor-parallel workers (nothing at TP=1)
    if aengine.dead:
        log.critical("dsv4 serve: exiting because the engine died: %s", aengine.dead)
        return 1
    return 0 if server.started else 3  # 3: uvicorn's startup failure code
