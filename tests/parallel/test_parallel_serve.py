"""``dsv4 serve --tensor-parallel-size 2`` (± ``--enable-expert-parallel``), ``dsv4 serve
--data-parallel-size 2 --enable-expert-parallel`` and both (``-tp 2 -dp 2``) as real subprocesses:
the same greedy tokens as one process, a clean SIGTERM shutdown, and a killed rank makes the server
answer with an error and exit non-zero instead of hanging."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from parallel_helpers import ServeProcess, gone, prompts, served_tokens

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


def _check_rank_metrics(srv: ServeProcess) -> None:
    """/metrics per data-parallel rank (vLLM's ``engine`` label): each rank computed one prompt."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def value(name: str, engine: str) -> float | None:
        got = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and s.labels.get("engine") == engine]
        return sum(got) if got else None

    text = httpx.get(srv.url + "/metrics", timeout=10).text
    for rank in ("0", "1"):
        assert value("vllm:prefix_cache_queries_total", rank) > 0, text
        assert value("vllm:num_requests_running", rank) == 0 and value("vllm:kv_cache_usage_perc", rank) is not None
    assert value("vllm:num_requests_running", "2") is None


def _check_greedy(srv: ServeProcess, expected_texts: list[list[str]]) -> None:
    """The two shorter prompts (the long one and the prefix-cache replay are covered through LLM,
    in tests/parallel/test_dist_llm.py; each costs seconds of CPU per server here)."""
    for ids, want in zip(prompts()[:2], expected_texts[:2]):
        assert served_tokens(srv.complete(ids)) == want


def test_serve_tp2_then_a_killed_worker_stops_the_server(tiny_ckpt, tp1_reference, tmp_path):
    srv = ServeProcess(tiny_ckpt, tmp_path / "serve.log", "--tensor-parallel-size", "2")
    try:
        srv.wait_ready()
        log = srv.log()
        assert "rank 1 (node 0" in log and "peak host RSS" in log  # the per-rank startup report
        _check_greedy(srv, tp1_reference[1])
        pid = srv.worker_pids()[1]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        r = srv.complete(prompts()[0], timeout=60)
        assert r.status_code == 500, r.text
        # the body names the request; why it failed (with the peer's rank and pid) is in the server log only
        msg = r.json()["error"]["message"]
        m = re.fullmatch(r"internal error while running request (\S+); see the server log", msg)
        assert m is not None, msg
        assert srv.proc.wait(60) == 1
        assert time.monotonic() - t0 < 60
        failed = [ln for ln in srv.log().splitlines() if f"request {m.group(1)} failed" in ln]
        assert failed and "the engine died" in failed[0], srv.log()[-3000:]
        assert f"worker rank 1 (pid {pid}) exited with code -9" in failed[0], failed
        assert "exiting because the engine died" in srv.log()
    finally:
        srv.close()


def test_serve_tp2_expert_parallel(tiny_ckpt, tp1_reference, tmp_path):
    srv = ServeProcess(tiny_ckpt, tmp_path / "serve.log", "-tp", "2", "--enable-expert-parallel")
    try:
        srv.wait_ready()
        assert "routed experts split by expert" in srv.log()
        _check_greedy(srv, tp1_reference[1])
        pids = srv.worker_pids()
    finally:
        code = srv.close()
    # SIGTERM: uvicorn shuts down and re-raises the signal (-15); the workers were stopped first, cleanly
    assert code in (0, -signal.SIGTERM), srv.log()[-3000:]
    assert "failed" not in srv.log() and "Traceback" not in srv.log(), srv.log()[-3000:]
    for pid in pids.values():
        try:
            os.kill(pid, 0)
            raise AssertionError(f"worker pid {pid} outlived the server")
        except ProcessLookupError:
            pass


def test_serve_dp2_expert_parallel_then_a_killed_rank_stops_the_server(tiny_ckpt, tp1_reference, tmp_path):
    """The two prompts land on both ranks (one each, sent together); then rank 1 is killed."""
    import concurrent.futures

    srv = ServeProcess(tiny_ckpt, tmp_path / "serve.log", "-dp", "2", "--enable-expert-parallel")
    try:
        srv.wait_ready()
        log = srv.log()
        assert "data-parallel rank 1 (pid" in log and "KV cache" in log and "peak host RSS" in log, log[-3000:]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            resps = list(pool.map(srv.complete, prompts()[:2]))
        assert [served_tokens(r) for r in resps] == tp1_reference[1][:2]
        _check_rank_metrics(srv)
        pid = srv.worker_pids()[1]
        os.kill(pid, signal.SIGKILL)
        r = srv.complete(prompts()[0], timeout=60)
        assert r.status_code == 500, r.text
        # as under TP: the body names the request, the server log says why (the rank, its pid and exit code)
        msg = r.json()["error"]["message"]
        m = re.fullmatch(r"internal error while running request (\S+); see the server log", msg)
        assert m is not None, msg
        assert srv.proc.wait(60) == 1
        failed = [ln for ln in srv.log().splitlines() if f"request {m.group(1)} failed" in ln]
        assert failed and "the engine died" in failed[0], srv.log()[-3000:]
        assert f"data-parallel rank 1 (pid {pid}) exited with code -9" in failed[0], failed
        assert "exiting because the engine died" in srv.log()
    finally:
        srv.close()


def test_serve_tp2_inside_dp2_then_a_clean_shutdown(tiny_ckpt, tp1_reference, tmp_path):
    """Four processes: the two prompts land on both data-parallel ranks, /metrics reports each rank,
    and SIGTERM stops every process without an error (each leader stops its group's plan loop
    before the process group goes)."""
    import concurrent.futures

    srv = ServeProcess(tiny_ckpt, tmp_path / "serve.log", "-tp", "2", "-dp", "2", "--enable-expert-parallel")
    try:
        srv.wait_ready()
        log = srv.log()
        assert "data-parallel rank 1 tensor-parallel rank 1 (pid" in log and "mirrors its leader's" in log, log[-3000:]
        pids = srv.worker_pids()
        assert sorted(pids) == [1, 2, 3], log[-3000:]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            resps = list(pool.map(srv.complete, prompts()[:2]))
        assert [served_tokens(r) for r in resps] == tp1_reference[1][:2]
        _check_rank_metrics(srv)
    finally:
        code = srv.close()
    assert code in (0, -signal.SIGTERM), srv.log()[-3000:]
    assert "failed" not in srv.log() and "Traceback" not in srv.log(), srv.log()[-3000:]
    for pid in pids.values():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not gone(pid):
            time.sleep(0.2)
        assert gone(pid), f"process {pid} outlived the server"
