"""Engine behaviour the validation work ran into, kept as a regression test.

``LLM.generate`` used to abort its requests only when ``add_request`` failed: when a step raised —
the sampler's ``FloatingPointError`` on non-finite logits, say — the request stayed RUNNING,
kept its block, SWA page and state slot, and was stepped again by every later ``generate``.
``LLM.generate`` now aborts the call's requests when a step raises.
"""

from __future__ import annotations

import pytest
from validate_test_support import greedy, llm_over

from dsv4.engine.sampler import Sampler


def test_generate_that_raises_releases_its_request(tiny_ckpt, validate_model, monkeypatch):
    llm = llm_over(validate_model, tiny_ckpt, kv_cache_memory=96 << 20, max_num_seqs=4, max_model_len=256)
    true_sample = Sampler.sample

    def nan_at_second_token(self, req, logits, mask=None):
        if req.output_token_ids:
            logits = logits.clone()
            logits[5] = float("nan")
        return true_sample(self, req, logits, mask)

    monkeypatch.setattr(Sampler, "sample", nan_at_second_token)
    monkeypatch.setattr(Sampler, "batched_greedy", False)  # every row through the patched sample()
    with pytest.raises(FloatingPointError):
        llm.generate("Hello there", greedy(4))
    monkeypatch.setattr(Sampler, "sample", true_sample)
    eng = llm.engine
    assert not eng.has_unfinished_requests() and eng.requests == {}, \
        f"still tracked: {list(eng.requests)}; leaks: {eng.kv.leaks()}"
    assert eng.kv.leaks() == []
