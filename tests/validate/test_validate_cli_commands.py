"""``dsv4 probe`` / ``dsv4 diff`` / ``dsv4 bench serve`` through ``dsv4.cli.main``: flags, exit codes, output."""

from __future__ import annotations

import json

import pytest

from dsv4.cli import build_parser, main


def test_probe_cli_passes_on_the_tiny_model(tiny_ckpt, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# one chat prompt\nchat: 你好\n")
    report = tmp_path / "probe.json"
    rc = main(
        [
            "probe",
            "--model",
            str(tiny_ckpt),
            "--prompts",
            str(prompts),
            "--max-tokens",
            "2",
            "--batch-sizes",
            "1",
            "--repeats",
            "1",
            "--kv-cache-memory",
            "64",
            "--max-num-seqs",
            "4",
            "--max-model-len",
            "128",
            "--validate",
            "--json-report",
            str(report),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "DSV4_VERDICT: PASS" in out and "FIRST_NON_FINITE" not in out
    data = json.loads(report.read_text())
    assert data["verdict"] == "PASS" and data["exit_code"] == 0
    gen = data["generations"][0]
    assert len(gen["token_ids"]) == 2 and gen["finish_reason"] == "length" and gen["verdict"]["status"] == "PASS"
    assert data["options"]["engine_kwargs"]["kv_cache_dtype"] == "fp8_ds_mla"


def test_probe_cli_rejects_max_tokens_below_two(tiny_ckpt, capsys):
    assert main(["probe", "--model", str(tiny_ckpt), "--max-tokens", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_probe_cli_engine_init_failure_fails_and_skips_the_rest(tiny_ckpt, capsys):
    # TP=3 does not divide the tiny model's 4 heads: refused at engine init, before any worker starts
    rc = main(["probe", "--model", str(tiny_ckpt), "--tp", "3", "--kv-cache-memory", "64", "--max-model-len", "128"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "num_attention_heads=4 is not divisible by tensor_parallel_size=3" in out
    assert "=> engine init: FAIL" in out and "=> generate: SKIP" in out and "DSV4_VERDICT: FAIL" in out


def test_diff_cli_reports_triton_unavailable_on_plain_cpu(tiny_ckpt, monkeypatch, capsys):
    import torch

    from dsv4.ops.platform import detect_platform

    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the Triton kernels")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    detect_platform.cache_clear()
    try:
        rc = main(["diff", "--model", str(tiny_ckpt), "--backend-a", "torch", "--backend-b", "triton"])
    finally:
        detect_platform.cache_clear()
    assert rc == 2
    assert "UNAVAILABLE: backend B=triton" in capsys.readouterr().out


def test_bench_serve_flags_parse_like_vllm():
    a = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            "http://127.0.0.1:8000",
            "--model",
            "m",
            "--dataset-name",
            "random",
            "--random-input-len",
            "8192",
            "--random-output-len",
            "1024",
            "--num-prompts",
            "12",
            "--max-concurrency",
            "4",
            "--ignore-eos",
            "--seed",
            "0",
            "--trust-remote-code",
            "--result-json",
            "r.json",
            "--sweep-concurrency",
            "1,2,4",
        ]
    )
    assert a.fn.__name__ == "_cmd_bench_serve"
    assert (a.random_input_len, a.random_output_len, a.num_prompts, a.max_concurrency) == (8192, 1024, 12, 4)
    assert a.sweep_concurrency == [1, 2, 4] and a.ignore_eos and a.result_json == "r.json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--model", "m", "--sweep-concurrency", "0,x"])
