"""Start, liveness and shutdown of ``dsv4 serve`` as a real process on loopback: SIGTERM drains for
``--shutdown-timeout`` and then ends the open streams with an error event and ``[DONE]``; a taken
port fails before the model loads; Ctrl-C exits quietly; the canary is served as ``dsv4-canary``.
And ``/health`` answers 503 while the engine makes no progress (in process: a back end that blocks
the way a collective of a stopped tensor-parallel rank does)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_test_support import ScriptedBackend, ServeProcess, ServerThread, make_engine

for _dep in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_dep)

N_STREAMS, GRACE = 8, 1.0


async def _stream(url: str, i: int, started: asyncio.Queue) -> list[str]:
    body = {"model": "tiny", "prompt": f"stream {i}", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    lines = []
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line:
                    if not lines:
                        started.put_nowait(i)
                    lines.append(line)
    return lines


def test_sigterm_drains_for_the_grace_period_then_ends_every_stream(tiny_ckpt, tmp_path):
    srv = ServeProcess(tmp_path / "serve.log", str(tiny_ckpt), "--served-model-name", "tiny", "--kv-cache-memory",
                       "256", "--max-model-len", "4096", "--shutdown-timeout", str(GRACE))
    try:
        srv.wait_ready()

        async def run():
            started: asyncio.Queue = asyncio.Queue()
            tasks = [asyncio.ensure_future(_stream(srv.url, i, started)) for i in range(N_STREAMS)]
            for _ in range(N_STREAMS):  # every stream is generating
                await asyncio.wait_for(started.get(), 120)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            return time.monotonic() - t0, results

        elapsed, results = asyncio.run(run())
        code = srv.proc.wait(30)
    finally:
        srv.close()
    for lines in results:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        err = json.loads(lines[-2][len("data: "):])["error"]
        assert "the server is shutting down" in err["message"], err
        assert len(lines) > 3  # tokens were streamed before the end
    assert GRACE <= elapsed < GRACE + 8, elapsed  # the grace period, then at most a step and the sending
    assert code in (0, -signal.SIGTERM), code  # uvicorn re-raises the SIGTERM it handled
    log = srv.log()
    assert f"stopped {N_STREAMS} request(s) still running after {GRACE:g} s" in log
    assert "Traceback" not in log, log[-3000:]


def test_a_taken_port_fails_before_the_model_loads(tiny_ckpt):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "dsv4.cli", "serve", str(tiny_ckpt), "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert f"dsv4 serve: error: --port {port}: cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "dsv4 engine" not in r.stdout + r.stderr and "listening" not in r.stdout + r.stderr  # nothing loaded
    assert "Traceback" not in r.stderr


def test_the_canary_is_served_by_name_and_ctrl_c_exits_quietly(tmp_path):
    from dsv4.canary import CANARY_DIR

    srv = ServeProcess(tmp_path / "serve.log", "--kv-cache-memory", "64", "--max-model-len", "1024")
    try:
        srv.wait_ready()
        models = httpx.get(srv.url + "/v1/models").json()["data"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "dsv4-canary", "prompt": "1+1=", "max_tokens": 2},
                       timeout=60)
        metrics = httpx.get(srv.url + "/metrics").text
        srv.proc.send_signal(signal.SIGINT)
        code = srv.proc.wait(60)
    finally:
        srv.close()
    assert [(m["id"], m["root"]) for m in models] == [("dsv4-canary", "dsv4-canary")]
    assert r.status_code == 200, r.text
    assert 'model_name="dsv4-canary"' in metrics and str(CANARY_DIR) not in metrics
    assert code == 130
    log = srv.log()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]


class _Gate(ScriptedBackend):
    """A back end whose forward waits while the gate is closed (a rank that stopped mid-collective)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.open, self.waiting = threading.Event(), threading.Event()
        self.open.set()

    def forward(self, *args, **kwargs):
        if not self.open.is_set():
            self.waiting.set()
            self.open.wait()
        return super().forward(*args, **kwargs)


def _health_until(url: str, status: int, timeout: float) -> float:
    t0 = time.monotonic()
    while httpx.get(url + "/health").status_code != status:
        assert time.monotonic() - t0 < timeout, f"/health did not turn {status} in {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_health_is_503_while_the_engine_makes_no_progress(tiny_ckpt):
    from dsv4.config import load_config
    from dsv4.serve.app import ServeOptions, build_app

    backend = _Gate(load_config(tiny_ckpt))
    app = build_app(make_engine(tiny_ckpt, backend), served_model_name="tiny",
                    options=ServeOptions(engine_stall_timeout=0.5, log_stats=False))
    with ServerThread(app) as srv:
        time.sleep(1.0)  # idle for longer than the timeout: an idle engine is healthy
        assert httpx.get(srv.url + "/health").status_code == 200
        backend.open.clear()
        done = []
        client = threading.Thread(target=lambda: done.append(httpx.post(
            srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)), daemon=True)
        client.start()
        assert backend.waiting.wait(30)
        assert _health_until(srv.url, 503, 10) < 5
        assert srv.async_engine.health().startswith("the engine has made no progress for")
        assert "1 request(s) in flight" in srv.async_engine.health()
        backend.open.set()
        client.join(30)
        assert done and done[0].status_code == 200
        _health_until(srv.url, 200, 5)


def test_an_idle_engine_left_unscheduled_stays_healthy(tiny_ckpt):
    """On a loaded host the idle loop's wait can overrun the stall timeout; with nothing in flight that is not
    a stall (a request arriving then is timed from when the loop picks it up)."""
    from dsv4.config import load_config
    from dsv4.serve.app import ServeOptions, build_app

    app = build_app(make_engine(tiny_ckpt, ScriptedBackend(load_config(tiny_ckpt))), served_model_name="tiny",
                    options=ServeOptions(engine_stall_timeout=0.5, log_stats=False))
    with ServerThread(app) as srv:
        srv.async_engine._beat -= 60  # as if the engine thread had not run for a minute
        assert srv.async_engine.health() is None
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200


def test_a_stopped_tensor_parallel_rank_turns_health_503(tiny_ckpt, tmp_path):
    """The case the in-process test stands for: rank 1 stopped (SIGSTOP), the driver's step waits in a
    collective (up to --distributed-timeout); /health says so within --engine-stall-timeout."""
    import os
    import re

    srv = ServeProcess(tmp_path / "serve.log", str(tiny_ckpt), "--served-model-name", "tiny", "-tp", "2", "--dtype",
                       "float32", "--kv-cache-dtype", "auto", "--max-model-len", "1024", "--max-num-seqs", "8",
                       "--kv-cache-memory", "256", "--engine-stall-timeout", "2")
    try:
        srv.wait_ready()
        pid = int(re.findall(r"started tensor-parallel worker rank 1, pid (\d+)", srv.log())[0])
        os.kill(pid, signal.SIGSTOP)
        done = []
        client = threading.Thread(target=lambda: done.append(httpx.post(
            srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=120)),
            daemon=True)
        client.start()
        assert 1.5 < _health_until(srv.url, 503, 30) < 15
        os.kill(pid, signal.SIGCONT)
        client.join(60)
        assert done and done[0].status_code == 200, done
        _health_until(srv.url, 200, 10)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        srv.close()
