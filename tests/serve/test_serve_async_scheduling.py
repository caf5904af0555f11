"""The OpenAI server over an engine with async scheduling: concurrent greedy streams give the same
texts and finish reasons as over the synchronous engine, a client hanging up mid-stream is aborted
(its in-flight step dropped), and the KV cache books balance afterwards."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

for _dep in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_dep)

MAX_TOKENS = (1, 3, 6, 9, 12, 4)


async def _stream(url: str, i: int, hang_up: bool = False) -> dict:
    body = {"model": "tiny", "prompt": f"async client {i} says hello", "max_tokens": 200 if hang_up else MAX_TOKENS[i],
            "temperature": 0, "ignore_eos": True, "stream": True}
    text, finish = "", None
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                for c in ev.get("choices", []):
                    text += c.get("text") or ""
                    finish = c.get("finish_reason") or finish
                if hang_up and text:
                    return {"i": i, "hung_up": True}
    return {"i": i, "text": text, "finish": finish}


async def _all(url: str, hang: set[int]) -> list[dict]:
    return await asyncio.gather(*(_stream(url, i, i in hang) for i in range(len(MAX_TOKENS))))


def _serve(tiny_ckpt, serve_model, **kw):
    from serve_test_support import ServerThread, make_engine

    from dsv4.serve import build_app

    return ServerThread(build_app(make_engine(tiny_ckpt, serve_model, **kw), served_model_name="tiny"))


def test_async_scheduling_server_matches_sync(tiny_ckpt, serve_model):
    with _serve(tiny_ckpt, serve_model) as srv:
        want = asyncio.run(_all(srv.url, set()))
    with _serve(tiny_ckpt, serve_model, async_scheduling=True) as srv:
        got = asyncio.run(_all(srv.url, set()))
        assert got == want
        assert all(r["finish"] == "length" for r in got)
        assert srv.on_engine(lambda e: e.num_overlapped_steps) > 0
        hung = asyncio.run(_all(srv.url, {2}))  # one client leaves mid-stream
        assert hung[2]["hung_up"] and [r for r in hung if r["i"] != 2] == [r for r in want if r["i"] != 2]
        srv.wait_idle(timeout=120)
        assert srv.on_engine(lambda e: e.kv.leaks()) == []
        assert srv.on_engine(lambda e: (len(e.scheduler.running), len(e.scheduler.waiting))) == (0, 0)
