"""The ``dsv4`` command line. Subcommands import their modules lazily so startup stays fast."""

from __future__ import annotations

import argparse
import errno
import sys

CANARY_NAME = "dsv4-canary"  # what the embedded canary is served as (no --model)


def _cmd_make_checkpoint(a: argparse.Namespace) -> int:
    from .checkpoint.synthetic import write_checkpoint

    out = write_checkpoint(a.out, preset=a.preset, layers=a.layers, seed=a.seed, expert_dtype=a.expert_dtype,
                           overrides=a.override, device=a.device, progress=not a.quiet)
    print(f"wrote {a.preset} checkpoint to {out}")
    return 0


def _cmd_inspect(a: argparse.Namespace) -> int:
    from .checkpoint.inspect import inspect_checkpoint

    text, ok = inspect_checkpoint(a.model_dir, check_values=a.check_values, progress=a.check_values)
    print(text)
    return 0 if ok else 1


def _engine_settings(a: argparse.Namespace) -> dict:
    """The engine settings given as flags (``dsv4.engine.settings``), in the settings' units."""
    from .engine.settings import cli_settings

    return cli_settings(a)


def _engine_config(a: argparse.Namespace):
    from .engine.settings import EngineConfig

    return EngineConfig.from_kwargs("dsv4", model=_model_or_canary(a.model), **_engine_settings(a))


def _model_or_canary(model: str | None) -> str:
    """The given model directory, or the embedded canary model (dsv4/assets/canary) when none is."""
    if model:
        return model
    from .canary import default_model_dir

    return default_model_dir()


def _add_engine_args(p: argparse.ArgumentParser, model_required: bool = True, exclude: tuple[str, ...] = ()) -> None:
    """``--model`` and every engine setting's flag (generated from ``EngineConfig``'s fields)."""
    from .engine.settings import add_cli_args

    p.add_argument("--model", required=model_required, help="model directory (config.json + safetensors)" + (
        "" if model_required else "; default: the embedded canary model"))
    add_cli_args(p, exclude=exclude)


def _cmd_generate(a: argparse.Namespace) -> int:
    import json

    from .engine.sampling_params import SamplingParams
    from .llm import LLM

    settings = _engine_settings(a)
    llm = LLM(_model_or_canary(a.model), **settings)
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, top_p=a.top_p, top_k=a.top_k,
                            seed=settings.get("seed"), ignore_eos=a.ignore_eos)
    if a.chat:
        out = llm.chat([{"role": "user", "content": a.prompt}], params, thinking=a.thinking)[0]
    else:
        out = llm.generate(a.prompt, params)[0]
    o = out.outputs[0]
    if a.json:
        tok = llm.get_tokenizer()
        print(json.dumps({
            "prompt_token_ids": out.prompt_token_ids, "token_ids": o.token_ids,
            "tokens": [tok.decode([t]) for t in o.token_ids], "text": o.text, "finish_reason": o.finish_reason,
        }, ensure_ascii=False))
    else:
        print(o.text)
    return 0


def _check_serve_flags(a: argparse.Namespace) -> None:
    """The serve-only flags, checked before anything loads; vLLM's flags that cannot apply say why."""
    if a.model_tag and a.model and a.model_tag != a.model:
        raise ValueError(f"two models given: {a.model_tag!r} and --model {a.model!r}")
    if a.block_size is not None and a.block_size != 256:
        raise ValueError(f"--block-size {a.block_size}: DeepSeek-V4 caches use blocks of 256 tokens")
    if a.chat_template is not None:
        raise ValueError(f"--chat-template {a.chat_template}: DeepSeek-V4 has no Jinja chat template; dsv4 renders "
                         "chats with the built-in DeepSeek-V4 encoding (--tokenizer-mode deepseek_v4, the default), "
                         "so drop --chat-template")
    if a.enable_chunked_prefill is False:
        raise ValueError("--no-enable-chunked-prefill: chunked prefill is always on in dsv4 and cannot be turned off "
                         "(--max-num-batched-tokens and --long-prefill-token-threshold size the chunks)")
    if a.enable_log_requests and a.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests: give one of them")
    for flag, value in (("--max-log-len", a.max_log_len), ("--shutdown-timeout", a.shutdown_timeout),
                        ("--engine-stall-timeout", a.engine_stall_timeout)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be ≥ 0; got {value!r}")
    if a.max_request_body_mb <= 0:
        raise ValueError(f"--max-request-body-mb must be positive; got {a.max_request_body_mb!r}")
    if a.log_stats_interval <= 0:
        raise ValueError(f"--log-stats-interval must be positive (seconds); got {a.log_stats_interval!r}")


def _bind(host: str, port: int):
    """The server's socket, bound before anything loads (listening starts with the server), so that a
    taken port fails in a second and not after the model loaded; a ValueError naming the flag."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"--port {port}: cannot listen on {host}:{port}: {e.strerror}"
                         + (" (another process has it; pick another --port)" if e.errno == errno.EADDRINUSE else "")
                         ) from None
    return sock


def _cmd_serve(a: argparse.Namespace) -> int:
    _check_serve_flags(a)
    sock = _bind(a.host, a.port) if a.node_rank == 0 else None  # (nodes > 0 serve nothing)
    try:
        canary = not (a.model or a.model_tag)
        a.model = _model_or_canary(a.model or a.model_tag)
        if canary and not a.served_model_name:  # never its path inside the installed package
            a.served_model_name = [CANARY_NAME]
        config = _engine_config(a)
        if config.node_rank > 0:  # a headless node of a multi-node run: only this node's worker ranks (dsv4/parallel)
            from .parallel.worker import run_worker_node

            return run_worker_node(config)
        from .serve.app import ServeOptions, serve  # lazy: fastapi/uvicorn only load for this command

        options = ServeOptions(log_stats=not a.disable_log_stats, log_stats_interval=a.log_stats_interval,
                               log_requests=not a.disable_log_requests, log_prompts=a.enable_log_requests,
                               max_log_len=a.max_log_len, generation_config=a.generation_config,
                               engine_stall_timeout=a.engine_stall_timeout, shutdown_timeout=a.shutdown_timeout,
                               max_body_bytes=int(a.max_request_body_mb * 2**20))
        return serve(a, config, options, sock, model_root=CANARY_NAME if canary else None)
    finally:
        if sock is not None:
            sock.close()


def _cmd_eval_canary(a: argparse.Namespace) -> int:
    from .canary.eval import run_eval_command  # lazy: torch loads only for this command

    return run_eval_command(a, _model_or_canary(a.model), _engine_settings(a))


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cmd_probe(a: argparse.Namespace) -> int:
    from .validate.probe import ProbeOptions, load_prompts, run_probe

    verdict = {k: v for k, v in (("max_run", a.max_run),) if v is not None}
    opts = ProbeOptions(model=_model_or_canary(a.model), engine_kwargs=_engine_settings(a),
                        prompts=load_prompts(a.prompts) if a.prompts else None, max_tokens=a.max_tokens,
                        batch_sizes=tuple(a.batch_sizes), repeats=a.repeats, validate=a.validate,
                        ref_tokens=a.ref_tokens, ref_tol=a.ref_tol, logprob_tol=a.logprob_tol, oracle=a.oracle,
                        exact_oracle=a.exact_oracle,
                        batch_tie_tol=a.batch_tie_tol,
                        expect=a.expect, record=a.record, json_report=a.json_report, thinking=a.thinking,
                        seed=_engine_settings(a).get("seed", 0), verdict=verdict)
    return run_probe(opts).exit_code


def _cmd_diff(a: argparse.Namespace) -> int:
    from .validate.diff import DiffOptions, run_diff

    opts = DiffOptions(model=a.model, backend_a=a.backend_a, backend_b=a.backend_b, dtype=a.dtype,
                       kv_cache_dtype=a.kv_cache_dtype, fp8_format=a.fp8_format, prompt_len=a.prompt_len,
                       greedy_tokens=a.greedy_tokens, top_k=a.top_k, cos_tol=a.cos_tol, rel_tol=a.rel_tol,
                       seed=a.seed, json_report=a.json_report)
    return run_diff(opts).exit_code


def _cmd_bench_serve(a: argparse.Namespace) -> int:
    from .validate.bench import bench_options_from_args, run_bench

    return run_bench(bench_options_from_args(a)).exit_code


def _add_probe_args(pr: argparse.ArgumentParser) -> None:
    _add_engine_args(pr, model_required=False)
    pr.add_argument("--tp", dest="tensor_parallel_size", type=int, default=argparse.SUPPRESS,
                    help="same as --tensor-parallel-size")
    pr.add_argument("--prompts", default=None, help="prompt file (.json list, or one prompt per line with "
                    "chat:/raw: prefixes); default: two chat and two raw prompts")
    pr.add_argument("--max-tokens", type=int, default=32, help="tokens per prompt (≥ 2: decode must run)")
    pr.add_argument("--batch-sizes", type=_int_list, default=[1, 2, 8, 16], help="e.g. 1,2,8,16")
    pr.add_argument("--repeats", type=int, default=2, help="runs of the largest batch, compared with each other")
    pr.add_argument("--validate", action="store_true",
                    help="finite checks at every layer boundary and inside attention (q, k, logits, probs)")
    pr.add_argument("--ref-tokens", type=int, default=4, help="reference agreement over the first N tokens (0: all)")
    pr.add_argument("--ref-tol", type=float, default=0.05, help="nats: a top-1 disagreement within it is a near-tie")
    pr.add_argument("--logprob-tol", type=float, default=0.1, help="nats: engine vs reference logprob of a token")
    pr.add_argument("--batch-tie-tol", type=float, default=0.0,
                    help="nats: outputs of two batch sizes / repeats that part at a near-tie this close only warn "
                         "(default 0: any difference fails)")
    pr.add_argument("--oracle", choices=["shared", "torch", "off"], default="shared",
                    help="shared: the engine's model on a dense cache; torch: a separately loaded torch reference")
    pr.add_argument("--exact-oracle", action=argparse.BooleanOptionalAction, default=True,
                    help="below float32, judge steps that part from the reference again against the float32 "
                         "reference: they pass when the engine is no farther from it than the reference is")
    pr.add_argument("--expect", default=None, metavar="FILE", help="PASS only if the tokens equal this golden run")
    pr.add_argument("--record", default=None, metavar="FILE", help="write this run's tokens as a golden file")
    pr.add_argument("--json-report", default=None, metavar="FILE")
    pr.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                    help="chat prompts in thinking mode")
    pr.add_argument("--max-run", type=int, default=None, help="verdict: a token repeated this often in a row fails")
    pr.set_defaults(fn=_cmd_probe)


def _add_diff_args(d: argparse.ArgumentParser) -> None:
    d.add_argument("--model", required=True, help="model directory")
    d.add_argument("--backend-a", default="torch", choices=["auto", "torch", "triton"])
    d.add_argument("--backend-b", default="triton", choices=["auto", "torch", "triton"])
    d.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, bfloat16")
    from .model.cache import KV_CACHE_ALIASES, KV_CACHE_DTYPES

    d.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=KV_CACHE_DTYPES + tuple(KV_CACHE_ALIASES))
    d.add_argument("--fp8-format", default="ocp", choices=["ocp", "fnuz"])
    d.add_argument("--prompt-len", type=int, default=300, help="random prompt length (crosses pages and windows)")
    d.add_argument("--greedy-tokens", type=int, default=8)
    d.add_argument("--top-k", type=int, default=10)
    d.add_argument("--cos-tol", type=float, default=1e-3, help="a row fails when 1 - cosine exceeds this")
    d.add_argument("--rel-tol", type=float, default=0.15,
                   help="a row fails when max|a-b| / max|a| exceeds this (one FP8 E4M3 step is up to 12.5%%)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json-report", default=None, metavar="FILE")
    d.set_defaults(fn=_cmd_diff)


def _add_serve_args(s: argparse.ArgumentParser) -> None:
    """vLLM's ``vllm serve`` flags, so that its commands work with ``dsv4`` in place of ``vllm``."""
    s.add_argument("model_tag", nargs="?", default=None, help="model directory (same as --model)")
    _add_engine_args(s, model_required=False)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use; default: the model directory's name (dsv4-canary for the canary)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (also $DSV4_API_KEY)")
    s.add_argument("--reasoning-parser", choices=["deepseek_v4"], default="deepseek_v4")
    s.add_argument("--tool-call-parser", choices=["deepseek_v4"], default="deepseek_v4")
    s.add_argument("--enable-auto-tool-choice", action="store_true", help="accepted; tool calls are always parsed")
    s.add_argument("--tokenizer-mode", choices=["deepseek_v4", "auto"], default="deepseek_v4")
    s.add_argument("--trust-remote-code", action="store_true", help="accepted for vLLM compatibility; no effect")
    s.add_argument("--block-size", type=int, default=None, help="accepted for vLLM compatibility; must be 256")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    s.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="refused: DeepSeek-V4 has no Jinja template; chats use the built-in DeepSeek-V4 encoding "
                        "(--tokenizer-mode deepseek_v4)")
    s.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults: auto reads the model's generation_config.json, vllm ignores it, a "
                        "directory reads its generation_config.json (default: auto)")
    s.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="accepted: chunked prefill is always on (--no-enable-chunked-prefill is refused)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, requests, KV cache, prefix-cache hits); /metrics "
                        "stays on")
    s.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between stats lines while the engine is busy (default: 10)")
    s.add_argument("--enable-log-requests", action="store_true",
                   help="also log each request's prompt and sampling parameters as it arrives")
    s.add_argument("--disable-log-requests", action="store_true", help="no log line per request")
    s.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="prompt characters (or token ids) --enable-log-requests shows at most (default: all)")
    s.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="on SIGTERM, seconds the requests in flight get to finish; then their streams end with "
                        "an error event and the server exits (default: 5)")
    s.add_argument("--engine-stall-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="/health answers 503 once the engine has made no progress for this long with requests in "
                        "flight, e.g. a stopped tensor-parallel rank (0: never; default: 30)")
    s.add_argument("--max-request-body-mb", type=float, default=32.0, metavar="MIB",
                   help="request bodies larger than this get a 413 (default: 32)")
    s.set_defaults(fn=_cmd_serve)


class _Parser(argparse.ArgumentParser):
    """No prefix matching of long flags (vLLM's flags share prefixes: an abbreviation must not pick one).
    Subparsers are made of the parent's class, so every (sub)command gets it."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dsv4", description="DeepSeek-V4-Flash inference engine")
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint in the release format")
    m.add_argument("--preset", choices=["tiny", "tiny-dspark", "flash-width", "flash", "flash-0731"], default="tiny")
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int, default=None)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--expert-dtype", choices=["fp4", "fp8"], default="fp4")
    m.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="set a config.json field (JSON value), repeatable")
    m.add_argument("--device", default="cpu", help="device that generates the random values")
    m.add_argument("--quiet", action="store_true")
    m.set_defaults(fn=_cmd_make_checkpoint)

    g = sub.add_parser("generate", help="generate text for one prompt")
    _add_engine_args(g, model_required=False)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat encoding)")
    g.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print token ids, per-token text and finish reason as JSON")
    g.set_defaults(fn=_cmd_generate)

    _add_serve_args(sub.add_parser("serve", help="run the OpenAI-compatible HTTP server"))

    i = sub.add_parser("inspect", help="summarize and validate a model directory")
    i.add_argument("model_dir")
    i.add_argument("--check-values", action=argparse.BooleanOptionalAction, default=True,
                   help="read every tensor and report NaN/±inf values (--no-check-values: the headers only)")
    i.set_defaults(fn=_cmd_inspect)

    _add_probe_args(sub.add_parser("probe", help="stage-by-stage bring-up probe with a token-level verdict"))
    _add_diff_args(sub.add_parser("diff", help="layered numerical evidence chain between two backends"))
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    from .validate.bench_args import add_bench_serve_args  # argparse only: no httpx import

    add_bench_serve_args(bsub.add_parser("serve", help="load-test an OpenAI-compatible server (vllm bench serve)"))
    bsub.choices["serve"].set_defaults(fn=_cmd_bench_serve)

    e = sub.add_parser("eval", help="accuracy evaluations")
    esub = e.add_subparsers(dest="eval_cmd", required=True)
    ec = esub.add_parser("canary", help="greedy accuracy per task on the canary's fixed held-out set (JSON)")
    _add_engine_args(ec, model_required=False)
    ec.add_argument("--per-task", type=int, default=32, help="held-out examples of add, mul and copy")
    ec.add_argument("--recall", type=int, default=24, help="held-out recall examples (300-1200 tokens each)")
    ec.add_argument("--tasks", default=None, help="comma-separated subset of add,mul,copy,recall")
    ec.add_argument("--check", action="store_true",
                    help="exit 1 if a task's accuracy is more than --margin below the model's canary.json")
    ec.add_argument("--margin", type=float, default=0.15, help="allowed drop for --check (fraction)")
    ec.add_argument("--outputs", action="store_true", help="include every example's output in the JSON")
    ec.add_argument("--json-out", default=None, metavar="FILE", help="also write the JSON to FILE")
    ec.set_defaults(fn=_cmd_eval_canary)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)  # (imports torch: interruptible too)
    except KeyboardInterrupt:
        return 130
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:  # config/checkpoint errors name what is wrong
        print(f"dsv4 {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the server has shut down already; no traceback
        return 130


if __name__ == "__main__":
    sys.exit(main())
