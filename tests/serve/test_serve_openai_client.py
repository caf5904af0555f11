"""The tiny model behind the server, driven by the official ``openai`` client (and httpx for extras).

Usage counts are checked against token ids: prompt_tokens against /tokenize of the same prompt,
completion_tokens against the number of generated tokens (logprob entries, one per token).
"""

from __future__ import annotations

import json

import httpx
import pytest
from serve_test_support import metric

for _dep in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_dep)

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _tokenize(srv, **body) -> list[int]:
    r = httpx.post(srv.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["count"] == len(out["tokens"])
    return out["tokens"]


def test_models_health_version(real_server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(real_server.url + "/health").status_code == 200
    assert httpx.get(real_server.url + "/version").json()["version"]


def test_completion_usage_and_logprobs(real_server, client):
    prompt = "The capital of France is"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    ids = _tokenize(real_server, prompt=prompt)
    tok = real_server.engine.tokenizer
    assert ids == tok.encode(prompt, add_special_tokens=True)  # BOS + text, as vLLM's HF tokenizer adds
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 4 == len(r.choices[0].logprobs.tokens)
    assert r.usage.total_tokens == len(ids) + 4
    c = r.choices[0]
    assert c.finish_reason == "length"
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0 and 2 <= len(top) <= 3
        assert token_lp == pytest.approx(max(top.values()))  # greedy: the sampled token is the argmax


def test_echo_prompt_logprobs_max_tokens_zero(real_server):
    """lm-eval's loglikelihood request shape, and the prompt-only variant (max_tokens=0)."""
    tok = real_server.engine.tokenizer
    ids = tok.encode("one two three four", add_special_tokens=True)
    body = {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 1, "temperature": 0}
    r = httpx.post(real_server.url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=300).json()
    lp = r["choices"][0]["logprobs"]
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    assert r["choices"][0]["text"] == tok.decode(ids)
    r1 = httpx.post(real_server.url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=300).json()
    lp1 = r1["choices"][0]["logprobs"]
    assert len(lp1["tokens"]) == len(ids) + 1 and r1["usage"]["completion_tokens"] == 1
    assert lp1["token_logprobs"][:-1] == lp["token_logprobs"]  # prompt scores do not depend on max_tokens


def test_completion_batch_prompts_and_n(real_server, client):
    r = client.completions.create(model="tiny", prompt=["a b", "c d e"], max_tokens=2, n=2, temperature=1.0,
                                  seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    n_prompt = len(_tokenize(real_server, prompt="a b")) + len(_tokenize(real_server, prompt="c d e"))
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 8


def test_chat_default_thinking_and_usage(real_server, client):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    ids = _tokenize(real_server, messages=messages)
    tok = real_server.engine.tokenizer
    assert tok.decode(ids).endswith("<｜Assistant｜><think>")  # vLLM's default: thinking mode, effort high
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 3 == len(r.choices[0].logprobs.content)
    msg = r.choices[0].message
    assert msg.role == "assistant"
    extra = msg.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")  # vLLM's newer alias
    assert r.choices[0].finish_reason == "length"
    for entry in r.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())


def test_chat_thinking_off(real_server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for extra in ({"chat_template_kwargs": {"thinking": False}}, {"reasoning_effort": "none"}):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                           extra_body={**extra, "ignore_eos": True})
        ids = _tokenize(real_server, messages=messages, chat_template_kwargs={"thinking": False})
        assert real_server.engine.tokenizer.decode(ids).endswith("<｜Assistant｜></think>")
        assert r.usage.prompt_tokens == len(ids)
        assert (r.choices[0].message.model_extra or {}).get("reasoning_content") is None


def test_chat_streaming(real_server, client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True,
                                            temperature=0, logprobs=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == len(_tokenize(real_server, messages=messages))
    n_logprobs = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    assert usage.completion_tokens == 4 == n_logprobs
    text = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    text += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the same request without streaming gives the same text (greedy)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    m = r.choices[0].message
    assert text == ((m.model_extra or {}).get("reasoning_content") or "") + (m.content or "")


def test_completion_streaming_raw_sse(real_server):
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 3, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", real_server.url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert events[-1]["usage"]["completion_tokens"] == 3
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"


def test_tokenize_detokenize_roundtrip(real_server):
    ids = _tokenize(real_server, prompt="héllo wörld", add_special_tokens=False)
    r = httpx.post(real_server.url + "/detokenize", json={"tokens": ids}).json()
    assert r["prompt"] == "héllo wörld"


def test_metrics_exposed(real_server):
    """vLLM's names, labels and types, so that its dashboards work unchanged."""
    # its own request: under xdist this module's other tests may run in the other worker's server
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 2, "temperature": 0}
    assert httpx.post(real_server.url + "/v1/completions", json=body, timeout=300).status_code == 200
    text = httpx.get(real_server.url + "/metrics").text
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_waiting",
                 "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:request_time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
                 "vllm:request_generation_tokens_bucket", "dsv4:kernel_compiles", "http_requests_total"):
        assert name + "{" in text or name + " " in text, name
    assert "dsv4:http" not in text and "dsv4:prompt" not in text
    assert metric(text, "http_requests_total", handler="/v1/completions", method="POST", status="2xx") >= 1
    assert metric(text, "vllm:generation_tokens_total", model_name="tiny", engine="0") >= 2
    assert metric(text, "vllm:request_generation_tokens_count", model_name="tiny") >= 1
    assert metric(text, "vllm:request_queue_time_seconds_count", model_name="tiny") >= 1
    assert metric(text, "vllm:inter_token_latency_seconds_count", model_name="tiny") >= 1
    assert metric(text, "vllm:prefix_cache_queries_total", model_name="tiny") >= 3  # tokens, not requests
    assert metric(text, "http_requests_total", handler="/metrics") == 0  # scrapes and probes are not counted