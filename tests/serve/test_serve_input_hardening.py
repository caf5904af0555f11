"""What a client sends can never cost a 5xx or stall other clients: the body-size limit, the
content type, large inputs tokenized off the event loop, what the validation must still let
through, and 5xx bodies that name the request and leave the detail to the log."""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time

import httpx
import pytest

for _dep in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_dep)

C, CHAT = "/v1/completions", "/v1/chat/completions"
U = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(real_server):
    with httpx.Client(base_url=real_server.url, timeout=120) as c:
        yield c


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---- size and content type -------------------------------------------------------------------
def test_default_body_limit_is_32_mib(real_server, http):
    from dsv4.serve.serving import MAX_BODY_BYTES

    assert MAX_BODY_BYTES == 32 << 20 and real_server.app.state.dsv4.max_body_bytes == MAX_BODY_BYTES
    body = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    err = _error(http.post(C, content=body, headers={"content-type": "application/json"}), 413)
    assert err["message"].startswith(f"Request body too large: {len(body)} bytes, the limit is {MAX_BODY_BYTES} bytes")
    assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"


def test_body_limit_is_configurable_and_holds_for_chunked_bodies(real_server, http, monkeypatch):
    monkeypatch.setattr(real_server.app.state.dsv4, "max_body_bytes", 1000)
    over = json.dumps({"prompt": "a" * 1000}).encode()
    assert "1000 bytes" in _error(http.post(C, content=over), 413)["message"]

    def chunks():  # no Content-Length: the limit is counted while the body arrives
        for i in range(0, len(over), 100):
            yield over[i:i + 100]

    err = _error(http.post(C, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert "more than 1000 bytes" in err["message"]
    ok = http.post(C, json={"prompt": "a" * 900, "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"])
def test_a_body_that_is_not_json_by_its_content_type_is_refused(http, ctype):
    r = http.post(C, content=b'{"prompt": "x", "max_tokens": 1}', headers={"content-type": ctype})
    err = _error(r, 400)
    assert err["message"] == f"Content-Type must be application/json, got {ctype!r}", err


@pytest.mark.parametrize("headers", [{}, {"content-type": "application/json; charset=utf-8"},
                                     {"content-type": "application/merge-patch+json"}])
def test_json_content_types_and_none_are_accepted(http, headers):
    r = http.post(C, content=b'{"prompt": "x", "max_tokens": 1}', headers=headers)
    assert r.status_code == 200, r.text


# ---- large inputs do not block the event loop ------------------------------------------------
def _large_text() -> str:
    """About 1 MB: a second or so of tokenizing, and several times max_model_len tokens."""
    return "".join(f"word{i % 997} and more text, line {i}.\n" for i in range(30000))


@pytest.mark.parametrize("path", [C, CHAT])
def test_health_answers_while_a_large_prompt_is_tokenized(real_server, path):
    """Probes keep being answered, every 0.5 s at the least, while a large prompt is tokenized.

    The server runs in this process, so what is timed is the gap between one answered probe and
    the next: a tokenizer call holding the GIL stalls this thread too, not only the event loop.
    """
    text = _large_text()
    body = {"prompt": text} if path == C else {"messages": [{"role": "user", "content": text}]}
    result = {}

    def large():
        t0 = time.monotonic()
        r = httpx.post(real_server.url + path, json=body, timeout=120)
        result.update(status=r.status_code, error=r.json()["error"], seconds=time.monotonic() - t0)

    gaps = []
    thread = threading.Thread(target=large)
    with httpx.Client(base_url=real_server.url, timeout=60) as probe:
        probe.get("/health")  # the probe's connection is open before the large request starts
        thread.start()
        last = time.monotonic()
        while thread.is_alive():
            assert probe.get("/health").status_code == 200
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            time.sleep(0.02)
    thread.join()
    assert result["status"] == 400 and "maximum context length" in result["error"]["message"], result
    assert len(gaps) >= 5, (gaps, result)  # the probes ran while the large request was in flight
    assert max(gaps) < 0.5, (max(gaps), len(gaps), result["seconds"])


def test_large_requests_are_answered_as_small_ones(real_server, http):
    """The worker-thread path (bodies of OFF_LOOP_BYTES and more) gives the same answers."""
    from dsv4.chat.tokenizer import GIL_FREE_LENGTH
    from dsv4.serve.serving import OFF_LOOP_BYTES

    tok = real_server.engine.tokenizer
    text = _large_text()[:200_000]
    assert len(text) > OFF_LOOP_BYTES
    ids = tok.encode(text)
    assert len(text) >= GIL_FREE_LENGTH and tok._tk.encode(text).ids == ids  # the GIL-free path: same ids
    assert tok._tk.decode(ids) == tok.decode(ids)
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["tokens"] == ids
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == tok.decode(ids)
    pad = {"user": "u" * OFF_LOOP_BYTES}  # an ignored field makes a short prompt a large body
    prompt = ids[:300]
    r = http.post(C, json={"prompt": prompt, "max_tokens": 1, "echo": True, **pad})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(tok.decode(prompt)), r.text
    small = http.post(CHAT, json={"messages": U, "max_tokens": 1})
    large = http.post(CHAT, json={"messages": U, "max_tokens": 1, **pad})
    assert large.status_code == 200 and large.json()["usage"] == small.json()["usage"], large.text


# ---- what validation must still accept -------------------------------------------------------
def _nested(depth: int):
    value = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def test_nesting_up_to_the_limit_is_accepted(http):
    from dsv4.serve.openai_api import MAX_JSON_DEPTH

    # the body, response_format and json_schema are the 3 levels above the schema
    fmt = lambda d: {"type": "json_schema", "json_schema": {"schema": _nested(d)}}  # noqa: E731
    ok = http.post(CHAT, json={"messages": U, "max_tokens": 1, "response_format": fmt(MAX_JSON_DEPTH - 3)})
    assert ok.status_code == 200, ok.text
    err = _error(http.post(CHAT, json={"messages": U, "max_tokens": 1, "response_format": fmt(MAX_JSON_DEPTH - 2)}),
                 400)
    assert f"nested more than {MAX_JSON_DEPTH} levels deep" in err["message"]


def test_surrogate_pairs_are_fine(http):
    r = http.post(C, content=b'{"prompt": "\\ud83d\\ude00 x", "max_tokens": 1, "echo": true}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("\U0001F600 x"), r.text


def test_negative_and_extreme_seeds_are_accepted_as_vllm_does(http):
    """vLLM and OpenAI take any int64 seed; a negative one is as reproducible as any other."""
    def run(seed, n=1):
        r = http.post(C, json={"prompt": "x", "max_tokens": 4, "temperature": 1.0, "seed": seed, "n": n,
                               "ignore_eos": True})
        assert r.status_code == 200, r.text
        return [c["text"] for c in r.json()["choices"]]

    assert run(-1) == run(-1)
    run(-(2**63))
    assert len(run(2**63 - 1, n=2)) == 2  # the engine seeds choice i with seed + i


@pytest.mark.parametrize("extra", [{"response_format": {"type": "text"}}, {"response_format": {"type": "json_object"}},
                                   {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
                                   {"reasoning_effort": "MAX"}, {"reasoning_effort": "xhigh"},
                                   {"reasoning_effort": "none"}, {"reasoning_effort": " minimal "},
                                   {"chat_template_kwargs": {"reasoning_effort": "low"}}])
def test_known_response_formats_and_efforts_are_accepted(http, extra):
    r = http.post(CHAT, json={"messages": U, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text


# ---- 5xx: the request id in the body, the detail in the log ----------------------------------
SECRET = "boom at /opt/lib/python3.11/site-packages/torch/distributed/c10d.py from 10.1.2.3:29500"


def _internal(err: dict) -> str:
    m = re.fullmatch(r"internal error while running request (\S+); see the server log", err["message"])
    assert m is not None and err["type"] == "server_error", err
    return m.group(1)


def _logged(caplog, rid: str, detail: str) -> bool:
    return any(rid in r.getMessage() and detail in r.getMessage() for r in caplog.records)


def test_a_handler_bug_is_a_500_naming_only_the_request(http, monkeypatch, caplog):
    from dsv4.serve import completions

    def broken(*_args, **_kwargs):
        raise RuntimeError(SECRET)

    caplog.set_level(logging.ERROR, logger="dsv4.serve")
    monkeypatch.setattr(completions, "_prompts", broken)
    r = http.post(C, json={"prompt": "x", "max_tokens": 1})
    rid = _internal(_error(r, 500))
    assert r.headers["connection"] == "close"  # uvicorn drops the connection after an unhandled error
    assert _logged(caplog, rid, SECRET), caplog.text
    assert any(r.exc_info for r in caplog.records if rid in r.getMessage())  # with its traceback


def test_a_handler_bug_mid_stream_is_an_error_event_naming_only_the_request(http, monkeypatch, caplog):
    from dsv4.serve import chat_completions

    def broken(*_args, **_kwargs):
        raise RuntimeError(SECRET)

    caplog.set_level(logging.ERROR, logger="dsv4.serve")
    monkeypatch.setattr(chat_completions, "chat_logprobs", broken)
    body = {"messages": U, "max_tokens": 3, "stream": True, "logprobs": True, "ignore_eos": True}
    with http.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    first, error = json.loads(events[0]), json.loads(events[-2])
    assert _internal(error["error"]) == first["id"]
    assert _logged(caplog, first["id"], SECRET), caplog.text


def test_the_server_still_serves(http, real_server):
    assert http.get("/health").status_code == 200
    assert http.post(C, json={"prompt": "ok", "max_tokens": 2}).status_code == 200
    real_server.wait_idle()
    assert real_server.on_engine(lambda e: e.kv.leaks()) == []


# ---- SamplingParams (the offline API validates the same way) ---------------------------------
@pytest.mark.parametrize("field,value", [
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan), ("min_p", math.nan),
    ("presence_penalty", math.nan), ("frequency_penalty", -math.inf), ("repetition_penalty", math.nan),
    ("repetition_penalty", math.inf), ("temperature", "0.5"), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("seed", 1.5),
])
def test_sampling_params_refuse_what_the_sampler_cannot_use(field, value):
    from dsv4.engine.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} must be "):
        SamplingParams(**{field: value})


def test_sampling_params_accept_the_whole_seed_range_torch_takes():
    from dsv4.engine.sampling_params import SamplingParams

    for seed in (-(2**63), -1, 0, 2**64 - 1):
        assert SamplingParams(seed=seed).seed == seed
