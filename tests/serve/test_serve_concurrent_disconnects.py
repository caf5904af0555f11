"""32 concurrent streaming clients share one engine; 8 hang up mid-stream.

The 24 others must finish normally, the 8 must be aborted (not run to their long max_tokens),
and afterwards the KV cache books must balance (``engine.kv.leaks()`` empty) with the server still
answering.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
from serve_test_support import metric

for _dep in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_dep)

N_CLIENTS, N_DISCONNECT = 32, 8
SHORT, LONG = 5, 400  # a disconnecting client asks for LONG tokens: finishing it would take minutes


async def _client(url: str, i: int, hang_up: bool) -> dict:
    chat = i % 2 == 0
    body = {"model": "tiny", "max_tokens": LONG if hang_up else SHORT, "stream": True, "temperature": 0.8,
            "seed": i, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Client {i} says hello"}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = f"Client {i} says hello"
        path = "/v1/completions"
    events, finish = [], None
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", url + path, json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                events.append(ev)
                for c in ev.get("choices", []):
                    finish = c.get("finish_reason") or finish
                has_tokens = any((c.get("text") or c.get("delta", {}).get("content")
                                  or c.get("delta", {}).get("reasoning_content")) for c in ev.get("choices", []))
                if hang_up and has_tokens:
                    return {"i": i, "hung_up": True}  # leaving the block closes the connection
    return {"i": i, "hung_up": False, "finish": finish, "usage": events[-1].get("usage")}


async def _run_all(url: str) -> list[dict]:
    hang = set(range(3, N_CLIENTS, N_CLIENTS // N_DISCONNECT))  # 8 clients spread over both endpoints
    assert len(hang) == N_DISCONNECT
    return await asyncio.gather(*(_client(url, i, i in hang) for i in range(N_CLIENTS)))


def _count_aborts(srv) -> float:
    return metric(httpx.get(srv.url + "/metrics").text, "vllm:request_success_total", finished_reason="abort")


def test_concurrent_streams_with_disconnects(real_server, caplog):
    caplog.set_level(logging.INFO, logger="dsv4.serve")
    aborted_before = real_server.async_engine.stats.aborted
    t0 = time.monotonic()
    results = asyncio.run(_run_all(real_server.url))
    done = [r for r in results if not r["hung_up"]]
    assert len(done) == N_CLIENTS - N_DISCONNECT
    for r in done:
        assert r["finish"] == "length", r
        assert r["usage"]["completion_tokens"] == SHORT, r
    real_server.wait_idle(timeout=120)
    elapsed = time.monotonic() - t0
    assert real_server.async_engine.stats.aborted - aborted_before == N_DISCONNECT
    assert real_server.on_engine(lambda e: e.kv.leaks()) == []
    assert real_server.on_engine(lambda e: (len(e.scheduler.running), len(e.scheduler.waiting))) == (0, 0)
    # the server still answers, and the aborted requests did not run to LONG tokens
    r = httpx.post(real_server.url + "/v1/completions", json={"model": "tiny", "prompt": "still here?",
                                                               "max_tokens": 2, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    gen = metric(httpx.get(real_server.url + "/metrics").text, "vllm:generation_tokens_total")
    assert gen < N_CLIENTS * SHORT + N_DISCONNECT * 40, (gen, elapsed)
    # the metrics counted the hang-ups as aborted requests, the request log as 499 (client closed request)
    assert _count_aborts(real_server) == N_DISCONNECT
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        hung_up = [r for r in caplog.records if r.getMessage().startswith("request id=") and "status=499" in
                   r.getMessage()]
        if len(hung_up) >= N_DISCONNECT:
            break
        time.sleep(0.1)
    assert len(hung_up) == N_DISCONNECT
    assert real_server.on_engine(lambda e: e.kv.leaks()) == []


def test_non_streaming_client_that_gives_up_is_aborted(real_server):
    """A non-streaming request whose client times out is dropped at once, not generated to the end."""
    aborted = real_server.async_engine.stats.aborted
    body = {"model": "tiny", "prompt": "long story", "max_tokens": LONG, "ignore_eos": True}
    try:
        httpx.post(real_server.url + "/v1/completions", json=body, timeout=3)
        raise AssertionError("expected a client timeout")
    except httpx.TimeoutException:
        pass
    real_server.wait_idle(timeout=60)  # LONG tokens would take minutes
    assert real_server.async_engine.stats.aborted == aborted + 1
    assert real_server.on_engine(lambda e: e.kv.leaks()) == []
