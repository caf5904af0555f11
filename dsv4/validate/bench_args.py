"""``dsv4 bench serve`` flags (argparse only, so building the CLI parser imports nothing heavy).

Names follow ``vllm bench serve`` so that its command lines work with ``dsv4`` in place of ``vllm``.
"""

from __future__ import annotations

import argparse


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.allow_abbrev = False  # --tokenizer must never be taken for another flag's prefix
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root (default: loopback port 8000); requests go only to this URL")
    p.add_argument("--host", default=None, help="with --port: http://HOST:PORT (ignored when --base-url is given)")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--endpoint", default="/v1/completions", help="completions endpoint (streamed)")
    p.add_argument("--backend", default="openai", choices=["openai", "vllm", "dsv4"],
                   help="accepted for vllm compatibility; every choice speaks /v1/completions")
    p.add_argument("--model", required=True, help="model name as the server knows it")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer.json or model directory for random prompts (else the server's /detokenize)")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted for vllm compatibility; no effect")
    p.add_argument("--dataset-name", "--dataset", dest="dataset_name", default="random", choices=["random"])
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len·(1-r), len·(1+r)]")
    p.add_argument("--random-prefix-len", type=int, default=0, help="a shared random prefix of this many tokens")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    p.add_argument("--sweep-concurrency", type=_int_list, default=None, metavar="C1,C2,…",
                   help="run once per concurrency and print a summary table")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf: all at once")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY if set)")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds for the whole run (then pending requests fail)"
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the initial test request")
    p.add_argument("--result-json", "--result-filename", dest="result_json", default=None, metavar="FILE")
    p.add_argument("--save-result", action="store_true", help="accepted for vllm compatibility (see --result-json)")
    p.add_argument("--disable-tqdm", action="store_true", help="accepted for vllm compatibility; no progress bar")
