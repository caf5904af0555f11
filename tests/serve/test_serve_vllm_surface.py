"""What a vLLM user reads: the periodic stats line and vLLM's metrics. In process, on a scripted back
end (no model: fast)."""

from __future__ import annotations

import logging
import re

import httpx
import pytest
from serve_test_support import ScriptedBackend, ServerThread, make_engine, metric

for _dep in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_dep)

STATS_LINE = re.compile(
    r"Engine 000: Avg prompt throughput: \d+\.\d tokens/s, Avg generation throughput: \d+\.\d tokens/s, "
    r"Running: \d+ reqs, Waiting: \d+ reqs, CPU KV cache usage: \d+\.\d%, Prefix cache hit rate: \d+\.\d%")


@pytest.fixture(scope="module")
def scripted_engine(tiny_ckpt):
    from dsv4.config import load_config

    return make_engine(tiny_ckpt, ScriptedBackend(load_config(tiny_ckpt), delay=0.02))


def _serve(engine, **options):
    from dsv4.serve.app import ServeOptions, build_app

    return ServerThread(build_app(engine, served_model_name="tiny", options=ServeOptions(**options)))


def _complete(srv, prompt="Once upon a time", max_tokens=4) -> dict:
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                     "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dsv4.serve"]


def test_stats_line_while_busy_and_disable_log_stats(scripted_engine, caplog):
    caplog.set_level(logging.INFO, logger="dsv4.serve")
    with _serve(scripted_engine, log_stats_interval=0.2) as srv:
        _complete(srv, max_tokens=40)  # 40 steps of 20 ms: several intervals
    lines = [m for m in _messages(caplog) if m.startswith("Engine 000:")]
    assert len(lines) >= 2 and all(STATS_LINE.fullmatch(m) for m in lines), lines
    assert any("Running: 1 reqs" in m and not m.startswith("Engine 000: Avg prompt throughput: 0.0 tokens/s, "
                                                          "Avg generation throughput: 0.0") for m in lines), lines
    caplog.clear()
    with _serve(scripted_engine, log_stats=False, log_stats_interval=0.2) as srv:
        _complete(srv, max_tokens=20)
    assert not [m for m in _messages(caplog) if m.startswith("Engine 000:")]


def test_vllm_metrics_count_prefix_cache_tokens_preemptions_and_phases(scripted_engine):
    with _serve(scripted_engine, log_stats=False) as srv:
        prompt = "word " * 300  # past one 256-token block: the second request hits the prefix cache
        n = _complete(srv, prompt=prompt, max_tokens=3)["usage"]["prompt_tokens"]
        _complete(srv, prompt=prompt, max_tokens=3)
        srv.on_engine(lambda e: setattr(e.scheduler, "num_preemptions", e.scheduler.num_preemptions + 2))
        srv.on_engine(lambda e: None)  # one more loop pass: published
        text = httpx.get(srv.url + "/metrics").text
    lbl = {"model_name": "tiny", "engine": "0"}
    assert metric(text, "vllm:prefix_cache_queries_total", **lbl) == 2 * n  # tokens, as vLLM counts them
    assert metric(text, "vllm:prefix_cache_hits_total", **lbl) == 256
    assert metric(text, "vllm:num_preemptions_total", **lbl) == 2
    assert metric(text, "vllm:request_success_total", finished_reason="length", **lbl) == 2
    assert metric(text, "vllm:request_prompt_tokens_sum", **lbl) == 2 * n
    assert metric(text, "vllm:request_generation_tokens_sum", **lbl) == 6
    assert metric(text, "vllm:inter_token_latency_seconds_count", **lbl) == 4  # 2 gaps per 3-token request
    for name in ("request_queue_time", "request_prefill_time", "request_decode_time", "request_inference_time",
                 "e2e_request_latency", "time_to_first_token", "request_time_per_output_token"):
        assert metric(text, f"vllm:{name}_seconds_count", **lbl) == 2, name
    # vLLM's token buckets: 1, 2, 5, … up to max_model_len (2048 here)
    les = re.findall(r'vllm:request_prompt_tokens_bucket\{[^}]*le="([^"]+)"', text)
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0", "+Inf"]
