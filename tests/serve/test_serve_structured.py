"""Structured outputs, enforced tool choice and logit_bias through the server, on the tiny random model.

The tiny checkpoint's weights are random: what it writes is only well-formed because the grammar
allowed nothing else, so every output below that parses and validates was made so by the request's
constraint (response_format, structured_outputs, guided_*, tool_choice).
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

for _dep in ("fastapi", "uvicorn", "prometheus_client", "llguidance"):
    pytest.importorskip(_dep)

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
U = [{"role": "user", "content": "Fill in the form."}]
D = "｜DSML｜"
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def real_server(tiny_ckpt):
    """The tiny model with the dense (``auto``) cache: what a grammar allows does not depend on the cache
    format, and this module's ~200 steps of ~40 requests cost about half of what the FP8 cache costs."""
    import torch
    from serve_test_support import ServerThread, make_engine

    from dsv4.model.cache import CacheNumerics
    from dsv4.model.model import ReferenceModel
    from dsv4.serve import build_app

    model = ReferenceModel(tiny_ckpt, dtype=torch.float32, numerics=CacheNumerics("auto"))
    app = build_app(make_engine(tiny_ckpt, model, kv_cache_dtype="auto"), served_model_name="tiny")
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(real_server):
    with httpx.Client(base_url=real_server.url, timeout=300) as c:
        yield c


def _post(http, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed request."""
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


REQUESTS: dict[str, tuple[str, dict, bool]] = {}  # name → (path, body, streamed): what `results` runs
WARM = ("required0", "required1")  # sent before the others


def _request(name: str, path: str, body: dict, stream: bool = False) -> str:
    REQUESTS[name] = (path, body, stream)
    return name


@pytest.fixture(scope="module")
def results(http) -> dict:
    """Every generating request of this module, sent at once (the engine batches them: the module's time
    is about that of its longest output): name → response body, or chunk list when streamed."""
    def one(item):
        name, (path, body, stream) = item
        return name, _stream(http, path, body) if stream else _post(http, path, body)

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        # the tool prompts (500+ tokens) are alike: two of them first, and the others reuse their cache
        first = dict(pool.map(one, [(k, v) for k, v in REQUESTS.items() if k in WARM]))
        return {**first, **dict(pool.map(one, [(k, v) for k, v in REQUESTS.items() if k not in WARM]))}


def _streamed_text(chunks: list[dict]) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            piece = ch["text"] if "text" in ch else ch["delta"].get("content") or ""
            out[ch["index"]] = out.get(ch["index"], "") + piece
    return out


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


# ---- JSON schemas ------------------------------------------------------------------------------
def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded schema (every string, array and number has a size limit), so that each output ends."""
    kind = rng.choice(["string", "integer", "number", "boolean", "enum"] + (["array", "object"] if depth < 2 else []))
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "integer":
        return {"type": "integer", "minimum": -50, "maximum": rng.randint(0, 999)}
    if kind == "number":  # (multipleOf bounds the fraction's digits)
        return {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, None, True, 2.5], rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": _random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    return _object(rng, depth)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "tags", "ok", "size", "kind", "score"], rng.randint(1, 4))
    return {"type": "object", "properties": {n: _random_schema(rng, depth + 1) for n in names},
            "required": rng.sample(names, rng.randint(1, len(names))), "additionalProperties": False}


def _schema_request(i: int, schema: dict) -> tuple[str, dict]:
    """Request i of the schema test: the fields and endpoints take turns, thinking on and off (more
    completions than chats: their prompts are short, and prompt tokens are most of the module's time)."""
    sampling = {"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0}
    base = {"max_tokens": 400, **sampling}
    chat = {**base, "messages": U, **({} if i % 4 < 2 else NO_THINKING)}
    cmpl = {**base, "prompt": f"record {i}:"}
    return [
        (CHAT, {**chat, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}}),
        (CMPL, {**cmpl, "structured_outputs": {"json": schema}}),
        (CMPL, {**cmpl, "guided_json": json.dumps(schema)}),
        (CMPL, {**cmpl, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}),
        (CHAT, {**chat, **({"guided_json": schema} if i % 10 else {"structured_outputs": {"json": schema}})}),
    ][i % 5]


def _output(resp: dict) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice: a chat choice's content (no reasoning), a completion's text."""
    out = []
    for c in resp["choices"]:
        if "message" in c:
            assert c["message"]["reasoning_content"] is None and not c["message"]["tool_calls"], c
            out.append((c["message"]["content"], c["finish_reason"]))
        else:
            out.append((c["text"], c["finish_reason"]))
    return out


_rng = random.Random(36)
JSON_SCHEMAS = [_object(_rng, 0) for _ in range(20)]
for _i, _s in enumerate(JSON_SCHEMAS):
    _request(f"schema{_i}", *_schema_request(_i, _s))


def test_twenty_random_json_schemas(results):
    for i, schema in enumerate(JSON_SCHEMAS):
        ((text, finish),) = _output(results[f"schema{i}"])
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)


REGEX, CHOICES = r"[a-z]{2,4}-[0-9]{2}", "yes|no|maybe so"
PATTERNS = {
    _request("regex-chat", CHAT, {"messages": U, "max_tokens": 40, "n": 3, "temperature": 1.0, "seed": 1,
                                  "structured_outputs": {"regex": REGEX}}): REGEX,
    _request("regex-cmpl", CMPL, {"prompt": "x", "max_tokens": 40, "n": 2, "temperature": 1.0, "seed": 2,
                                  "guided_regex": REGEX}): REGEX,
    _request("choice-chat", CHAT, {"messages": U, "max_tokens": 10, "n": 3, "temperature": 1.0, "seed": 3,
                                   "guided_choice": CHOICES.split("|"), **NO_THINKING}): CHOICES,
    _request("choice-cmpl", CMPL, {"prompt": "y", "max_tokens": 10, "temperature": 0,
                                   "structured_outputs": {"choice": CHOICES.split("|")}}): CHOICES,
    _request("grammar-cmpl", CMPL, {"prompt": "z", "max_tokens": 20, "temperature": 0,
                                    "guided_grammar": 'start: "x" ("+" /[0-9]/){1,3}'}): r"x(\+[0-9]){1,3}",
    _request("grammar-chat", CHAT, {"messages": U, "max_tokens": 20, "temperature": 0,
                                    "structured_outputs": {"grammar": 'start: "x" ("+" /[0-9]/){1,3}'}}):
        r"x(\+[0-9]){1,3}",
    _request("regex-chat-stream", CHAT, {"messages": U, "max_tokens": 40, "n": 2, "temperature": 1.0, "seed": 1,
                                         "guided_regex": REGEX}, stream=True): REGEX,
    _request("choice-cmpl-stream", CMPL, {"prompt": "x", "max_tokens": 10, "n": 3, "temperature": 1.0, "seed": 2,
                                          "structured_outputs": {"choice": CHOICES.split("|")}}, stream=True): CHOICES,
}


def test_regex_choice_and_grammar_with_n_and_streaming(results):
    for name, pattern in PATTERNS.items():
        path, body, streamed = REQUESTS[name]
        n = body.get("n", 1)
        if streamed:  # the pieces of each choice join to an output that matches
            texts = _streamed_text(results[name])
            assert len(texts) == n and all(re.fullmatch(pattern, t) for t in texts.values()), (name, texts)
            continue
        outs = _output(results[name])
        assert len(outs) == n
        for text, finish in outs:
            assert finish == "stop" and re.fullmatch(pattern, text), (name, text)


def test_json_object(real_server, http):
    """Any JSON object: a bias towards "}" lets the random model close it (both endpoints, n > 1)."""
    close = str(real_server.engine.tokenizer.encode("}", add_special_tokens=False)[0])
    with ThreadPoolExecutor(2) as pool:
        resps = list(pool.map(lambda b: _post(http, *b), [
            (path, {**body, "max_tokens": 60, "n": 2, "temperature": 1.0, "seed": 4,
                    "response_format": {"type": "json_object"}, "logit_bias": {close: 8}})
            for path, body in ((CHAT, {"messages": U}), (CMPL, {"prompt": "obj"}))]))
    for resp in resps:
        for text, finish in _output(resp):
            assert finish == "stop" and isinstance(json.loads(text), dict), text


# ---- tool choice -------------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
            "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "units": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "add_tags", "parameters": {
        "type": "object", "required": ["tags"], "$defs": {"tag": {"type": "string", "maxLength": 4}},
        "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 3},
                       "note": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                "additionalProperties": False}}}}},
    {"type": "function", "function": {"name": "pick", "parameters": {  # not one object of properties: wrapped
        "anyOf": [{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["n"], "additionalProperties": False},
                  {"type": "object", "properties": {"s": {"enum": ["a", "b"]}}, "required": ["s"],
                   "additionalProperties": False}]}}},
    {"type": "function", "function": {"name": "ping"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
           for t in TOOLS}
REQUIRED = [_request(f"required{seed}", CHAT, {
    "messages": U, "tools": TOOLS, "tool_choice": "required", "max_tokens": 600, "temperature": 1.0, "seed": seed,
    **({} if seed % 2 else NO_THINKING), **({"parallel_tool_calls": False} if seed == 3 else {}),
    **({"n": 2} if seed == 2 else {})}) for seed in range(4)]
NAMED = {name: _request(f"named-{name}", CHAT, {
    "messages": U, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": name}},
    "max_tokens": 400, "temperature": 1.0, "seed": 5, **({} if len(name) % 2 else NO_THINKING)},
    stream=name in ("get_weather", "ping")) for name in SCHEMAS}


def _assert_calls(message: dict, only: str | None = None) -> None:
    calls = message["tool_calls"]
    assert calls and message["content"] is None and message["reasoning_content"] is None, message
    for call in calls:
        name = call["function"]["name"]
        assert name in SCHEMAS and (only is None or name == only), call
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_tool_choice_required_always_calls_with_valid_arguments(results):
    for name in REQUIRED:
        body = REQUESTS[name][1]
        choices = results[name]["choices"]
        assert len(choices) == body.get("n", 1)
        for choice in choices:
            assert choice["finish_reason"] == "tool_calls", choice
            _assert_calls(choice["message"])
            if body.get("parallel_tool_calls") is False:
                assert len(choice["message"]["tool_calls"]) == 1


def test_named_tool_choice_calls_that_function(results):
    for fn, name in NAMED.items():
        if not REQUESTS[name][2]:
            (choice,) = results[name]["choices"]
            assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
            _assert_calls(choice["message"], only=fn)
            continue
        # streamed: one call, its id and name first, then argument fragments that join to valid arguments
        chunks = results[name]
        parts = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls", [])]
        assert parts[0]["function"]["name"] == fn and parts[0]["id"].startswith("call_")
        assert all(p["index"] == 0 and "name" not in p["function"] for p in parts[1:])
        jsonschema.validate(json.loads("".join(p["function"].get("arguments") or "" for p in parts)), SCHEMAS[fn])
        assert not any(D in (ch["delta"].get("content") or "") for c in chunks for ch in c["choices"])
        assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["tool_calls"]


def test_the_tool_grammar_allows_what_the_encoder_renders(real_server):
    """The markup of the chat encoding (an assistant turn's tool calls) is a sentence of the grammar, and
    the parser reads it back to the same arguments."""
    from llguidance import LLMatcher

    from dsv4.chat import parse_completion, render_tool_calls, tool_call_grammar

    lltok = real_server.engine.grammars._vocabulary()
    calls = [{"function": {"name": "get_weather", "arguments": {"city": "Oslo <b>", "days": 3}}},
             {"function": {"name": "add_tags", "arguments": {"tags": ["x"], "note": {"ok": True}}}},
             {"function": {"name": "pick", "arguments": {"arguments": {"s": "a"}}}},
             {"function": {"name": "ping", "arguments": {}}}]
    text = "\n\n" + render_tool_calls(calls)
    m = LLMatcher(lltok, tool_call_grammar(TOOLS), log_level=0)
    assert all(m.consume_token(t) for t in real_server.engine.tokenizer.encode(text)), m.get_error()
    assert m.is_accepting()
    parsed = parse_completion(text, thinking=False, tools=TOOLS)["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed] == [
        {"city": "Oslo <b>", "days": 3}, {"tags": ["x"], "note": {"ok": True}}, {"s": "a"}, {}]


# ---- logit_bias --------------------------------------------------------------------------------
def test_logit_bias_makes_greedy_pick_the_token(real_server, http):
    tok = real_server.engine.tokenizer
    tid = tok.encode("hello", add_special_tokens=False)[0]
    body = {"prompt": "abc", "max_tokens": 3, "temperature": 0, "logprobs": 0}
    with ThreadPoolExecutor(3) as pool:
        base, forced, chat = pool.map(lambda b: _post(http, *b), [
            (CMPL, body), (CMPL, {**body, "logit_bias": {str(tid): 100}}),
            (CHAT, {"messages": U, "max_tokens": 2, "temperature": 0, "logit_bias": {str(tid): 100}})])
    assert base["choices"][0]["logprobs"]["tokens"] != [tok.decode([tid])] * 3
    assert forced["choices"][0]["logprobs"]["tokens"] == [tok.decode([tid])] * 3
    assert chat["choices"][0]["message"]["reasoning_content"] == tok.decode([tid]) * 2


# ---- 400s --------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
BAD = [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "needs a schema"),
    (CMPL, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", "invalid json"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
     "response_format.json_schema.schema", "must be an object"),
    (CHAT, {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    (CMPL, {"guided_regex": "(unclosed"}, "guided_regex", "unclosed group"),
    (CHAT, {"structured_outputs": {"regex": "a{3,1}"}}, "structured_outputs.regex", "invalid regex"),
    (CMPL, {"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar", "missing_rule"),
    (CMPL, {"guided_choice": []}, "guided_choice", "non-empty list"),
    (CHAT, {"structured_outputs": {}}, "structured_outputs", "one of json, regex"),
    (CHAT, {"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.json",
     "structured_outputs.json, structured_outputs.regex: only one output constraint"),
    (CMPL, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format",
     "response_format, guided_regex: only one"),
    (CHAT, {"tools": TOOLS, "tool_choice": "required", "guided_choice": ["a"]}, "guided_choice",
     "guided_choice, tool_choice: only one"),
    (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the request's tools"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integerx"}}}}}], "tool_choice": "required"},
     "tool_choice", "invalid grammar"),
    (CMPL, {"logit_bias": {"abc": 1}}, "logit_bias", "key 'abc' is not a token id"),
    (CHAT, {"logit_bias": {"1.5": 1}}, "logit_bias", "is not a token id"),
    (CMPL, {"logit_bias": {"999999": 1}}, "logit_bias", "token id 999999 is outside the vocabulary"),
    (CHAT, {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    (CMPL, {"logit_bias": {"5": "NaN"}}, "logit_bias.5", "finite number"),
    (CHAT, {"messages": [U[0], U[0], {"role": "user", "content": 5}]}, "messages[2].content", "valid string"),
]


@pytest.mark.parametrize("path,extra,param,message", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_constraints_are_400s_naming_the_field(http, path, extra, param, message):
    body = {"messages": U} if path == CHAT else {"prompt": "x"}
    err = _error(http.post(path, json={**body, "max_tokens": 5, **extra}))
    assert err["param"] == param and message in err["message"], err


# ---- the openai client -------------------------------------------------------------------------
def test_openai_client_response_format(real_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["city", "n"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="tiny", messages=U, max_tokens=100, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    with pytest.raises(openai.BadRequestError, match="response_format.json_schema.schema"):
        client.chat.completions.create(model="tiny", messages=U, max_tokens=5,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})

