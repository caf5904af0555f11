"""Chat output assembly with deterministic model output: reasoning, content, DSML tool calls.

The real LLMEngine, HTTP server, detokenizer and output parser run; only the model is replaced:
:class:`ScriptedBackend` (zero logits, no weights) plus :class:`ScriptedSampler`, which emits the
tokens of a scripted text for prompts containing a marker (see serve_test_support). This server
also has an API key, and is where engine faults are injected.
"""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest
from serve_test_support import ScriptedBackend, ScriptedSampler, ServerThread, make_engine

for _dep in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_dep)

openai = pytest.importorskip("openai")

KEY = "sk-test-123"
D = "｜DSML｜"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CALL_TEXT = (f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
             f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
             f'<{D}parameter name="days" string="false">3</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')
SCRIPTS = [
    ("<tool_result>", "The user wants the forecast.</think>It will be sunny in Paris for 3 days."),
    # prompt prefilled by a named tool_choice: the model continues inside the invoke
    ('invoke name="get_weather">\n', f'<{D}parameter name="city" string="true">Rome</{D}parameter>\n'
                                     f'</{D}invoke>\n</{D}tool_calls>'),
    ("weather", "I should call the weather tool.</think>" + CALL_TEXT),
    ("2+2", "Simple arithmetic.</think>The answer is 4. STOP and more text"),
    ("POISON", None),  # sampling raises for this request only
]


@pytest.fixture(scope="module")
def scripted(tiny_ckpt):
    from dsv4.config import load_config
    from dsv4.serve import build_app

    engine = make_engine(tiny_ckpt, ScriptedBackend(load_config(tiny_ckpt), delay=0.01))
    engine.sampler = sampler = ScriptedSampler(engine.sampler, engine.tokenizer, SCRIPTS)
    app = build_app(engine, served_model_name=["dsv4-scripted", "alias"], api_key=KEY)
    with ServerThread(app) as srv:
        srv.sampler = sampler
        yield srv


@pytest.fixture(scope="module")
def client(scripted):
    return openai.OpenAI(base_url=scripted.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def assert_logged_not_sent(caplog, message: str, detail: str) -> str:
    """A 5xx body names its request only; the server log has the detail under that request's id (returned)."""
    m = re.fullmatch(r"internal error while running request (\S+); see the server log", message)
    assert m is not None and detail not in message, message
    assert any(m.group(1) in r.getMessage() and detail in r.getMessage() for r in caplog.records), caplog.text
    return m.group(1)


def test_tool_call_round_trip(scripted, client):
    r = client.chat.completions.create(model="dsv4-scripted", messages=ASK, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content is None
    assert msg.model_extra["reasoning_content"] == "I should call the weather tool."
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert "## Tools" in scripted.sampler.prompts[-1]  # the tools were rendered into the prompt
    n_script = len(scripted.engine.tokenizer.encode(SCRIPTS[2][1]))
    assert r.usage.completion_tokens == n_script + 1  # the script and EOS

    # second turn: the assistant's call (with its reasoning) and the tool result go back in
    follow = ASK + [
        {"role": "assistant", "content": None, "reasoning_content": msg.model_extra["reasoning_content"],
         "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    r2 = client.chat.completions.create(model="alias", messages=follow, tools=TOOLS, max_tokens=100)
    prompt = scripted.sampler.prompts[-1]
    assert f'<{D}invoke name="get_weather">' in prompt and '<tool_result>{"forecast": "sunny"}</tool_result>' in prompt
    m2 = r2.choices[0].message
    assert r2.choices[0].finish_reason == "stop" and not m2.tool_calls
    assert m2.content == "It will be sunny in Paris for 3 days."
    assert m2.model_extra["reasoning_content"] == "The user wants the forecast."
    assert r2.model == "alias"


def test_tool_call_streaming_is_incremental(client):
    stream = client.chat.completions.create(model="dsv4-scripted", messages=ASK, tools=TOOLS, max_tokens=200,
                                            stream=True)
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    tool_deltas = [tc for d in deltas for tc in (d.tool_calls or [])]
    first, rest = tool_deltas[0], tool_deltas[1:]
    assert first.id.startswith("call_") and first.function.name == "get_weather" and first.type == "function"
    assert rest, "arguments come after the delta that names the call"
    assert all(tc.id is None and tc.function.name is None and tc.index == 0 for tc in rest)
    args = (first.function.arguments or "") + "".join(tc.function.arguments for tc in rest)
    assert json.loads(args) == {"city": "Paris", "days": 3}
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == "I should call the weather tool."
    assert not any(D in (d.content or "") for d in deltas)  # no DSML leaks into content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_and_named(scripted, client):
    r = client.chat.completions.create(model="dsv4-scripted", messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=200)
    assert "## Tools" not in scripted.sampler.prompts[-1]
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    assert D not in (r.choices[0].message.content or "")

    ask = [{"role": "user", "content": "Pick a city."}]  # no marker but the prefilled invoke
    r = client.chat.completions.create(model="dsv4-scripted", messages=ask, tools=TOOLS, max_tokens=100,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert scripted.sampler.prompts[-1].endswith(f'</think>\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n')
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert r.choices[0].finish_reason == "tool_calls"


def test_reasoning_content_split_and_stop_string(client):
    ask = [{"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model="dsv4-scripted", messages=ask, max_tokens=100, stop=[" STOP"])
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == m.model_extra["reasoning"] == "Simple arithmetic."
    assert m.content == "The answer is 4." and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == " STOP"
    # thinking off: the same text is all content (the parser starts in content; </think> is dropped)
    r = client.chat.completions.create(model="dsv4-scripted", messages=ask, max_tokens=100,
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.choices[0].message.content.startswith("Simple arithmetic.The answer is 4.")
    assert r.choices[0].message.model_extra.get("reasoning_content") is None


def test_api_key_required(scripted):
    body = {"model": "dsv4-scripted", "prompt": "hi", "max_tokens": 1}
    for headers, message in (({}, "Missing API key"), ({"Authorization": "Bearer wrong"}, "Incorrect API key")):
        r = httpx.post(scripted.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and message in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(scripted.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(scripted.url + "/health").status_code == 200  # probes stay open
    assert httpx.get(scripted.url + "/metrics").status_code == 200
    ok = httpx.post(scripted.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200


def test_sampling_failure_fails_only_that_request(scripted, client, caplog):
    """An exception while sampling one request: that request gets a 500, its neighbour is unaffected."""
    import concurrent.futures

    caplog.set_level(logging.ERROR, logger="dsv4.serve")

    def ask(content):
        return httpx.post(scripted.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "alias", "messages": [{"role": "user", "content": content}],
                                "max_tokens": 100}, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bad, good = pool.map(ask, ["POISON pill", "What is 2+2?"])
    assert bad.status_code == 500
    assert_logged_not_sent(caplog, bad.json()["error"]["message"], "scripted sampling failure")
    assert bad.json()["error"]["type"] == "server_error"
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"].startswith("The answer is 4.")
    scripted.wait_idle()
    assert scripted.on_engine(lambda e: e.kv.leaks()) == []


def test_step_failure_fails_the_step_and_keeps_serving(scripted, client, caplog):
    """An exception in the forward (not attributable to one request) fails that step's requests only."""
    caplog.set_level(logging.ERROR, logger="dsv4.serve")
    scripted.engine.model.fail_in(1, RuntimeError("simulated device error"))
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(model="alias", messages=ASK, max_tokens=10)
    assert_logged_not_sent(caplog, failed.value.body["message"], "simulated device error")
    # a streaming request after the fault works, and so does the engine's bookkeeping
    stream = client.chat.completions.create(model="alias", messages=ASK, tools=TOOLS, max_tokens=200, stream=True)
    assert any(c.choices and c.choices[0].finish_reason == "tool_calls" for c in stream)
    scripted.wait_idle()
    assert scripted.on_engine(lambda e: e.kv.leaks()) == []
    assert httpx.get(scripted.url + "/health").status_code == 200


def test_step_failure_mid_stream_is_reported_in_band(scripted, caplog):
    """A failure after the stream started arrives as an SSE error event, then [DONE]."""
    caplog.set_level(logging.ERROR, logger="dsv4.serve")
    scripted.wait_idle()
    backend = scripted.engine.model
    failed_before = scripted.async_engine.stats.failed
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "alias", "messages": ASK, "tools": TOOLS, "max_tokens": 200, "stream": True}
    backend.delay = 0.05  # ~3 s for the script: plenty of time to arm the fault mid-stream
    try:
        with httpx.stream("POST", scripted.url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=120) as r:
            assert r.status_code == 200
            payloads = []
            for ln in r.iter_lines():
                if not ln.startswith("data: "):
                    continue
                if ln == "data: [DONE]":
                    payloads.append("[DONE]")
                    break
                payloads.append(json.loads(ln[6:]))
                if len(payloads) == 3:  # role chunk + two reasoning chunks: now the next forward fails
                    backend.fail_in(1, RuntimeError("late failure"))
    finally:
        backend.delay = 0.01
    assert payloads[-1] == "[DONE]", payloads
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert assert_logged_not_sent(caplog, payloads[-2]["error"]["message"], "late failure") == payloads[0]["id"]
    assert payloads[-2]["error"]["type"] == "server_error"
    assert not any(p.get("choices") and p["choices"][0]["finish_reason"] for p in payloads[:-1])
    scripted.wait_idle()
    assert scripted.async_engine.stats.failed == failed_before + 1
    assert scripted.on_engine(lambda e: e.kv.leaks()) == []
