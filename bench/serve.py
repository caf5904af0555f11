"""Serving benchmark: start ``dsv4 serve``, wait until it is healthy, sweep ``dsv4 bench serve``, stop it.

    python bench/serve.py --model /tmp/fw4 --serve-args "--max-num-seqs 64 --max-model-len 4096" \
        --bench-args "--random-input-len 1024 --random-output-len 128 --num-prompts 96 --ignore-eos" \
        --sweep 1,16,64 --out $OUT/serve.json

Prints the startup time (process start to a healthy ``/health``), the Triton kernels compiled after
``/health`` (``dsv4:kernel_compiles``: must stay 0 while serving) and the sweep's table (output tok/s,
TTFT, TPOT per concurrency); ``--out`` gets both as JSON, with the server's log tail.
"""

from __future__ import annotations

import argparse
import json
import os
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="model directory")
    ap.add_argument("--serve-args", default="", help="extra `dsv4 serve` flags (one string)")
    ap.add_argument("--bench-args", default="--random-input-len 1024 --random-output-len 128 --num-prompts 96 "
                    "--ignore-eos", help="`dsv4 bench serve` flags (one string)")
    ap.add_argument("--sweep", default="1,16,64", help="concurrencies")
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
            result = Path(log_path).with_suffix(".bench.json")
            bench = [sys.executable, "-m", "dsv4.cli", "bench", "serve", "--base-url", url, "--model", "bench",
                     "--sweep-concurrency", a.sweep, "--result-json", str(result), *shlex.split(a.bench_args)]
            rc = subprocess.run(bench, env=env).returncode
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
        report = {"startup_s": round(startup, 1), "serve_cmd": cmd[2:], "bench_rc": rc,
                  "kernel_compiles_at_health": compiles_at_health, "kernel_compiles_after_sweep": compiles_after,
                  "bench": json.loads(result.read_text()) if result.exists() else None,
                  "server_log_tail": log_path.read_text().splitlines()[-60:]}
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
