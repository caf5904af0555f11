"""The greedy MTP step as one graph (``engine.spec_graphs``, emulated on the CPU: the same static
inputs, run eagerly): the tokens of a run without speculation with rejections at every draft
position, caches byte-equal to that run's, the MTP drafts of the eager proposer, and the eager path
for every step a graph does not take."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_no_leaks, greedy, make_llm, rand_prompts, signature
from spec_helpers import (
    assert_draft_window_is_the_reference_pass,
    assert_images_match_a_run_without_speculation,
    record_images,
    record_step_drafts,
    run,
    script,
)

LENGTHS = (58, 122, 250, 9)  # decoding crosses the SWA page, the window / HCA ratio, the block
NEW = 16


def batched(ckpt, kv: str = "auto", **kw):
    return make_llm(ckpt, kv, max_model_len=512, attention="batched", backend="torch", **kw)


def spec_llm(ckpt, k: int, kv: str = "auto", graphs: bool = True):
    llm = batched(ckpt, kv, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    if graphs:
        llm.engine.capture_spec_graphs()
    return llm


@pytest.fixture(scope="module")
def prompts():
    return rand_prompts(37, LENGTHS)


@pytest.fixture(scope="module")
def truth(tiny_ckpt, prompts):
    llm = batched(tiny_ckpt)
    return {rid: o.outputs[0].token_ids for rid, o in run(llm, prompts, greedy(NEW, logprobs=None)).items()}


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_identical_with_rejections_at_every_position(tiny_ckpt, prompts, truth, k):
    llm = spec_llm(tiny_ckpt, k)
    scripted = script(llm, truth)
    got = run(llm, prompts, greedy(NEW, logprobs=None))
    assert {rid: o.outputs[0].token_ids for rid, o in got.items()} == truth
    st, g = llm.engine.spec_stats, llm.engine.spec_graphs
    assert g.replays >= NEW // (k + 1)  # every step after the prefill's ran as a graph
    assert st.accepted_per_position[k - 1] > 0 and st.num_accepted_tokens < st.num_draft_tokens
    assert min(scripted.calls.values()) >= k  # every request went through every rejection position
    assert_no_leaks(llm)


@pytest.mark.parametrize("kv_dtype", ["fp8_ds_mla"])  # (the eager path's test covers "auto" too)
def test_caches_after_rejections_equal_a_run_without_speculation(tiny_ckpt, prompts, kv_dtype):
    """Every cache kind of every request at every token count the graph steps pass through equals
    the run without speculation's, byte for byte (rejected drafts' ring rows included: the rings
    are sized for them); the MTP layer's window equals the reference's MTP pass over the sequence."""
    k = 3
    base = batched(tiny_ckpt, kv_dtype)
    want = {rid: o.outputs[0].token_ids for rid, o in run(base, prompts, greedy(NEW, logprobs=None)).items()}
    spec = spec_llm(tiny_ckpt, k, kv_dtype)
    script(spec, want)
    seen: dict = {}
    record_images(spec, seen)
    got = run(spec, prompts, greedy(NEW, logprobs=None))
    assert {rid: o.outputs[0].token_ids for rid, o in got.items()} == want
    assert spec.engine.spec_graphs.replays > 0
    counts = sorted(n for r, n in seen if r == "r2")
    assert any(a < 256 <= b and b - a > 1 for a, b in zip(counts, counts[1:]))  # a verify step closed a block
    assert_images_match_a_run_without_speculation(base, seen, prompts, greedy(NEW, logprobs=None))
    assert_draft_window_is_the_reference_pass(spec, seen, prompts, want)


def test_rings_sized_for_the_rejected_rows(tiny_ckpt, prompts, monkeypatch):
    """With the rings of a run without speculation, the graph's stored draft rows overwrite rows a
    later block still pools: the caches then differ (what ``ring_rows``' extra rows prevent)."""
    import dsv4.cache.paged as paged

    k = 4
    prompts = prompts[1:3]  # (their blocks close ratio-4 and ratio-128 entries while decoding)
    base = batched(tiny_ckpt)
    want = {rid: o.outputs[0].token_ids for rid, o in run(base, prompts, greedy(NEW, logprobs=None)).items()}
    monkeypatch.setattr(paged, "ring_rows", lambda ratio, lookahead=0: 2 * ratio if ratio == 4 else ratio)
    spec = spec_llm(tiny_ckpt, k)
    script(spec, want)
    seen: dict = {}
    record_images(spec, seen)
    run(spec, prompts, greedy(NEW, logprobs=None))
    with pytest.raises(AssertionError, match="differ from the run without speculation"):
        assert_images_match_a_run_without_speculation(base, seen, prompts, greedy(NEW, logprobs=None))


def test_graph_drafts_are_the_eager_proposers(tiny_ckpt, prompts):
    """The MTP layer's own drafts: at every token count each request gets the drafts the eager
    proposer gives it, requests arriving while others decode (those steps run eagerly) and a
    request with logprobs (eager: its rows go to the host) among them."""
    runs = {}
    for graphs in (False, True):
        llm = spec_llm(tiny_ckpt, 3, graphs=graphs)
        eng = llm.engine
        drafts = record_step_drafts(eng)
        eng.add_request(prompt_token_ids=prompts[0], params=greedy(NEW, logprobs=None), request_id="r0")
        for _ in range(3):
            eng.step()
        for i, p in enumerate(prompts[1:], 1):  # joining a running batch
            eng.add_request(prompt_token_ids=p, params=greedy(NEW, logprobs=0 if i == 2 else None), request_id=f"r{i}")
            eng.step()
        done = eng.run_to_completion([f"r{i}" for i in range(len(prompts))])
        runs[graphs] = ({rid: signature(o) for rid, o in done.items()}, drafts,
                        eng.spec_graphs.replays if graphs else 0)
        assert_no_leaks(llm)
    (eager, eager_drafts, _), (graph, graph_drafts, replays) = runs[False], runs[True]
    assert graph == eager
    assert graph_drafts == eager_drafts and any(t for t, _ in graph_drafts.values())
    assert 0 < replays < sum(1 for _ in graph_drafts)  # some steps were graphs, some eager


def test_sampled_graph_steps_at_top_k_1_give_the_greedy_tokens():
    """Sampling at top-k 1 makes every distribution one-hot, so the sampled graphs — the rejection
    rule, the replacement and bonus draws, the drafts drawn on the device and their distributions
    kept for the next step's rule — must give the greedy tokens exactly; on the canary (a trained MTP
    layer: drafts accepted and rejected), with async continuation."""
    from dsv4.canary import CANARY_DIR
    from dsv4.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 120, (n,), generator=g).tolist() for n in (20, 61, 130)]
    kw = dict(max_model_len=512, attention="batched", backend="torch")
    base = make_llm(CANARY_DIR, "auto", **kw)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, greedy(40, logprobs=None))]
    llm = make_llm(CANARY_DIR, "auto", speculative_config={"method": "mtp", "num_speculative_tokens": 3},
                   async_scheduling=True, **kw)
    eng = llm.engine
    eng.capture_spec_graphs()
    params = [SamplingParams(temperature=0.8, top_k=1, max_tokens=40, ignore_eos=True, seed=i) for i in range(3)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    sg, st = eng.spec_graphs, eng.spec_stats
    assert sg.replays >= 10 and sg.continued > 0
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert_no_leaks(llm)


def test_async_scheduling_launches_the_next_graph_step_before_reading_one():
    """Async scheduling: while the batch stays the same each graph step is launched from the graph's own
    next inputs before the step before is read; a newcomer's prefill runs eagerly beside the others'
    graph step. On the canary (a trained MTP layer: drafts accepted and rejected), requests arriving
    while others decode and one finishing early: the tokens of a run without speculation."""
    from dsv4.canary import CANARY_DIR

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 120, (n,), generator=g).tolist() for n in (20, 61, 130, 7)]
    lengths = [40, 40, 12, 40]
    kw = dict(max_model_len=512, attention="batched", backend="torch")
    base = make_llm(CANARY_DIR, "auto", **kw)
    want = {f"r{i}": base.generate([p], greedy(n, logprobs=None))[0].outputs[0].token_ids
            for i, (p, n) in enumerate(zip(prompts, lengths))}
    llm = make_llm(CANARY_DIR, "auto", speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                   async_scheduling=True, **kw)
    eng = llm.engine
    eng.capture_spec_graphs()
    split, mixed = eng._run_spec_step, []

    def recording(schedule):
        launched, rest = split(schedule)
        mixed.append(launched is not None and bool(rest))
        return launched, rest

    eng._run_spec_step = recording
    eng.add_request(prompt_token_ids=prompts[0], params=greedy(lengths[0], logprobs=None), request_id="r0")
    for _ in range(4):
        eng.step()
    for i in range(1, len(prompts)):
        eng.add_request(prompt_token_ids=prompts[i], params=greedy(lengths[i], logprobs=None), request_id=f"r{i}")
        eng.step()
    done = eng.run_to_completion(list(want))
    assert {rid: o.outputs[0].token_ids for rid, o in done.items()} == want
    sg, st = eng.spec_graphs, eng.spec_stats
    assert sg.continued > 10 and eng.num_overlapped_steps == sg.continued
    assert sum(mixed) >= 2  # the decodes ran as a graph step beside a newcomer's eager prefill
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert_no_leaks(llm)
