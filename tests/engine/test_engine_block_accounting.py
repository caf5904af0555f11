"""Block, SWA-page and slot accounting: nothing leaks, resets free everything, windows are released."""

from __future__ import annotations

import pytest
from engine_helpers import assert_all_free_after_reset, assert_no_leaks, greedy, make_llm, rand_prompts, signature

from dsv4.model.step import BLOCK, RETAINED_SWA, SWA_PAGE

BUDGET = 128


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    """One engine for the module: a 128-token budget so long prompts are chunked, prefix caching on."""
    return make_llm(tiny_ckpt, "fp8_ds_mla", max_num_seqs=8, max_num_batched_tokens=BUDGET, max_model_len=1024)


def _live(alloc) -> list[int]:
    return [p for p in alloc.swa if p >= 0]


def test_reset_prefix_cache_returns_every_page(llm):
    engine, kv = llm.engine, llm.engine.kv
    kv.reset_prefix_cache()
    a, b = rand_prompts(21, [520, 300])
    outs = llm.generate([a, b], greedy(4))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert_no_leaks(llm)
    # 520 + 4 computed tokens → blocks 0 and 1 cached, 300 → block 0: three cached blocks, each
    # keeping the two SWA pages of the window before its end
    assert len(kv.cached) == 3 and len(kv.blocks.evictable) == 3
    assert all(len(e.swa) == RETAINED_SWA for e in kv.cached.values())
    assert kv.swa.num_used == 3 * RETAINED_SWA
    assert_all_free_after_reset(llm)

    # reset while a running request holds a cached block: the entry is forgotten at once and the
    # block is freed (not cached) when the request ends
    rid = engine.add_request(b, greedy(4))
    while engine.requests[rid][0].num_computed < len(b):
        engine.step()
    assert len(kv.cached) == 1  # block 0 of the running request was registered
    kv.reset_prefix_cache()
    assert kv.cached == {} and kv.block_hash == {}
    engine.run_to_completion([rid])
    assert_no_leaks(llm)
    assert len(kv.blocks.evictable) == 0
    assert_all_free_after_reset(llm)


def test_abort_mid_decode_mid_prefill_and_waiting_leaks_nothing(llm):
    engine, kv = llm.engine, llm.engine.kv
    kv.reset_prefix_cache()
    a, b, c, d, e = rand_prompts(22, [20, 30, 500, 10, 15])
    params = greedy(8)
    ids = {name: engine.add_request(p, params) for name, p in zip("abcde", [a, b, c, d, e])}
    for _ in range(3):
        engine.step()
    req = {k: engine.requests[v][0] for k, v in ids.items()}
    assert 0 < len(req["a"].output_token_ids) < 8 and 0 < len(req["b"].output_token_ids) < 8  # mid-decode
    assert 0 < req["c"].num_computed < len(c) and not req["c"].output_token_ids  # mid-prefill (chunked)
    assert req["d"].num_computed == 0 and req["d"] in engine.scheduler.waiting  # never scheduled
    held = kv.blocks.num_used
    for k in "acd":
        engine.abort_request(ids[k])
        assert req[k].finish_reason == "abort" and not req[k].alloc.blocks and req[k].alloc.slot < 0
    assert kv.blocks.num_used < held
    assert ids["a"] not in engine.requests
    done = engine.run_to_completion([ids["b"], ids["e"]])
    assert_no_leaks(llm)
    # the survivors are unaffected by the aborts: same output as on their own
    alone = llm.generate([b, e], params)
    assert [signature(done[ids["b"]]), signature(done[ids["e"]])] == [signature(o) for o in alone]
    assert_no_leaks(llm)

    # aborting a request that holds prefix-cache blocks (a 256-token hit) leaks nothing either
    system = rand_prompts(23, [300])[0]
    llm.generate([system], greedy(2))  # registers block 0
    hits = kv.hits
    rid = engine.add_request(system[:BLOCK] + rand_prompts(24, [20])[0], params)
    engine.step()
    engine.step()
    r = engine.requests[rid][0]
    assert kv.hits == hits + BLOCK and r.alloc.blocks and kv.blocks.ref[r.alloc.blocks[0]] == 1
    assert r.output_token_ids  # decoding
    shared = r.alloc.blocks[0]
    engine.abort_request(rid)
    assert_no_leaks(llm)
    assert shared in kv.block_hash and shared in kv.blocks.evictable  # still cached for the next request
    assert_all_free_after_reset(llm)


def test_sliding_window_pages_released_while_running(llm):
    engine, kv = llm.engine, llm.engine.kv
    kv.reset_prefix_cache()
    prompt = rand_prompts(25, [700])[0]
    n_new = 16  # 700 → 716 crosses the page boundary at 704 while decoding
    rid = engine.add_request(prompt, greedy(n_new))
    r = engine.requests[rid][0]
    steps = 0
    while not r.finished:
        engine.step()
        steps += 1
        if r.finished:
            break
        n = r.num_computed
        live = _live(r.alloc)
        # the window (128 tokens before the next query) spans at most 3 pages; every page wholly
        # before it has been given back (-1) and everything from it on is still held
        first_needed = max(0, n - (kv.window - 1)) // SWA_PAGE
        assert len(r.alloc.swa) == -(-n // SWA_PAGE)
        assert all(p == -1 for p in r.alloc.swa[:first_needed])
        assert all(p >= 0 for p in r.alloc.swa[first_needed:])
        assert r.alloc.swa_released == first_needed  # the next release starts there, not at page 0
        assert len(live) <= 3, f"{len(live)} live SWA pages after {n} tokens"
        # the pool holds exactly the live pages plus those the prefix cache retains
        retained = {p for e in kv.cached.values() for p in e.swa}
        assert kv.swa.num_used == len(set(live) | retained)
        assert len(retained) == RETAINED_SWA * (n // BLOCK)
    assert steps == -(-len(prompt) // BUDGET) + n_new - 1  # chunked by the budget, then one per token
    assert len(r.output_token_ids) == n_new
    assert_no_leaks(llm)
    assert_all_free_after_reset(llm)


def test_token_slice_and_new_block_check_avoid_the_whole_token_list(llm, monkeypatch):
    """A step reads a few tokens of each request: ``token_slice`` equals slicing the whole list
    across the prompt/output boundary, and the prefix cache is offered blocks (which builds the
    whole list) only on a step that closed one."""
    engine, kv = llm.engine, llm.engine.kv
    calls = []
    register = kv.register_full_blocks
    monkeypatch.setattr(kv, "register_full_blocks", lambda alloc, ids: calls.append(len(ids)) or register(alloc, ids))
    rid = engine.add_request(rand_prompts(26, [250])[0], greedy(12))
    r = engine.requests[rid][0]
    steps = 0
    while not r.finished:
        engine.step()
        steps += 1
        assert not kv.has_new_full_blocks(r.alloc)  # whatever the step closed was registered
    full = r.all_token_ids
    n = len(r.prompt_token_ids)
    for a, b in ((0, 5), (n - 3, n), (n - 3, n + 4), (n, n + 2), (n + 5, len(full)), (0, len(full))):
        assert r.token_slice(a, b) == full[a:b], (a, b)
    # 250 + 12 tokens close block 0 once (its 256th token is computed at decode step 6 of 12)
    assert steps > 2 and calls == [BLOCK + 1]  # once, with the 257 tokens known then
    assert_no_leaks(llm)
