"""Serving benchmark: start ``dsv4 serve``, wait until it is healthy, sweep ``dsv4 bench serve``, stop it.

    python bench/serve.py --model /tmp/fw4 --serve-args "--max-num-seqs 64 --max-model-len 4096" \
        --bench-args "--random-input-len 1024 --random-output-len 128 --num-prompts 96 --ignore-eos" \
        --sweep 1,16,64 --out $OUT/serve.json

    python bench/serve.py --model /tmp/fw4 --serve-args "--max-num-seqs 64 --max-model-len 66000" \
        --sweep "" --contention 16:65536 --out $OUT/contention.json

Prints the startup time (process start to a healthy ``/health``, and the engine's phases from its log),
the Triton kernels compiled after ``/health`` (``dsv4:kernel_compiles``: must stay 0 while serving) and
the sweep's table (output tok/s, TTFT, TPOT per concurrency); ``--out`` gets both as JSON, with the
server's log tail.

``--contention STREAMS:LONG``: STREAMS streams decode (256-token prompts, 2048 tokens out) when a
LONG-token prompt arrives, then a short one (64 tokens): the streams' worst gap between two tokens
while the long prompt is prefilled, and the short request's time to first token — what the
scheduler's contention cap (``long_prefill_token_threshold``) is for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kernel_compiles(url: str) -> float | None:
    """The server's ``dsv4:kernel_compiles`` gauge (None when /metrics does not have it)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("dsv4:kernel_compiles "):
                return float(line.split()[1])
    return None


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"dsv4 serve exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"dsv4 serve was not healthy after {timeout:.0f} s")


async def _stream(client, url: str, ids: list[int], max_tokens: int, times: list[float]) -> None:
    """One streamed completion; the arrival time of every chunk that carries text is appended to ``times``."""
    body = {"model": "bench", "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    times.append(time.monotonic())


async def contention(url: str, streams: int, long_len: int, out: int = 2048, vocab: int = 50000) -> dict:
    """See the module docstring: worst decode gap of ``streams`` streams while a ``long_len``-token
    prompt is prefilled, and the TTFT of a short request sent right after it."""
    import httpx

    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    async with httpx.AsyncClient(timeout=600) as client:
        times = [[] for _ in range(streams)]
        decoding = [asyncio.create_task(_stream(client, url, ids(256), out, t)) for t in times]
        while min(len(t) for t in times) < 8:  # every stream is decoding
            for d in decoding:
                if d.done():
                    d.result()  # (a stream that failed raises here)
            await asyncio.sleep(0.01)
        long_t, short_t = [], []
        t_long = time.monotonic()
        long_task = asyncio.create_task(_stream(client, url, ids(long_len), 1, long_t))
        await asyncio.sleep(0.05)
        t_short = time.monotonic()
        await _stream(client, url, ids(64), 1, short_t)
        await long_task
        t_done = long_t[0]
        await asyncio.gather(*decoding)
    gaps = [b - a for t in times for a, b in zip(t, t[1:]) if b > t_long and a < t_done]
    steady = [b - a for t in times for a, b in zip(t, t[1:]) if b <= t_long]
    return {"streams": streams, "long_prompt_tokens": long_len, "long_ttft_s": round(t_done - t_long, 3),
            "short_ttft_s": round(short_t[0] - t_short, 3), "worst_gap_s": round(max(gaps), 3),
            "median_gap_during_s": round(sorted(gaps)[len(gaps) // 2], 4),
            "median_gap_before_s": round(sorted(steady)[len(steady) // 2], 4) if steady else None}


def startup_phases(log_text: str) -> str | None:
    """The engine's own start-up line (its phases) from the server log."""
    lines = [ln for ln in log_text.splitlines() if "engine started in" in ln or "precompile:" in ln]
    return " | ".join(ln.split("dsv4.engine: ")[-1] for ln in lines) or None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="model directory")
    ap.add_argument("--serve-args", default="", help="extra `dsv4 serve` flags (one string)")
    ap.add_argument("--bench-args", default="--random-input-len 1024 --random-output-len 128 --num-prompts 96 "
                    "--ignore-eos", help="`dsv4 bench serve` flags (one string)")
    ap.add_argument("--sweep", default="1,16,64", help="concurrencies")
    ap.add_argument("--contention", default=None, metavar="STREAMS:LONG",
                    help="after the sweep: STREAMS decoding streams, then a LONG-token prompt and a short one")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(a.out).with_suffix(".server.log") if a.out else Path("/tmp/dsv4_bench_serve.log")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "dsv4.cli", "serve", "--model", a.model, "--port", str(port),
           "--served-model-name", "bench", *shlex.split(a.serve_args)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            startup = wait_healthy(url, proc, a.startup_timeout)
            compiles_at_health = kernel_compiles(url)
            print(f"healthy after {startup:.1f} s ({' '.join(cmd[2:])}); kernel compiles so far: "
                  f"{compiles_at_health}", flush=True)
            print(f"engine: {startup_phases(log_path.read_text())}", flush=True)
            result = Path(log_path).with_suffix(".bench.json")
            rc = 0
            if a.sweep:
                bench = [sys.executable, "-m", "dsv4.cli", "bench", "serve", "--base-url", url, "--model", "bench",
                         "--sweep-concurrency", a.sweep, "--result-json", str(result), *shlex.split(a.bench_args)]
                rc = subprocess.run(bench, env=env).returncode
            cont = None
            if a.contention:
                n, long_len = (int(v) for v in a.contention.split(":"))
                cont = asyncio.run(contention(url, n, long_len))
                print(f"contention: {json.dumps(cont)}", flush=True)
            compiles_after = kernel_compiles(url)
            grew = None if compiles_after is None else compiles_after - compiles_at_health
            print(f"kernel compiles while serving: {grew} (at /health {compiles_at_health}, "
                  f"after the sweep {compiles_after})", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if a.out:
        report = {"startup_s": round(startup, 1), "serve_cmd": cmd[2:], "bench_rc": rc, "contention": cont,
                  "engine_startup": startup_phases(log_path.read_text()),
                  "kernel_compiles_at_health": compiles_at_health, "kernel_compiles_after_sweep": compiles_after,
                  "bench": json.loads(result.read_text()) if result.exists() else None,
                  "server_log_tail": log_path.read_text().splitlines()[-60:]}
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
