"""Test support for tests/serve: a uvicorn server in a thread, and a scripted engine back end.

The scripted back end exists because the tiny random model emits random tokens: to test the
chat route's reasoning / content / tool-call assembly end to end (HTTP → engine → detokenizer →
parser → SSE), the real LLMEngine runs with

* :class:`ScriptedBackend` — a ModelBackend that returns zero logits at once (no model), and
  advances each sequence's cache view as the real model does, so the scheduler and the KV cache
  manager work exactly as in production;
* :class:`ScriptedSampler` — wraps the engine's sampler and, for requests whose prompt contains
  a marker, emits the token ids of a scripted text (a DSML tool call, say) one per step, then EOS.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import torch

KV_CACHE_MEMORY = 256 << 20
MAX_MODEL_LEN = 2048


def make_engine(model_dir, backend, **kw):
    """An LLMEngine over the tiny checkpoint with the test cache budget (256 MiB, 2048-token context)."""
    from dsv4.engine.engine import EngineConfig, LLMEngine

    cfg = dict(model=str(model_dir), kv_cache_memory=KV_CACHE_MEMORY, max_model_len=MAX_MODEL_LEN, max_num_seqs=64)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), model=backend)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``, in a /metrics page (0 if none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


class ServerThread:
    """Run an ASGI app with uvicorn on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    access_log=False, lifespan="on", timeout_keep_alive=30))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)
        self.port = None

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self):
        return self.app.state.engine

    @property
    def async_engine(self):
        return self.app.state.async_engine

    def on_engine(self, fn, timeout: float = 120):
        """Run fn(engine) on the engine thread (the only safe place to read engine state)."""
        return self.async_engine.call(fn).result(timeout)

    def wait_idle(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.on_engine(lambda e: e.has_unfinished_requests() or bool(e.requests)):
            if time.monotonic() > deadline:
                raise TimeoutError("engine still busy")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``dsv4 serve ARGS`` in a subprocess on a free loopback port (its own session), output in ``log_path``."""

    def __init__(self, log_path, *args: str, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, "-m", "dsv4.cli", "serve", "--port", str(self.port), *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, timeout: float = 150.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsv4 serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"dsv4 serve did not become ready in {timeout} s:\n{self.log()[-4000:]}")

    def close(self) -> None:
        """Kill whatever is left (the tests end the server themselves)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self._log.close()


class ScriptedBackend:
    """A ModelBackend with no model: zero logits, cache views advanced like the reference model does."""

    def __init__(self, cfg, delay: float = 0.0):
        self.cfg = cfg
        self.device = torch.device("cpu")
        self.delay = delay  # seconds per forward, so that streams arrive token by token
        self._fault: tuple[int, BaseException] | None = None

    def fail_in(self, n: int, error: BaseException) -> None:
        """Fault injection: the n-th forward from now (1 = the next one) raises ``error``."""
        self._fault = (n, error)

    def forward(self, token_ids, step, logits_rows=None):
        if self._fault is not None:
            n, e = self._fault
            self._fault = (n - 1, e) if n > 1 else None
            if n <= 1:
                raise e
        if self.delay:
            time.sleep(self.delay)
        for c in step.chunks:
            c.cache.advance(c.length)
        n = token_ids.shape[0] if logits_rows is None else int(logits_rows.numel())
        return SimpleNamespace(logits=torch.zeros(n, self.cfg.vocab_size))


class ScriptedSampler:
    """Emit a scripted text for prompts containing a marker (first match wins), then EOS.

    ``scripts``: list of (marker, text). A text of ``None`` makes sampling raise (fault injection).
    Prompts without a marker fall through to the real sampler. Every prompt seen is recorded.
    """

    batched_greedy = False  # every request goes through sample(), scripted or not

    def __init__(self, inner, tokenizer, scripts: list[tuple[str, str | None]]):
        self.inner = inner
        self.scripts = [(m, None if t is None else tokenizer.encode(t)) for m, t in scripts]
        self.prompts: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def sample(self, req, logits, mask=None):
        prompt = req.prompt or ""
        if not req.output_token_ids:
            self.prompts.append(prompt)
        for marker, ids in self.scripts:
            if marker in prompt:
                if ids is None:
                    raise FloatingPointError(f"request {req.request_id}: scripted sampling failure")
                i = len(req.output_token_ids)
                return (ids[i] if i < len(ids) else req.eos_token_id), None, None
        return self.inner.sample(req, logits, mask)
