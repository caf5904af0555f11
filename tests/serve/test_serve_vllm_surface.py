"""What a vLLM user types and reads: ``vllm serve``'s flags (accepted, or refused saying why), no
abbreviated flags, the periodic stats line, request logging, vLLM's metrics, ``--generation-config``,
and the served model's name. In process, on a scripted back end (no model: fast)."""

from __future__ import annotations

import json
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


def test_request_logging_flags(scripted_engine, caplog):
    caplog.set_level(logging.INFO, logger="dsv4.serve")
    with _serve(scripted_engine, log_stats=False) as srv:  # the default: one line per request, no prompts
        _complete(srv)
    assert [m for m in _messages(caplog) if m.startswith("request id=cmpl-")]
    assert not [m for m in _messages(caplog) if m.startswith("Received request")]
    caplog.clear()
    with _serve(scripted_engine, log_stats=False, log_requests=False) as srv:  # --disable-log-requests
        _complete(srv)
    assert not [m for m in _messages(caplog) if m.startswith(("request id=", "Received request"))]
    caplog.clear()
    with _serve(scripted_engine, log_stats=False, log_prompts=True, max_log_len=6) as srv:  # --enable-log-requests
        _complete(srv, prompt="Once upon a time, in a land far away, there lived a king")
    received = [m for m in _messages(caplog) if m.startswith("Received request")]
    assert len(received) == 1 and "prompt: 'Once u'," in received[0] and "params: SamplingParams(" in received[0]
    ids = json.loads(received[0].split("prompt_token_ids: ")[1])
    assert len(ids) == 6  # cut to --max-log-len too


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


def test_served_name_defaults_to_the_directory_name(scripted_engine, tiny_ckpt):
    """(The embedded canary, served as dsv4-canary: tests/serve/test_serve_lifecycle.py.)"""
    from pathlib import Path

    from dsv4.serve.app import ServeOptions, build_app

    with ServerThread(build_app(scripted_engine, options=ServeOptions(max_body_bytes=2000))) as srv:
        too_big = httpx.post(srv.url + "/v1/completions", json={"prompt": "x" * 3000, "max_tokens": 1})
        assert too_big.status_code == 413  # --max-request-body-mb reaches the server
        ids = [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
        _ = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
        text = httpx.get(srv.url + "/metrics").text
    assert ids == [Path(tiny_ckpt).name]
    assert f'model_name="{Path(tiny_ckpt).name}"' in text and str(tiny_ckpt) not in text


def test_generation_config_auto_vllm_or_a_directory(tmp_path):
    from dsv4.serve.app import generation_defaults

    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "eos_token_id": 1}))
    (other / "generation_config.json").write_text(json.dumps({"top_k": 20}))
    assert generation_defaults(str(model)) == {"temperature": 0.6, "top_p": 0.95}
    assert generation_defaults(str(model), "auto") == {"temperature": 0.6, "top_p": 0.95}
    assert generation_defaults(str(model), "vllm") == {}
    assert generation_defaults(str(model), str(other)) == {"top_k": 20}
    assert generation_defaults(str(other / "nothing-here")) == {}  # auto without the file: no defaults
    with pytest.raises(ValueError, match="--generation-config .*not 'auto', 'vllm' or a directory"):
        generation_defaults(str(model), str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--generation-config .*no generation_config.json"):
        generation_defaults(str(model), str(tmp_path))


def test_vllm_serve_flags_are_accepted():
    from dsv4.cli import build_parser

    a = build_parser().parse_args(
        ["serve", "/m", "--disable-log-requests", "--max-log-len", "100", "--disable-log-stats",
         "--enable-chunked-prefill", "--generation-config", "vllm", "--tokenizer", "/t/tokenizer.json",
         "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}', "--shutdown-timeout", "2",
         "--engine-stall-timeout", "0"])
    assert a.disable_log_requests and a.max_log_len == 100 and a.disable_log_stats and a.enable_chunked_prefill
    assert a.generation_config == "vllm" and a.tokenizer == "/t/tokenizer.json" and a.tokenizer_mode == "deepseek_v4"
    assert a.speculative_config == {"method": "mtp", "num_speculative_tokens": 1}
    assert (a.shutdown_timeout, a.engine_stall_timeout) == (2.0, 0.0)
    assert build_parser().parse_args(["serve", "--enable-log-requests"]).enable_log_requests


@pytest.mark.parametrize("argv, says", [
    (["--no-enable-chunked-prefill"], "chunked prefill is always on"),
    (["--chat-template", "t.jinja"], "--tokenizer-mode deepseek_v4"),
    (["--enable-log-requests", "--disable-log-requests"], "give one of them"),
    (["--max-log-len", "-1"], "--max-log-len must be ≥ 0"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be ≥ 0"),
    (["--log-stats-interval", "0"], "--log-stats-interval must be positive"),
    (["--max-request-body-mb", "0"], "--max-request-body-mb must be positive"),
    (["--generation-config", "/no/such/dir"], "--generation-config /no/such/dir"),
])
def test_serve_flags_that_cannot_apply_say_why(argv, says, capsys, tiny_ckpt):
    from dsv4.cli import main

    assert main(["serve", str(tiny_ckpt), "--port", "0", *argv]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["serve", "--tokenizer-mod", "deepseek_v4"],
    ["serve", "--max-model", "100"],
    ["generate", "--prompt", "x", "--max-tok", "3"],
    ["bench", "serve", "--model", "m", "--random-input", "5"],
    ["eval", "canary", "--per", "3"],
])
def test_abbreviated_flags_are_refused(argv, capsys):
    from dsv4.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "unrecognized arguments" in capsys.readouterr().err
