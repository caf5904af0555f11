"""Batch, chunk and prefix-cache invariance: a request's output does not depend on what runs beside it.

The model is bitwise batch- and chunk-invariant on CPU, so not only the greedy tokens but the
logprob of every sampled token must be identical (compared with ==) whether a request runs alone,
in a batch of 2, 5 or 16, with a chunked-prefill budget of 16, 100 or 4096 tokens, or restores a
shared system prompt from the prefix cache.
"""

from __future__ import annotations

import pytest
from engine_helpers import assert_no_leaks, greedy, make_llm, rand_prompt, rand_prompts, signature

MAX_TOKENS = 3
# 16 short prompts; 65 and 130 cross the 64-token page and the 128 window / HCA ratio under chunking
LENGTHS = (3, 7, 12, 17, 20, 24, 31, 9, 38, 41, 45, 48, 65, 130, 27, 33)

# (max_num_seqs, max_num_batched_tokens): alone first (the baseline), then batches and chunk budgets
ALONE = (1, 4096)
# with the FP8 cache, a representative subset is also run alone (CPU time); the whole set must
# still agree between the FP8 configurations
ALONE_SUBSET = {"auto": list(range(len(LENGTHS))), "fp8_ds_mla": [0, 3, 8, 11, 12, 13]}
CONFIGS = {
    "auto": [(2, 100), (5, 16), (16, 4096)],
    "fp8_ds_mla": [(5, 4096), (16, 16)],
}
CASES = [(dt, seqs, budget) for dt, cfgs in CONFIGS.items() for seqs, budget in cfgs]


@pytest.fixture(scope="module")
def prompts():
    return rand_prompts(77, LENGTHS)


@pytest.fixture(scope="module")
def alone(tiny_ckpt, prompts):
    """Per cache dtype: each request's signature when it runs with no other request in the engine."""
    memo = {}

    def get(kv_dtype):
        if kv_dtype not in memo:
            seqs, budget = ALONE
            llm = make_llm(tiny_ckpt, kv_dtype, max_num_seqs=seqs, max_num_batched_tokens=budget)
            subset = ALONE_SUBSET[kv_dtype]
            outs = llm.generate([prompts[i] for i in subset], greedy(MAX_TOKENS))
            memo[kv_dtype] = {i: signature(o) for i, o in zip(subset, outs)}
            assert_no_leaks(llm)
        return memo[kv_dtype]

    return get


@pytest.fixture(scope="module")
def first_config():
    return {}  # kv dtype → signatures of the first configuration run, to compare the others with


@pytest.mark.parametrize("kv_dtype,max_num_seqs,budget", CASES, ids=[f"{d}-seqs{s}-budget{b}" for d, s, b in CASES])
def test_batch_and_chunk_invariance(tiny_ckpt, prompts, alone, first_config, kv_dtype, max_num_seqs, budget):
    baseline = alone(kv_dtype)
    llm = make_llm(tiny_ckpt, kv_dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    engine = llm.engine
    ids = [engine.add_request(p, greedy(MAX_TOKENS)) for p in prompts]
    widest = 0
    chunked = False
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        widest = max(widest, len(engine.scheduler.running))
        chunked |= any(0 < r.num_computed < len(r.prompt_token_ids) for r in engine.scheduler.running)
    # the configuration really batched / chunked as intended (a 16-token budget caps the batch:
    # decodes take one token each)
    if budget >= sum(LENGTHS):
        assert widest == min(max_num_seqs, len(prompts))
    else:
        assert widest >= min(max_num_seqs, 2)
    assert chunked == (budget < max(LENGTHS))
    sigs = [signature(done[rid]) for rid in ids]
    for i, sig in enumerate(sigs):
        if i in baseline:
            assert sig == baseline[i], (f"prompt {i} ({LENGTHS[i]} tokens) differs from its solo run with "
                                        f"max_num_seqs={max_num_seqs}, budget={budget}")
    assert sigs == first_config.setdefault(kv_dtype, sigs)
    assert_no_leaks(llm)


# ---- a shared system prompt, with and without prefix caching ------------------------------
SHARED = 512  # two blocks: a hit restores every cache kind at 256 or 512 tokens


@pytest.fixture(scope="module")
def shared_prompts():
    import torch

    g = torch.Generator().manual_seed(5)
    system = rand_prompt(g, SHARED)
    return [system + rand_prompt(g, 3),  # computes everything, registers blocks 0 and 1
            system + rand_prompt(g, 9)]  # hits them


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_ds_mla"])
def test_prefix_cache_invariance(tiny_ckpt, shared_prompts, kv_dtype):
    # baseline: prefix caching off, both in one batch
    off = make_llm(tiny_ckpt, kv_dtype, enable_prefix_caching=False, max_num_batched_tokens=4096)
    base = [signature(o) for o in off.generate(shared_prompts, greedy(MAX_TOKENS))]
    assert off.engine.kv.hits == 0
    assert_no_leaks(off)
    del off

    # prefix caching on, concurrent with a chunked-prefill budget of 100: the 2nd request is admitted
    # while the 1st is still prefilling (5 steps of 100, then its last 15 + the 2nd's first 85) and
    # hits the one block completed by then: a 256-token hit, mid-way through the shared prompt
    on = make_llm(tiny_ckpt, kv_dtype, enable_prefix_caching=True, max_num_seqs=16, max_num_batched_tokens=100)
    got = [signature(o) for o in on.generate(shared_prompts, greedy(MAX_TOKENS))]
    assert on.engine.kv.hits == 256
    assert got == base, "a 256-token prefix-cache hit under chunked prefill changed the output"
    assert_no_leaks(on)
    # the same requests again, one after the other: both restore all 512 shared tokens
    on.engine.kv.hits = 0
    again = [signature(o) for o in on.generate(shared_prompts[:1], greedy(MAX_TOKENS))]
    again += [signature(o) for o in on.generate(shared_prompts[1:], greedy(MAX_TOKENS))]
    assert on.engine.kv.hits == 2 * SHARED
    assert again == base, "a 512-token prefix-cache hit changed the output"
    assert_no_leaks(on)
