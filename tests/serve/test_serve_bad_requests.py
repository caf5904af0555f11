"""A table of bad requests: each gets its OpenAI-style error (status, message naming the problem),
and the server keeps serving good requests in between and afterwards."""

from __future__ import annotations

import httpx
import pytest
from serve_test_support import MAX_MODEL_LEN, metric

for _dep in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_dep)

C, CHAT = "/v1/completions", "/v1/chat/completions"
U = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

# (id, method, path, body (dict) or raw bytes, status, substring of the message, param)
CASES = [
    ("malformed-json", "POST", C, b'{"prompt": "x",', 400, "Invalid JSON body", None),
    ("not-an-object", "POST", C, b"[1, 2]", 400, "must be a JSON object", None),
    ("empty-body", "POST", CHAT, b"", 400, "Invalid JSON body", None),
    ("prompt-wrong-type", "POST", C, {"prompt": 5}, 400, "prompt", "prompt"),
    ("prompt-missing", "POST", C, {"max_tokens": 2}, 400, "prompt: Field required", "prompt"),
    ("prompt-empty-list", "POST", C, {"prompt": []}, 400, "must not be empty", "prompt"),
    ("max-tokens-not-int", "POST", C, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    ("temperature-negative", "POST", C, {"prompt": "x", "temperature": -1}, 400,
     "SamplingParams.temperature must be ≥ 0", "temperature"),
    ("temperature-string", "POST", CHAT, {"messages": U, "temperature": "hot"}, 400, "temperature: Input should be",
     "temperature"),
    ("top-p-zero", "POST", C, {"prompt": "x", "top_p": 0}, 400, "SamplingParams.top_p must be in (0, 1]", "top_p"),
    ("top-k-bad", "POST", C, {"prompt": "x", "top_k": -5}, 400, "SamplingParams.top_k", "top_k"),
    ("min-p-bad", "POST", CHAT, {"messages": U, "min_p": 1.5}, 400, "SamplingParams.min_p", "min_p"),
    ("presence-penalty", "POST", C, {"prompt": "x", "presence_penalty": 3}, 400,
     "SamplingParams.presence_penalty must be in [-2, 2]", "presence_penalty"),
    ("repetition-penalty", "POST", C, {"prompt": "x", "repetition_penalty": 0}, 400,
     "SamplingParams.repetition_penalty", "repetition_penalty"),
    ("n-zero", "POST", C, {"prompt": "x", "n": 0}, 400, "SamplingParams.n", "n"),
    ("logprobs-too-many", "POST", C, {"prompt": "x", "logprobs": 50}, 400,
     "SamplingParams.logprobs must be an integer in [0, 20]", "logprobs"),
    ("max-tokens-negative", "POST", C, {"prompt": "x", "max_tokens": -1}, 400, "SamplingParams.max_tokens",
     "max_tokens"),
    ("max-tokens-zero", "POST", C, {"prompt": "x", "max_tokens": 0}, 400, "only allowed with echo", "max_tokens"),
    ("min-tokens-over-max", "POST", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400,
     "SamplingParams.min_tokens", "min_tokens"),
    ("stop-wrong-type", "POST", C, {"prompt": "x", "stop": 7}, 400, "stop", "stop"),
    ("suffix", "POST", C, {"prompt": "x", "suffix": "y"}, 400, "suffix is not supported", "suffix"),
    ("token-outside-vocab", "POST", C, {"prompt": [5, 999999999]}, 400, "outside the vocabulary", "prompt"),
    ("unknown-model", "POST", C, {"model": "gpt-4", "prompt": "x"}, 404, "The model `gpt-4` does not exist", "model"),
    ("unknown-model-chat", "POST", CHAT, {"model": "nope", "messages": U}, 404, "does not exist", "model"),
    ("prompt-too-long", "POST", C, {"prompt": "hello " * (MAX_MODEL_LEN + 10)}, 400, "maximum context length",
     "prompt"),
    ("prompt-plus-max-tokens-too-long", "POST", C, {"prompt": [7] * (MAX_MODEL_LEN - 10), "max_tokens": 50}, 400,
     "maximum context length", "max_tokens"),
    ("chat-too-long", "POST", CHAT, {"messages": [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]}, 400,
     "maximum context length", "messages"),
    ("chat-max-completion-tokens", "POST", CHAT, {"messages": U, "max_completion_tokens": MAX_MODEL_LEN}, 400,
     "maximum context length", "max_completion_tokens"),
    ("messages-missing", "POST", CHAT, {"model": "tiny"}, 400, "messages: Field required", "messages"),
    ("messages-empty", "POST", CHAT, {"messages": []}, 400, "messages: List should have at least 1 item",
     "messages"),
    ("messages-not-list", "POST", CHAT, {"messages": "hello"}, 400, "messages", "messages"),
    ("unknown-role", "POST", CHAT, {"messages": [{"role": "bot", "content": "hi"}]}, 400,
     "messages[0].role: Input should be 'system'", "messages[0].role"),
    ("content-wrong-type", "POST", CHAT, {"messages": [{"role": "user", "content": 42}]}, 400,
     "messages[0].content", "messages[0].content"),
    ("user-without-content", "POST", CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content: missing",
     "messages[0].content"),
    ("tool-without-call", "POST", CHAT,
     {"messages": U + [{"role": "tool", "tool_call_id": "call_1", "content": "42"}]}, 400,
     "messages[1].tool_call_id", "messages[1].tool_call_id"),
    ("unsupported-content-part", "POST", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "audio", "data": "x"}]}]}, 400,
     "unsupported content part type", "messages[0].content"),
    ("top-logprobs-too-many", "POST", CHAT, {"messages": U, "logprobs": True, "top_logprobs": 21}, 400,
     "SamplingParams.logprobs must be an integer in [0, 20]", "top_logprobs"),
    ("max-completion-tokens-zero", "POST", CHAT, {"messages": U, "max_completion_tokens": 0}, 400,
     "SamplingParams.max_tokens", "max_completion_tokens"),
    ("top-logprobs-without-logprobs", "POST", CHAT, {"messages": U, "top_logprobs": 2}, 400,
     "requires logprobs", "top_logprobs"),
    ("stream-options-without-stream", "POST", CHAT, {"messages": U, "stream_options": {"include_usage": True}},
     400, "stream_options", "stream_options"),
    ("tool-choice-unknown-function", "POST", CHAT,
     {"messages": U, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
     "not among the request's tools", "tool_choice"),
    ("tool-choice-required-without-tools", "POST", CHAT, {"messages": U, "tool_choice": "required"}, 400,
     "needs a non-empty tools list", "tool_choice"),
    ("tool-choice-bad-string", "POST", CHAT, {"messages": U, "tools": TOOLS, "tool_choice": "always"}, 400,
     "tool_choice", "tool_choice"),
    ("tools-wrong-shape", "POST", CHAT, {"messages": U, "tools": [{"type": "function"}]}, 400,
     "tools[0].function: Field required", "tools[0].function"),
    ("tokenize-nothing", "POST", "/tokenize", {}, 400, "exactly one of prompt or messages", "prompt"),
    ("detokenize-bad-id", "POST", "/detokenize", {"tokens": [-1]}, 400, "outside the vocabulary", "tokens"),
    ("unknown-path", "GET", "/v1/engines", None, 404, "Not Found", None),
    ("wrong-method", "GET", C, None, 405, "Method Not Allowed", None),
]


@pytest.fixture(scope="module")
def http(real_server):
    with httpx.Client(base_url=real_server.url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(http, case):
    _, method, path, body, status, message, param = case
    if isinstance(body, bytes):
        r = http.request(method, path, content=body, headers={"content-type": "application/json"})
    elif body is None:
        r = http.request(method, path)
    else:
        r = http.request(method, path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert message in err["message"], err
    assert err["param"] == param, err
    assert err["type"] == {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error"}[status]
    if "maximum context length" in message:
        assert err["code"] == "context_length_exceeded"


def test_streaming_request_refused_before_the_stream(http):
    """A bad streaming request is a plain JSON error, not an SSE stream."""
    r = http.post(CHAT, json={"messages": U, "stream": True, "temperature": -2})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")


def test_server_still_serves_after_bad_requests(http, real_server):
    assert http.get("/health").status_code == 200
    r = http.post(C, json={"model": "tiny", "prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    real_server.wait_idle()
    assert real_server.on_engine(lambda e: e.kv.leaks()) == []
    metrics = http.get("/metrics").text
    assert metric(metrics, "http_requests_total", handler="/v1/chat/completions", method="POST", status="4xx") > 0
    assert metric(metrics, "http_requests_total", handler="none", status="4xx") > 0  # the unknown paths
