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
FINITE = "Input should be a finite number"


def deep(n: int) -> bytes:
    return b"[" * n + b'"x"' + b"]" * n

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
    # the JSON decoder's RecursionError; and depths it parses but deepcopy/rendering would not survive
    ("prompt-nested-10000", "POST", C, b'{"prompt": ' + deep(10000) + b"}", 400, "prompt: nested more than 100",
     "prompt"),
    ("messages-nested-10000", "POST", CHAT, b'{"messages": ' + deep(10000) + b"}", 400,
     "messages: nested more than 100", "messages"),
    ("schema-nested-500", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "response_format": '
     b'{"type": "json_schema", "json_schema": {"schema": ' + b'{"a": ' * 500 + b"1" + b"}" * 500 + b"}}}", 400,
     "nested more than 100 levels deep", "response_format.json_schema.schema" + ".a" * 97),
    ("not-utf8", "POST", C, b'{"prompt": "\xff\xfe"}', 400, "Invalid JSON body: not UTF-8 (byte 0xff at position 12)",
     None),
    ("lone-surrogate", "POST", C, b'{"prompt": "a\\ud800b"}', 400, "prompt: contains a lone UTF-16 surrogate",
     "prompt"),
    ("lone-surrogate-chat", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "lone UTF-16 surrogate", "messages[0].content"),
    ("lone-surrogate-key", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": '
     b'"function", "function": {"name": "f", "parameters": {"\\ud800": 1}}}]}', 400, "lone UTF-16 surrogate",
     "tools[0].function.parameters.\\ud800"),
    ("temperature-nan-literal", "POST", C, b'{"prompt": "x", "temperature": NaN}', 400, f"temperature: {FINITE}",
     "temperature"),
    ("temperature-nan-string", "POST", CHAT, {"messages": U, "temperature": "NaN"}, 400, f"temperature: {FINITE}",
     "temperature"),
    ("temperature-infinity", "POST", C, b'{"prompt": "x", "temperature": Infinity}', 400, FINITE, "temperature"),
    ("temperature-1e400", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}',
     400, FINITE, "temperature"),
    ("top-p-nan", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}', 400, FINITE,
     "top_p"),
    ("min-p-inf", "POST", C, {"prompt": "x", "min_p": "inf"}, 400, FINITE, "min_p"),
    ("presence-penalty-nan", "POST", C, b'{"prompt": "x", "presence_penalty": NaN}', 400, FINITE, "presence_penalty"),
    ("frequency-penalty-minus-inf", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], '
     b'"frequency_penalty": -Infinity}', 400, FINITE, "frequency_penalty"),
    ("repetition-penalty-inf", "POST", C, b'{"prompt": "x", "repetition_penalty": Infinity}', 400, FINITE,
     "repetition_penalty"),
    ("seed-2**64", "POST", C, {"prompt": "x", "seed": 2**64}, 400, "seed: Input should be less than or equal to",
     "seed"),
    ("seed-2**63", "POST", CHAT, {"messages": U, "seed": 2**63}, 400, "9223372036854775807", "seed"),
    ("seed-below-int64", "POST", C, {"prompt": "x", "seed": -(2**63) - 1}, 400,
     "seed: Input should be greater than or equal to -9223372036854775808", "seed"),
    ("n-huge", "POST", C, {"prompt": "x", "n": 10**6}, 400, "n: Input should be less than or equal to 16384", "n"),
    ("n-bigint", "POST", CHAT, {"messages": U, "n": 10**30}, 400, "16384", "n"),
    ("max-tokens-bigint", "POST", C, {"prompt": "x", "max_tokens": 10**30}, 400, "maximum context length",
     "max_tokens"),
    ("logprobs-bigint", "POST", C, {"prompt": "x", "logprobs": 10**30}, 400, "SamplingParams.logprobs", "logprobs"),
    ("top-logprobs-bigint", "POST", CHAT, {"messages": U, "logprobs": True, "top_logprobs": 10**30}, 400,
     "SamplingParams.logprobs", "top_logprobs"),
    ("response-format-unknown-type", "POST", CHAT, {"messages": U, "response_format": {"type": "yaml"}}, 400,
     "response_format.type: Input should be 'text', 'json_object' or 'json_schema'", "response_format.type"),
    ("response-format-no-type", "POST", CHAT, {"messages": U, "response_format": {"schema": {}}}, 400,
     "response_format.type: Field required", "response_format.type"),
    ("response-format-not-object", "POST", CHAT, {"messages": U, "response_format": "json"}, 400,
     "response_format", "response_format"),
    ("reasoning-effort-unknown", "POST", CHAT, {"messages": U, "reasoning_effort": "extreme"}, 400,
     "reasoning_effort: Input should be one of none, minimal, low, medium, high, xhigh, max, got 'extreme'",
     "reasoning_effort"),
    ("reasoning-effort-kwargs", "POST", CHAT, {"messages": U, "chat_template_kwargs": {"reasoning_effort": "{x}"}},
     400, "got '{x}'", "chat_template_kwargs.reasoning_effort"),
    ("tokenize-reasoning-effort", "POST", "/tokenize", {"messages": U, "chat_template_kwargs": {"reasoning_effort": 1}},
     400, "reasoning_effort", "chat_template_kwargs.reasoning_effort"),
    ("prompt-null-in-list", "POST", C, {"prompt": ["a", None]}, 400, "prompt[1]: Input should be a valid string",
     "prompt[1]"),
    ("prompt-mixed-list", "POST", C, {"prompt": [1, "a"]}, 400, "prompt[1]: Input should be a valid integer",
     "prompt[1]"),
    ("prompt-batch-not-lists", "POST", C, {"prompt": [[1], 2]}, 400, "prompt[1]: Input should be a valid list",
     "prompt[1]"),
    ("prompt-dict", "POST", C, {"prompt": {"text": "x"}}, 400, "prompt: Input should be a string, a list of strings",
     "prompt"),
    ("stop-null-in-list", "POST", C, {"prompt": "x", "stop": ["a", None]}, 400, "stop[1]", "stop"),
    ("stop-token-ids-null", "POST", C, {"prompt": "x", "stop_token_ids": [None]}, 400, "stop_token_ids[0]",
     "stop_token_ids[0]"),
    ("message-null", "POST", CHAT, {"messages": [None]}, 400, "messages[0]: Input should be a valid dictionary",
     "messages[0]"),
    ("content-part-null", "POST", CHAT, {"messages": [{"role": "user", "content": [None]}]}, 400,
     "messages[0].content[0]", "messages[0].content"),
    ("content-part-text-int", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     400, "messages[0].content[0].text: Input should be a valid string", "messages[0].content"),
    ("tool-call-null", "POST", CHAT, {"messages": U + [{"role": "assistant", "tool_calls": [None]}]}, 400,
     "messages[1].tool_calls[0]", "messages[1].tool_calls[0]"),
    ("tool-call-arguments-list", "POST", CHAT, {"messages": U + [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": [1]}}]}]}, 400, "messages[1].tool_calls[0].function.arguments",
     "messages[1].tool_calls[0].function.arguments"),
    ("message-tools-not-objects", "POST", CHAT, {"messages": [{"role": "system", "content": "x", "tools": [5]}] + U},
     400, "messages[0].tools[0]: Input should be a valid dictionary", "messages[0].tools[0]"),
    ("message-task-list", "POST", CHAT, {"messages": [{"role": "user", "content": "x", "task": ["query"]}]}, 400,
     "messages[0].task: Input should be a valid string", "messages[0].task"),
    ("message-wo-eos-list", "POST", CHAT, {"messages": [{"role": "user", "content": "x", "wo_eos": [1]}]}, 400,
     "messages[0].wo_eos", "messages[0].wo_eos"),
    ("tools-null", "POST", CHAT, {"messages": U, "tools": [None]}, 400, "tools[0]: Input should be a valid dictionary",
     "tools[0]"),
    ("tool-parameters-list", "POST", CHAT, {"messages": U, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": [1]}}]}, 400, "tools[0].function.parameters", "tools[0].function.parameters"),
    ("detokenize-null", "POST", "/detokenize", {"tokens": [None]}, 400, "tokens[0]: Input should be a valid integer",
     "tokens[0]"),
    ("detokenize-bigint", "POST", "/detokenize", {"tokens": [10**30]}, 400, "outside the vocabulary", "tokens"),
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
    # its own bad requests: under xdist the parametrized ones above may run on another worker's server
    assert http.post(CHAT, content=b"").status_code == 400
    assert http.get("/v1/engines").status_code == 404
    assert http.get("/health").status_code == 200
    r = http.post(C, json={"model": "tiny", "prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    real_server.wait_idle()
    assert real_server.on_engine(lambda e: e.kv.leaks()) == []
    metrics = http.get("/metrics").text
    assert metric(metrics, "http_requests_total", handler="/v1/chat/completions", method="POST", status="4xx") > 0
    assert metric(metrics, "http_requests_total", handler="none", status="4xx") > 0  # the unknown paths
