"""DSpark speculative decoding: greedy output identical to decoding without it, every cache rolled
back exactly (the DSpark stages' window caches included), the engine's drafts equal to the model's
own DSpark pass on dense caches, the confidence cut, and the settings' checks.

The tiny DSpark checkpoint is random (8-token vocabulary), so its drafts are accepted by chance
only; to reject at every draft position the rollback test replaces them by the known continuation
with one wrong token at a rotating position (the DSpark proposer still runs and fills its caches).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_no_leaks, greedy, make_llm, signature
from spec_helpers import (
    assert_images_match_a_run_without_speculation,
    record_images,
    record_step_drafts,
    run,
    script,
)

from dsv4.engine.sampler import _first_argmax
from dsv4.engine.speculative import DSparkProposer
from dsv4.model.cache import DenseSequenceCache
from dsv4.model.step import SeqChunk

# decoding from these lengths crosses the 64-token SWA page, the 128-token window / HCA ratio, the
# 256-token block, and ratio-4 groups everywhere
LENGTHS = (58, 122, 250, 9)
NEW = 16
VOCAB_LO = 2  # prompts avoid BOS/EOS (0/1); the tiny DSpark vocabulary has 8 tokens


def dspark(k: int, **kw) -> dict:
    return {"method": "dspark", "num_speculative_tokens": k, **kw}


def prompts_for(seed: int, lengths, vocab: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB_LO, vocab, (n,), generator=g).tolist() for n in lengths]


def reference_context(model, tokens: list[int], n: int) -> DenseSequenceCache:
    """A dense cache holding the DSpark stages' context KV of positions 0..n-1 (``tokens[:n]``
    through the target in one forward)."""
    cfg = model.cfg
    ids = torch.tensor(tokens[:n])
    out = model.forward(ids, [SeqChunk(model.new_cache(), 0, n)], aux_layers=cfg.dspark_target_layer_ids)
    dense = DenseSequenceCache(cfg, model.numerics)
    model.dspark_context(out.aux, [SeqChunk(dense, 0, n)])
    return dense


def reference_drafts(model, tokens: list[int], k: int, min_confidence: float) -> tuple[list[int], list[float]]:
    """Greedy DSpark drafts after ``tokens`` (the last one is the anchor, not yet computed) from the
    model's own passes on a dense cache: one block, the Markov bias of each previous token, the
    confidence cut."""
    cfg, n = model.cfg, len(tokens) - 1
    dense = reference_context(model, tokens, n)
    block = torch.tensor([tokens[-1]] + [cfg.dspark_noise_token_id] * (k - 1))
    logits, h = model.dspark_block(block, [SeqChunk(dense, n, k)])
    prev, toks, conf = tokens[-1], [], []
    for i in range(k):
        bias, e = model.dspark.markov(torch.tensor([prev]))
        c = float(model.dspark.confidence(h[i : i + 1], e)[0])
        if c < min_confidence:
            break
        prev = _first_argmax(logits[i] + bias[0])
        toks.append(prev)
        conf.append(c)
    return toks, conf


def record_drafts(eng) -> list:
    """Wrap the engine's proposer: every proposal's (tokens so far, drafts wanted, drafts, confidences)."""
    propose, records = eng.proposer.propose, []

    def recording(rows, streams):
        propose(rows, streams)
        for r in rows:
            if r.num_drafts:
                d = r.req.drafts
                records.append((r.req.all_token_ids, r.num_drafts, list(d.tokens), list(d.confidence or [])))

    eng.proposer.propose = recording
    return records


def assert_drafts_match_the_models_pass(model, records, k: int, cut: float, every: int) -> None:
    for tokens, wanted, toks, conf in records[::every]:
        ref_toks, ref_conf = reference_drafts(model, tokens, k, cut)
        assert (toks, conf) == (ref_toks[:wanted], ref_conf[:wanted]), len(tokens)


@pytest.fixture(scope="module")
def prompts():
    return prompts_for(37, LENGTHS)


@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_identical_and_caches_rolled_back_with_rejections_at_every_position(tiny_dspark_ckpt, prompts, graphs):
    """Scripted drafts (k=4) rejected at every position and accepted whole: the tokens (and, eager,
    logprobs) are those without speculation; at every token count the run passes through, every
    cache kind of every request equals the run without speculation byte for byte (fp8_ds_mla
    records), and each DSpark stage's window holds the context KV of the reference's pass over the
    final sequence — through the reference attention eagerly, and as graph steps (emulated on the
    CPU) over the batched paged attention."""
    k = 4
    kw = dict(max_model_len=512, attention="batched", backend="torch") if graphs else dict(max_model_len=512)
    params = greedy(NEW, logprobs=None) if graphs else greedy(NEW)  # (a request with logprobs runs eagerly)
    base = make_llm(tiny_dspark_ckpt, "fp8_ds_mla", **kw)
    spec = make_llm(tiny_dspark_ckpt, "fp8_ds_mla", speculative_config=dspark(k), **kw)
    if graphs:
        spec.engine.capture_spec_graphs()
    want = run(base, prompts, params)
    truth = {rid: o.outputs[0].token_ids for rid, o in want.items()}
    scripted = script(spec, truth)
    seen: dict = {}
    record_images(spec, seen)
    got = run(spec, prompts, params)
    assert {rid: signature(o) for rid, o in got.items()} == {rid: signature(o) for rid, o in want.items()}
    assert not graphs or spec.engine.spec_graphs.replays >= NEW // (k + 1)
    st = spec.engine.spec_stats
    assert st.accepted_per_position[k - 1] > 0 and st.num_accepted_tokens < st.num_draft_tokens
    assert min(scripted.calls.values()) >= k  # every request went through every rejection position
    counts = sorted(n for r, n in seen if r == "r2")
    assert any(a < 256 <= b and b - a > 1 for a, b in zip(counts, counts[1:]))  # a verify step closed a block
    assert_images_match_a_run_without_speculation(base, seen, prompts, params)
    model, cfg = spec.engine.model, spec.engine.model_config
    layers = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_draft_layers)
    assert len(layers) == 3
    for rid, p in zip(truth, prompts):
        tokens = list(p) + truth[rid]
        dense = reference_context(model, tokens, len(tokens) - 1)
        for (r, nc), image in seen.items():
            if r == rid:
                pos = torch.arange(max(0, nc - cfg.sliding_window + 1), nc)
                for layer in layers:
                    assert torch.equal(image[f"draft window {layer}"], dense.read_kv(layer, pos)), (rid, nc, layer)
    assert_no_leaks(spec)


@pytest.mark.parametrize("attention", ["reference", "batched"])
def test_own_drafts_equal_the_models_pass_and_the_confidence_cut(tiny_dspark_ckpt, attention):
    """The DSpark stages' own drafts (k = dspark_block_size = 5, cut at confidence 0.5), several
    requests drafting in one block pass: the tokens are those without speculation, and every
    draft list equals the model's DSpark pass over the same tokens on a dense cache, its
    confidences included — through the per-request views and through the batched paged pass
    (which stores the block's KV in the pages and reads it back, rounded as the reference rounds it)."""
    k, cut = 5, 0.5
    ps = prompts_for(5, (40, 75, 9))
    # the batched pass with the torch ops (the registry's interpreted kernels differ in the last bits)
    kw = dict(max_model_len=256, attention=attention, **({"backend": "torch"} if attention == "batched" else {}))
    base = make_llm(tiny_dspark_ckpt, "auto", **kw)
    spec = make_llm(tiny_dspark_ckpt, "auto", speculative_config=dspark(k, dspark_min_confidence=cut), **kw)
    eng = spec.engine
    records = record_drafts(eng)
    want = run(base, ps, greedy(12))
    got = run(spec, ps, greedy(12))
    assert {rid: signature(o) for rid, o in got.items()} == {rid: signature(o) for rid, o in want.items()}
    lens = [len(t) for _, _, t, _ in records]
    assert 0 in lens and any(n > 0 for n in lens)  # the cut dropped whole drafts and kept others
    st = eng.spec_stats
    assert st.num_drafts > 0 and st.num_confident_drafts == st.num_drafts
    cuts = st.confidence_cuts()  # no cut at t ≤ 0.5: the proposer's own cut came first
    assert all(row[1:] == (st.num_draft_tokens / st.num_drafts, st.acceptance_length) for row in cuts if row[0] <= cut)
    assert cuts[-1][1] < cuts[0][1]
    assert all(cut <= c < 1 for _, _, _, conf in records for c in conf)
    assert_drafts_match_the_models_pass(eng.model, records, k, cut, every=4)
    assert_no_leaks(spec)


def test_prefix_hits_and_chunked_prefill(tiny_dspark_ckpt):
    """A prefix-cache hit (its last block recomputed, so the stages' windows before the anchor are
    written again) and prefill in 100-token chunks: the tokens are those without speculation and the
    drafts those of the model's pass over the whole sequence."""
    k = 3
    shared = prompts_for(41, [520])[0]
    ps = [shared + q for q in prompts_for(42, [7, 20])]
    kw = dict(max_model_len=1024, max_num_batched_tokens=100, max_num_seqs=4)
    base = make_llm(tiny_dspark_ckpt, "auto", **kw)
    spec = make_llm(tiny_dspark_ckpt, "auto", speculative_config=dspark(k), **kw)
    records = record_drafts(spec.engine)
    runs = {}
    for name, llm in (("base", base), ("spec", spec)):  # the first prompt's two blocks cached, then hit
        outs = llm.generate({"prompt_token_ids": ps[0]}, greedy(6))
        outs += llm.generate({"prompt_token_ids": ps[1]}, greedy(6))
        runs[name] = [signature(o) for o in outs]
    assert runs["spec"] == runs["base"]
    assert spec.engine.kv.hits == 256 and base.engine.kv.hits == 512  # one block fewer: recomputed
    assert_drafts_match_the_models_pass(spec.engine.model, records, k, 0.0, every=3)
    assert_no_leaks(spec)


def test_settings_and_checkpoints_are_checked(tiny_dspark_ckpt, tiny_ckpt):
    from dsv4.engine.settings import EngineConfig

    for bad, match in [(dspark(0), "num_speculative_tokens must be"),
                       (dspark(2, dspark_min_confidence=1.0), "dspark_min_confidence must be"),
                       ({"method": "mtp", "num_speculative_tokens": 2, "dspark_min_confidence": 0.5}, "unknown key")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model=str(tiny_dspark_ckpt), speculative_config=bad)
    kw = dict(max_model_len=256)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=6 exceeds the checkpoint's dspark_block_size \(5\)"):
        make_llm(tiny_dspark_ckpt, "auto", speculative_config=dspark(6), **kw)
    with pytest.raises(ValueError, match="DSpark drafter stages .* use method 'dspark'"):
        make_llm(tiny_dspark_ckpt, "auto", speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **kw)
    with pytest.raises(ValueError, match="has no DSpark stages"):
        make_llm(tiny_ckpt, "auto", speculative_config=dspark(2), **kw)
    llm = make_llm(tiny_dspark_ckpt, "auto", speculative_config=dspark(2), **kw)
    eng = llm.engine
    eng.model.dspark.confidence_w = None  # a checkpoint without the confidence head
    with pytest.raises(ValueError, match="no confidence head .*mtp.2.confidence_head.proj.weight"):
        DSparkProposer(eng.model, eng.kv, eng.sampler, 2, min_confidence=0.5)


def graph_llm(ckpt, k: int, graphs: bool, **kw):
    llm = make_llm(ckpt, "auto", max_model_len=256, attention="batched", backend="torch",
                   speculative_config=dspark(k, **kw), async_scheduling=graphs)
    if graphs:
        llm.engine.capture_spec_graphs()
    return llm


def test_graph_steps_make_the_eager_proposers_drafts(tiny_dspark_ckpt):
    """The DSpark step as one graph (emulated on the CPU): at every token count each request gets the
    drafts and confidences the eager paged proposer gives it (k = 5, cut at confidence 0.5), with
    requests arriving while others decode (those steps' prefills run eagerly beside the graph step)
    and async scheduling on; the tokens are those without speculation."""
    k, cut = 5, 0.5
    ps = prompts_for(5, (40, 75, 9, 130))
    base = make_llm(tiny_dspark_ckpt, "auto", max_model_len=256, attention="batched", backend="torch")
    params = greedy(14, logprobs=None)
    want = {f"r{i}": base.generate([p], params)[0].outputs[0].token_ids for i, p in enumerate(ps)}
    runs = {}
    for graphs in (False, True):
        llm = graph_llm(tiny_dspark_ckpt, k, graphs, dspark_min_confidence=cut)
        eng = llm.engine
        drafts = record_step_drafts(eng)
        eng.add_request(prompt_token_ids=ps[0], params=params, request_id="r0")
        for _ in range(3):
            eng.step()
        for i, p in enumerate(ps[1:], 1):
            eng.add_request(prompt_token_ids=p, params=params, request_id=f"r{i}")
            eng.step()
        done = eng.run_to_completion(list(want))
        assert {rid: o.outputs[0].token_ids for rid, o in done.items()} == want
        runs[graphs] = drafts, eng.spec_graphs.replays if graphs else 0
        assert not graphs or eng.spec_graphs.continued > 3  # launched from the graph's own next inputs
        assert_no_leaks(llm)
    (eager, _), (graph, replays) = runs[False], runs[True]
    assert graph == eager
    assert any(t for t, _ in graph.values()) and any(len(t) < k for t, _ in graph.values())  # the cut acted
    assert replays > 5
