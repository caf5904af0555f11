"""Six runs of the same 16-request batch on one engine: finite logits and identical outputs every time.

The engine is reused, so each run lands on pages, blocks and state slots that earlier runs wrote:
stale or uninitialised cache contents read by mistake would show up as NaN/Inf or changed tokens.
The free lists hand the pages back in reverse, so the runs alternate between two placements (request i
on page i, then on page 15 - i): every run from the second reads over another placement's contents, so six
runs see each placement over the other's three times.
The seed report's fifty runs of a two-request batch are ``tests/validate``'s.
The sampler raises FloatingPointError on non-finite logits, so a clean ``generate`` is the
finiteness check; the logits are also checked directly through a wrapper around the runner.
The ``auto`` cache keeps this affordable on CPU (an FP8 step costs ~1.7x); the FP8 cache is
reused across requests in the invariance, preemption and accounting tests.
"""

from __future__ import annotations

import torch
from engine_helpers import assert_no_leaks, greedy, make_llm, rand_prompts, signature

RUNS = 6
BATCH = 16
MAX_TOKENS = 3  # one prefill step and two decode steps per run


def test_repeated_runs_identical_and_finite(tiny_ckpt):
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(2, 9, (BATCH,), generator=g).tolist()
    prompts = rand_prompts(12, lengths)
    llm = make_llm(tiny_ckpt, "auto", max_num_seqs=BATCH, max_num_batched_tokens=2048, max_model_len=256,
                   kv_cache_memory=96 << 20)
    engine = llm.engine
    seen = {"rows": 0, "bad": 0}
    run = engine.runner.run

    def checked_run(schedule):
        batch, logits = run(schedule)
        seen["rows"] += logits.shape[0]
        seen["bad"] += int((~torch.isfinite(logits)).any(dim=-1).sum())
        return batch, logits

    engine.runner.run = checked_run
    first = None
    for i in range(RUNS):
        outs = llm.generate(prompts, greedy(MAX_TOKENS))  # raises FloatingPointError on NaN/Inf logits
        sig = [signature(o) for o in outs]
        assert all(len(t) == MAX_TOKENS and all(lp <= 0 for lp in lps) for t, lps in sig)
        if first is None:
            first = sig
        assert sig == first, f"run {i} differs from run 0"
        assert_no_leaks(llm)
    assert seen["bad"] == 0
    assert seen["rows"] == RUNS * BATCH * MAX_TOKENS  # every sampled row went through the check
