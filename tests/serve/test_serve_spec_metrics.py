"""vLLM's speculative-decoding counters on /metrics: fed from the engine's SpecStats, consistent with
each other, and absent without a speculative config. In process, on the canary (its trained MTP
layer gets drafts accepted, where the tiny model's random one almost never does)."""

from __future__ import annotations

import copy

import httpx
import pytest
from serve_test_support import ServerThread, make_engine, metric

from dsv4.canary import default_model_dir

for _dep in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_dep)

K = 2
LBL = {"model_name": "canary", "engine": "0"}
SPEC_NAMES = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
              "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total")


def _serve(**engine_kw):
    from dsv4.serve import build_app

    engine = make_engine(default_model_dir(), None, **engine_kw)
    return ServerThread(build_app(engine, served_model_name="canary"))


def _complete(srv, prompt: str, **kw) -> dict:
    r = httpx.post(srv.url + "/v1/completions", json={"model": "canary", "prompt": prompt, "max_tokens": 16, **kw},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_spec_decode_counters_follow_the_engine():
    with _serve(speculative_config={"method": "mtp", "num_speculative_tokens": K}) as srv:
        before = httpx.get(srv.url + "/metrics").text
        assert all(metric(before, name, **LBL) == 0 for name in SPEC_NAMES)  # exported at 0 from the start
        for i, prompt in enumerate(("copy:hello42=", "copy:dsv4canary=", "123+456=", "copy:abcdefghijkl=")):
            _complete(srv, prompt, temperature=0.0 if i % 2 else 1.0, seed=i)
        srv.wait_idle()
        stats = srv.on_engine(lambda e: copy.deepcopy(e.spec_stats))
        text = httpx.get(srv.url + "/metrics").text
    drafts = metric(text, "vllm:spec_decode_num_drafts_total", **LBL)
    draft_tokens = metric(text, "vllm:spec_decode_num_draft_tokens_total", **LBL)
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total", **LBL)
    per_pos = [metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i), **LBL)
               for i in range(K)]
    assert 0 < drafts and drafts <= draft_tokens <= K * drafts
    assert 0 < accepted <= draft_tokens
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1]  # a position is reached through the ones before
    assert per_pos[0] <= drafts
    assert f'position="{K}"' not in text
    assert (drafts, draft_tokens, accepted, per_pos) == (stats.num_drafts, stats.num_draft_tokens,
                                                         stats.num_accepted_tokens, stats.accepted_per_position)


def test_no_spec_decode_metrics_without_speculation():
    with _serve() as srv:
        _complete(srv, "copy:hello42=")
        text = httpx.get(srv.url + "/metrics").text
    assert "vllm:generation_tokens_total" in text
    assert "spec_decode" not in text
