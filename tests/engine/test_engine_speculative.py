"""MTP speculative decoding: greedy output identical to decoding without it, caches rolled back exactly.

The tiny checkpoint's MTP layer is random, so its drafts are almost never accepted. To drive
acceptance and rejection at every draft position, most tests wrap the MTP proposer (which still
runs, so its own cache is checked) and replace its drafts by the continuation a run without
speculation produced, with one wrong token at a rotating position.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_no_leaks, greedy, make_llm, rand_prompts, signature
from spec_helpers import (
    assert_draft_window_is_the_reference_pass,
    assert_images_match_a_run_without_speculation,
    record_images,
    run,
    script,
)
from tiny_vocab import RELEASE_TOKEN_HI

from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.speculative import SpecStats
from dsv4.engine.structured import StructuredOutputsParams

# decoding from these lengths crosses the 64-token SWA page, the 128-token window / HCA ratio, the
# 256-token block, and ratio-4 groups everywhere
LENGTHS = (58, 122, 250, 9)
NEW = 16


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def prompts():
    return rand_prompts(37, LENGTHS)


@pytest.fixture(scope="module")
def plain(tiny_ckpt, prompts):
    """Outputs without speculation (per request id), for both attention paths."""
    out = {}
    for attention in ("reference", "batched"):
        llm = make_llm(tiny_ckpt, "auto", max_model_len=512, attention=attention, backend="torch")
        out[attention] = {rid: o for rid, o in run(llm, prompts, greedy(NEW)).items()}
    return out


@pytest.mark.parametrize("k,attention", [(1, "reference"), (3, "reference"), (2, "batched")])
def test_greedy_identical_with_rejections_at_every_position(tiny_ckpt, prompts, plain, k, attention):
    llm = make_llm(tiny_ckpt, "auto", max_model_len=512, attention=attention, backend="torch",
                   speculative_config=mtp(k))
    truth = {rid: o.outputs[0].token_ids for rid, o in plain[attention].items()}
    scripted = script(llm, truth)
    got = run(llm, prompts, greedy(NEW))
    for rid, o in got.items():
        assert signature(o) == signature(plain[attention][rid]), rid
    st = llm.engine.spec_stats
    assert st.num_accepted_tokens > 0 and st.num_drafts > 0
    assert st.accepted_per_position[k - 1] > 0  # some steps accepted every draft
    assert st.num_accepted_tokens < st.num_draft_tokens  # and some rejected
    assert min(scripted.calls.values()) >= k  # every request went through every rejection position
    assert_no_leaks(llm)


def test_plain_greedy_is_verified_from_device_picks(tiny_ckpt, prompts, plain, monkeypatch):
    """Requests whose token is the raw argmax (no logprobs, penalties, grammar) are verified from their rows'
    picks made on the device (``verify_picks``: no logits row copied to the host): the tokens of a run
    without speculation and the acceptance counts the host rows give, rejections at every position."""
    import dsv4.engine.engine as engine_mod

    truth = {rid: o.outputs[0].token_ids for rid, o in plain["batched"].items()}
    stats, host_rows = {}, {}
    for lp in (None, 0):
        calls = []
        monkeypatch.setattr(engine_mod, "verify", lambda *a, _v=engine_mod.verify, **k: calls.append(1) or _v(*a, **k))
        llm = make_llm(tiny_ckpt, "auto", max_model_len=512, attention="batched", backend="torch",
                       speculative_config=mtp(3))
        script(llm, truth)
        got = run(llm, prompts, greedy(NEW, logprobs=lp))
        monkeypatch.undo()
        assert {rid: o.outputs[0].token_ids for rid, o in got.items()} == truth
        st = llm.engine.spec_stats
        stats[lp] = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, list(st.accepted_per_position))
        host_rows[lp] = len(calls)
    assert host_rows[None] == 0 and host_rows[0] > 0
    assert stats[None] == stats[0] and stats[None][2] < stats[None][1]


def test_greedy_identical_with_the_mtp_drafts_in_every_batch_composition(tiny_ckpt, prompts, plain):
    """The MTP layer's own drafts (nearly always rejected here): the same tokens alone, together,
    staggered, and with async scheduling on."""
    want = {rid: signature(o) for rid, o in plain["reference"].items()}
    llm = make_llm(tiny_ckpt, "auto", max_model_len=512, speculative_config=mtp(2), async_scheduling=True)
    eng = llm.engine
    for rid, p in zip(want, prompts):  # alone
        assert signature(run(llm, [p], greedy(NEW), [rid])[rid]) == want[rid]
    eng.add_request(prompt_token_ids=prompts[0], params=greedy(NEW), request_id="r0")
    for _ in range(3):
        eng.step()
    for rid, p in list(zip(want, prompts))[1:]:  # staggered: joining a running batch
        eng.add_request(prompt_token_ids=p, params=greedy(NEW), request_id=rid)
        eng.step()
    done = eng.run_to_completion(list(want))
    assert {rid: signature(o) for rid, o in done.items()} == want
    assert eng.spec_stats.num_drafts > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_ds_mla"])
def test_caches_after_rejections_equal_a_run_without_speculation(tiny_ckpt, prompts, kv_dtype):
    """At every token count the speculative run passes through, every cache kind of every request —
    window KV, compressed entries and indexer keys, compressor state rings, prefix-cache boundary
    rows — equals the run without speculation at the same count, byte for byte; the MTP layer's
    window cache equals the reference model's MTP pass over the final sequence."""
    k = 3
    base = make_llm(tiny_ckpt, kv_dtype, max_model_len=512)
    spec = make_llm(tiny_ckpt, kv_dtype, max_model_len=512, speculative_config=mtp(k))
    truth = {rid: o.outputs[0].token_ids for rid, o in run(base, prompts, greedy(NEW)).items()}
    script(spec, truth)
    seen: dict = {}
    record_images(spec, seen)
    got = run(spec, prompts, greedy(NEW))
    assert {rid: o.outputs[0].token_ids for rid, o in got.items()} == truth
    counts = sorted(n for r, n in seen if r == "r2")
    assert any(a < 256 <= b and b - a > 1 for a, b in zip(counts, counts[1:]))  # a verify step closed a block
    assert_images_match_a_run_without_speculation(base, seen, prompts, greedy(NEW))
    # the MTP layer's window entries: those of the reference's MTP pass over the final sequence
    assert_draft_window_is_the_reference_pass(spec, seen, prompts, truth)


def test_prefix_hits_chunked_prefill_and_n(tiny_ckpt):
    """With speculation: prefix-cache hits (their last block recomputed for the proposer), prefill in
    200-token chunks, n > 1 — the same tokens as without."""
    shared = rand_prompts(41, [520])[0]
    ps = [shared + q for q in rand_prompts(42, [7, 30, 11])]
    kw = dict(max_model_len=1024, max_num_batched_tokens=200, max_num_seqs=4)
    base = make_llm(tiny_ckpt, "auto", **kw)
    spec = make_llm(tiny_ckpt, "auto", speculative_config=mtp(2), **kw)
    runs = {}
    for name, llm in (("base", base), ("spec", spec)):  # the first prompt's blocks cached, then hit twice
        outs = llm.generate({"prompt_token_ids": ps[0]}, greedy(12))
        outs += llm.generate([{"prompt_token_ids": p} for p in ps[1:]], greedy(12))
        runs[name] = [signature(o) for o in outs]
    assert runs["spec"] == runs["base"]
    assert spec.engine.kv.hits == 256 * 2 and base.engine.kv.hits == 512 * 2  # one block fewer per hit
    n = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    assert [c.token_ids for c in spec.generate({"prompt_token_ids": ps[0]}, n)[0].outputs] == \
           [c.token_ids for c in base.generate({"prompt_token_ids": ps[0]}, n)[0].outputs]
    assert_no_leaks(spec)


def test_a_long_prompt_feeds_the_drafter_only_its_last_window(tiny_ckpt):
    """After a long prefill (in chunks) the MTP layer runs on the rows a draft can read — the last
    sliding window of the prompt — not on every prompt row; the tokens are those without speculation."""
    p = rand_prompts(45, [700])[0]
    kw = dict(max_model_len=1024, max_num_batched_tokens=256)
    want = signature(make_llm(tiny_ckpt, "auto", **kw).generate([p], greedy(8))[0])
    spec = make_llm(tiny_ckpt, "auto", speculative_config=mtp(2), **kw)
    model, rows = spec.engine.model, []
    inner = model.mtp_forward
    model.mtp_forward = lambda ids, *a, **k: rows.append(len(ids)) or inner(ids, *a, **k)
    assert signature(spec.generate([p], greedy(8))[0]) == want
    window = spec.engine.model_config.sliding_window
    assert window < rows[0] <= window + 2 and max(rows) == rows[0]  # (then drafts and verify rows only)
    assert_no_leaks(spec)


def test_preemption(tiny_ckpt):
    """Three 256-token blocks for two requests that need two each: one is preempted (its drafts
    dropped) and recomputed; the tokens are those without speculation."""
    from dsv4.cache.paged import plan_budget, unit_bytes
    from dsv4.config import load_config
    from dsv4.model.cache import CacheNumerics

    cfg, num = load_config(tiny_ckpt), CacheNumerics("auto")
    blk, swa, _ = unit_bytes(cfg, num, torch.float32)
    big = plan_budget(cfg, num, torch.float32, 1 << 34, 2, 64, 512)
    kw = dict(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=512,
              kv_cache_memory=big.total_bytes - (big.num_blocks - 3) * (blk + 2 * swa))
    prompts = [{"prompt_token_ids": p} for p in rand_prompts(44, [250, 252])]
    want = [signature(o) for o in make_llm(tiny_ckpt, "auto", **kw).generate(prompts, greedy(12))]
    spec = make_llm(tiny_ckpt, "auto", speculative_config=mtp(3), **kw)
    assert [signature(o) for o in spec.generate(prompts, greedy(12))] == want
    assert spec.engine.scheduler.num_preemptions > 0
    assert_no_leaks(spec)


def test_stops_and_max_tokens_inside_a_draft(tiny_ckpt, prompts, plain):
    """A stop token id, a stop string and max_tokens landing inside an accepted draft end the output
    exactly where they would without speculation."""
    truth = {rid: o.outputs[0].token_ids for rid, o in plain["reference"].items()}
    llm = make_llm(tiny_ckpt, "auto", max_model_len=512, speculative_config=mtp(3))
    base = make_llm(tiny_ckpt, "auto", max_model_len=512)
    script(llm, truth)
    p = prompts[3]
    stop_id = truth["r3"][6]
    text = llm.engine.tokenizer.decode(truth["r3"][:9])
    cases = [greedy(NEW, stop_token_ids=[stop_id]), greedy(5), greedy(NEW, stop=[text[-3:]])]
    for params in cases:
        a = run(llm, [p], params, ["r3"])["r3"]
        b = run(base, [p], params, ["r3"])["r3"]
        assert signature(a) == signature(b) and a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert_no_leaks(llm)


def test_a_grammar_constrained_request_is_unchanged_by_drafts(tiny_ckpt_release_vocab):
    """Drafts the grammar accepts, then one it must reject: the tokens of a run without speculation (the
    release vocabulary: a grammar needs every token of the tokenizer)."""
    llm = make_llm(tiny_ckpt_release_vocab, "auto", max_model_len=512, speculative_config=mtp(3))
    base = make_llm(tiny_ckpt_release_vocab, "auto", max_model_len=512)
    scripted = script(llm, {})
    p = rand_prompts(37, LENGTHS, RELEASE_TOKEN_HI)[3]
    so = StructuredOutputsParams(regex=r"[a-z]{3,12}( [a-z]{1,12}){2,5}")
    b = run(base, [p], greedy(NEW, structured_outputs=so), ["g"])["g"]
    scripted.truth["g"] = b.outputs[0].token_ids
    a = run(llm, [p], greedy(NEW, structured_outputs=so), ["g"])["g"]
    assert signature(a) == signature(b) and len(b.outputs[0].token_ids) > 3
    assert scripted.calls.get("g", 0) > 0  # the drafts went through the grammar's checks
    assert_no_leaks(llm)


def test_settings_and_checkpoints_are_checked(tiny_ckpt, tmp_path):
    from dsv4.checkpoint.synthetic import write_checkpoint
    from dsv4.engine.settings import EngineConfig

    for bad, match in [({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of mtp"),
                       ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
                       ({"method": "mtp", "num_speculative_tokens": 5}, "num_speculative_tokens must be"),
                       ({"method": "mtp", "num_speculative_tokens": 2, "k": 1}, "unknown key"),
                       ("[1]", "must be a JSON object")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model=str(tiny_ckpt), speculative_config=bad)
    no_mtp = write_checkpoint(tmp_path / "no_mtp", preset="tiny", progress=False,
                              overrides={"num_nextn_predict_layers": 0})
    with pytest.raises(ValueError, match="no MTP layer"):
        make_llm(no_mtp, "auto", max_model_len=256, speculative_config=mtp(1))


def test_spec_stats():
    st = SpecStats()
    st.record(3, 2)
    st.record(3, 0)
    st.record(1, 1)
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (3, 7, 3)
    assert st.accepted_per_position == [2, 1, 0]
    assert st.acceptance_length == 2.0


def test_spec_stats_confidence_cuts():
    """What cutting each draft before its first confidence below t would have drafted and kept."""
    st = SpecStats()
    st.record(3, 1, [0.9, 0.4, 0.8])  # cut at 0.5: 1 drafted, 1 kept; at 0.95: nothing
    st.record(2, 2, [0.6, 0.7])  # cut at 0.65: nothing
    st.record(2, 0)  # no confidences: not in the table
    rows = {round(t, 2): (d, n) for t, d, n in st.confidence_cuts()}
    assert st.num_confident_drafts == 2
    assert rows[0.0] == (2.5, 2.5) and rows[0.4] == (2.5, 2.5)
    assert rows[0.45] == (1.5, 2.5) and rows[0.65] == (0.5, 1.5) and rows[0.95] == (0.0, 1.0)
    before = st.since(SpecStats())  # a copy
    st.record(1, 1, [0.99])
    new = st.since(before)
    assert new.num_confident_drafts == 1 and new.confidence_cuts()[-1][1:] == (1.0, 2.0)
