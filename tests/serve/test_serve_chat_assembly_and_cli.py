"""No server: the chat output assembler fed token by token, and the ``dsv4 serve`` flags."""

from __future__ import annotations

import json

import pytest

for _dep in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_dep)

D = "｜DSML｜"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
TEXT = (f'Need data.</think>\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">San Francisco</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">3</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')


def _prompt(**kw):
    from dsv4.serve.chat_completions import ChatPrompt

    args = dict(text="", ids=[], thinking=True, tools=TOOLS, report_tools=True)
    args.update(kw)
    return ChatPrompt(**args)


def test_tool_call_deltas_stream_token_by_token(tiny_ckpt):
    from dsv4.chat import load_tokenizer
    from dsv4.serve.chat_completions import ChoiceAssembler, fold

    tok = load_tokenizer(tiny_ckpt)
    detok = tok.incremental_detokenizer(skip_special_tokens=True)
    asm = ChoiceAssembler(_prompt())
    deltas = []
    for t in tok.encode(TEXT):
        deltas += asm.feed(detok.feed(t))
    deltas += asm.feed(detok.flush()) + asm.finish()
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    fragments = [c["function"]["arguments"] for c in calls[1:]]
    assert all(set(c) == {"index", "function"} for c in calls[1:])
    assert len(fragments) >= 4  # the string value streams as it arrives, not after </invoke>
    assert json.loads(calls[0]["function"]["arguments"] + "".join(fragments)) == {"city": "San Francisco", "days": 3}
    msg = fold(deltas)
    assert msg["reasoning_content"] == msg["reasoning"] == "Need data."
    assert msg["content"] is None and len(msg["tool_calls"]) == 1
    assert asm.finish_reason("stop") == "tool_calls"


def test_tool_calls_not_reported_without_tools():
    from dsv4.serve.chat_completions import ChoiceAssembler, fold

    asm = ChoiceAssembler(_prompt(tools=None, report_tools=False))
    msg = fold(asm.feed(TEXT) + asm.finish())
    assert msg["tool_calls"] == [] and msg["content"] == "" and asm.finish_reason("stop") == "stop"


def test_serve_flags_match_vllm_seed_commands():
    from dsv4.cli import _engine_settings, build_parser

    p = build_parser()
    a = p.parse_args(["serve", "/models/DeepSeek-V4-Flash", "--trust-remote-code", "--kv-cache-dtype", "fp8",
                      "--block-size", "256", "--tokenizer-mode", "deepseek_v4", "--tool-call-parser", "deepseek_v4",
                      "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_v4", "--max-model-len", "4096",
                      "--served-model-name", "dsv4", "ds", "--port", "9000", "--api-key", "k",
                      "--kv-cache-memory", "512", "--no-enable-prefix-caching", "--max-num-seqs", "8"])
    assert a.model_tag == "/models/DeepSeek-V4-Flash" and a.served_model_name == ["dsv4", "ds"]
    kw = _engine_settings(a)
    assert kw["kv_cache_memory"] == 512 << 20 and kw["enable_prefix_caching"] is False
    assert kw["max_model_len"] == 4096 and kw["max_num_seqs"] == 8 and kw["kv_cache_dtype"] == "fp8"
    a = p.parse_args(["serve", "--model", "/m"])
    assert (a.model, a.host, a.port) == ("/m", "127.0.0.1", 8000)
    for bad in (["--reasoning-parser", "qwen3"], ["--tool-call-parser", "hermes"]):
        with pytest.raises(SystemExit):
            p.parse_args(["serve", "/m", *bad])


def test_serve_command_errors(capsys):
    from dsv4.cli import main

    # (no model at all is not an error: the embedded canary is served, tests/canary)
    assert main(["serve", "/m", "--model", "/n"]) == 2
    assert "two models given" in capsys.readouterr().err
    assert main(["serve", "/m", "--block-size", "16"]) == 2
    assert "256" in capsys.readouterr().err


SERVER_DEPS = ("fastapi", "uvicorn", "starlette", "prometheus_client", "pydantic")


def test_import_dsv4_stays_free_of_server_deps():
    """Only dsv4/serve may import the server stack: checked statically for every module, and live
    for the light entry points (``import dsv4``, the CLI)."""
    import ast
    import pathlib
    import subprocess
    import sys

    import dsv4

    root = pathlib.Path(dsv4.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if "serve" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in SERVER_DEPS]
    assert offenders == []
    code = ("import sys, dsv4, dsv4.cli, dsv4.chat; dsv4.cli.build_parser(); "
            f"bad = [m for m in {SERVER_DEPS!r} if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
