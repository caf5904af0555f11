"""``dsv4 bench serve`` against a real server (the tiny model on 127.0.0.1) and on synthetic timings."""

from __future__ import annotations

import json

import pytest

from dsv4.cli import main
from dsv4.validate.bench import RequestResult, calculate_metrics, format_table, spec_counters, spec_decode_metrics

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

TABLE_ROWS = ["Successful requests:", "Failed requests:", "Maximum request concurrency:", "Benchmark duration (s):",
              "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
              "Output token throughput (tok/s):", "Peak output token throughput (tok/s):", "Peak concurrent requests:",
              "Total token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
              "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "Median ITL (ms):",
              "P99 ITL (ms):"]


@pytest.fixture(scope="module")
def server(tiny_ckpt, validate_model):
    from validate_test_support import ServerThread

    from dsv4.engine.engine import EngineConfig, LLMEngine
    from dsv4.serve import build_app

    engine = LLMEngine(EngineConfig(model=str(tiny_ckpt), kv_cache_memory=128 << 20, max_model_len=256, max_num_seqs=8),
                       model=validate_model)
    with ServerThread(build_app(engine, served_model_name="tiny")) as srv:
        yield srv


def bench(url, *extra):
    return ["bench", "serve", "--base-url", url, "--model", "tiny", "--dataset", "random", "--random-input-len", "8",
            "--random-output-len", "3", "--ignore-eos", "--seed", "0", *extra]


def test_bench_serve_against_the_tiny_server(server, tmp_path, capsys):
    res = tmp_path / "bench.json"
    rc = main(bench(server.url, "--num-prompts", "4", "--max-concurrency", "2", "--result-json", str(res)))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "prompts: 4 random (server /detokenize)" in out
    table = out[out.index("=" * 12 + " Serving Benchmark Result " + "=" * 12):]
    lines = table.splitlines()
    assert [ln[:40].rstrip() for ln in lines if ln[:40].rstrip() in TABLE_ROWS] == TABLE_ROWS
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "Speculative Decoding" not in out  # (the server does not speculate)
    assert any(ln.startswith("Successful requests:") and ln.split()[-1] == "4" for ln in lines)
    d = json.loads(res.read_text())
    assert d["completed"] == 4 and d["failed"] == 0 and d["total_output_tokens"] == 4 * 3
    assert d["max_concurrency"] == 2 and d["max_concurrent_requests"] <= 2
    assert all(n > 0 for n in d["input_lens"]) and d["output_lens"] == [3] * 4
    assert d["median_ttft_ms"] > 0 and d["mean_tpot_ms"] > 0 and len(d["itls"][0]) == 2


def test_bench_serve_sweep_prints_a_summary(server, capsys):
    rc = main(bench(server.url, "--num-prompts", "2", "--sweep-concurrency", "1,2", "--no-warmup",
                    "--random-output-len", "2"))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count(" Serving Benchmark Result ") == 2
    assert "Max concurrency  Successful  Failed  Output tok/s" in out


def test_bench_serve_counts_failures(server, capsys):
    assert main(bench(server.url, "--num-prompts", "2", "--model", "no-such-model")) == 1
    assert "initial test run failed: HTTP 404" in capsys.readouterr().out
    rc = main(bench(server.url, "--num-prompts", "2", "--no-warmup", "--request-timeout", "0.001"))
    out = capsys.readouterr().out
    assert rc == 1 and "Failed requests:                         2" in out


def test_metrics_and_table_on_synthetic_timings():
    rs = [
        RequestResult(True, 10, 3, ttft=0.1, latency=0.3, itl=[0.1, 0.1], start=0.0, chunk_times=[0.1, 0.2, 0.3]),
        RequestResult(
            True, 20, 5, ttft=0.2, latency=1.0, itl=[0.2] * 4, start=0.5, chunk_times=[0.7, 0.9, 1.1, 1.3, 1.5]
        ),
        RequestResult(False, 7, 0, start=0.6, latency=0.1, error="HTTP 500"),
    ]
    m = calculate_metrics(rs, duration=2.0, percentiles=(50.0, 99.0))
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 8)
    assert m["output_throughput"] == 4.0 and m["total_token_throughput"] == 19.0
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["median_ttft_ms"] == pytest.approx(150.0)
    assert m["mean_tpot_ms"] == pytest.approx((100.0 + 200.0) / 2)
    assert m["p50_itl_ms"] == pytest.approx(200.0) and m["max_concurrent_requests"] == 2.0
    assert m["max_output_tokens_per_s"] == 5.0  # chunks at 0.1-0.9 s fall in the first second
    t = format_table(m, 2.0, 4, float("inf"), ("ttft", "tpot", "itl"), (99.0,))
    assert t.splitlines()[0] == "============ Serving Benchmark Result ============"
    assert "Maximum request concurrency:             4" in t and t.splitlines()[-1] == "=" * 50


SPEC_PAGE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}
vllm:spec_decode_num_drafts_created{{engine="0",model_name="m"}} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {tokens}
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p1}
vllm:generation_tokens_total{{engine="0",model_name="m"}} 99.0
"""


def test_spec_decode_acceptance_from_counter_deltas():
    before = spec_counters(SPEC_PAGE.format(drafts=10.0, tokens=20.0, accepted=5.0, p0=4.0, p1=1.0))
    after = spec_counters(SPEC_PAGE.format(drafts=50.0, tokens=100.0, accepted=65.0, p0=36.0, p1=29.0))
    m = spec_decode_metrics(before, after)
    counts = (m["spec_decode_num_drafts"], m["spec_decode_draft_tokens"], m["spec_decode_accepted_tokens"])
    assert counts == (40, 80, 60)
    assert m["spec_decode_acceptance_rate"] == 75.0 and m["spec_decode_acceptance_length"] == 2.5
    assert m["spec_decode_per_position_acceptance_rates"] == [0.8, 0.7]
    t = format_table({**calculate_metrics([], 1.0), **m}, 1.0, None, float("inf"))
    assert "---------------Speculative Decoding---------------" in t
    assert "Acceptance length:                       2.50" in t
    assert "  Position 1:                            70.00" in t
    assert spec_counters("vllm:generation_tokens_total 3.0\n") is None


def test_bench_serve_reports_acceptance_of_a_speculating_server(capsys):
    """The canary with MTP k=2: its trained layer gets drafts accepted."""
    from validate_test_support import ServerThread

    from dsv4.canary import default_model_dir
    from dsv4.engine.engine import EngineConfig, LLMEngine
    from dsv4.serve import build_app

    engine = LLMEngine(EngineConfig(model=default_model_dir(), kv_cache_memory=128 << 20, max_model_len=256,
                                    max_num_seqs=8, speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    app = build_app(engine, served_model_name="tiny")
    with ServerThread(app) as srv:
        rc = main(bench(srv.url, "--num-prompts", "4", "--max-concurrency", "2", "--random-output-len", "12"))
        stats = app.state.async_engine.call(lambda e: (e.spec_stats.num_drafts,
                                                       e.spec_stats.num_accepted_tokens)).result(60)
    out = capsys.readouterr().out
    assert rc == 0, out
    section = out[out.index("---------------Speculative Decoding---------------"):].split("=" * 50)[0]
    value = {ln[:40].strip(): float(ln[40:]) for ln in section.splitlines()[1:] if ln[40:].strip()}
    drafts, accepted = value["Drafts:"], value["Accepted tokens:"]
    assert 0 < drafts <= stats[0] and accepted <= stats[1]  # (the main run's share of the engine's counts)
    assert 0 < accepted <= value["Draft tokens:"] <= 2 * drafts
    assert value["Acceptance length:"] == pytest.approx(1 + accepted / drafts, abs=0.005)
    rates = [value["Position 0:"], value["Position 1:"]]
    assert rates[0] >= rates[1] and sum(rates) / 100 * drafts == pytest.approx(accepted, abs=0.02 * drafts)
