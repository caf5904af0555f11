"""Sampling: seeds, temperature/top-k/top-p/min-p, penalties, logprobs, n, min_tokens, stops, finish reasons."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import assert_no_leaks, greedy, make_llm, rand_prompts, signature

from dsv4.engine.request import Request
from dsv4.engine.sampler import (
    Sampler,
    _first_argmax,
    apply_penalties,
    device_dists,
    filter_logits,
    greedy_picks,
    inverse_cdf,
    plain_greedy,
)
from dsv4.engine.sampling_params import SamplingParams

NEG = float("-inf")


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return make_llm(tiny_ckpt, "auto", max_num_seqs=8, max_model_len=512)


@pytest.fixture(scope="module")
def prompts():
    return rand_prompts(31, [9, 14, 6, 21])


def _tokens(out, i=0):
    return out.outputs[i].token_ids


# ---- pure functions on hand-made vectors ---------------------------------------------------
def test_greedy_picks_equal_the_per_row_first_argmax():
    """The batched device pick = the sampler's per-row rule (lowest id among equal maxima), in fp32
    and bf16; rows with NaN/Inf are left to the per-row path, which reports them."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 3, (8, 50), generator=g).float()  # small integers: many tied maxima
    x[2, 7] = float("nan")
    x[4, 1] = float("inf")
    x[6] = 0.0
    x[6, 10] = -0.0  # -0.0 == 0.0: a tie, the lowest index wins
    rows = list(range(8))
    for t in (x, x.bfloat16()):
        picks = greedy_picks(t, rows)
        assert sorted(picks) == [0, 1, 3, 5, 6, 7]
        assert all(tok == _first_argmax(x[r]) for r, tok in picks.items())
        assert picks[6] == 0
    assert greedy_picks(x, [5, 1]) == {5: _first_argmax(x[5]), 1: _first_argmax(x[1])}
    every = greedy_picks(x, rows)  # all rows: picked without a gather; a prefix of them with one
    assert greedy_picks(x, rows[:7]) == {r: t for r, t in every.items() if r < 7}
    assert greedy_picks(x, []) == {}


def test_plain_greedy_excludes_what_the_per_row_path_must_do():
    def req(**kw):
        return Request("r", [1, 2], SamplingParams(**kw), eos_token_id=1)
    assert plain_greedy(req(temperature=0))
    assert not plain_greedy(req(temperature=0.5))
    assert not plain_greedy(req(temperature=0, logprobs=2))
    assert not plain_greedy(req(temperature=0, repetition_penalty=1.2))
    assert not plain_greedy(req(temperature=0, presence_penalty=0.5))
    assert not plain_greedy(req(temperature=0, frequency_penalty=0.5))
    assert not plain_greedy(req(temperature=0, min_tokens=2))  # EOS is banned until then


def test_batched_greedy_equals_the_per_row_sampler(llm, prompts, monkeypatch):
    """A mixed batch (plain greedy, greedy with logprobs / penalties / min_tokens, seeded sampling)
    gives the same tokens and logprobs with and without the batched greedy pick."""
    params = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0, max_tokens=8, logprobs=2),
              SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, min_tokens=3),
              SamplingParams(temperature=0.8, seed=5, max_tokens=8)]

    def run():
        outs = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
        both = llm.generate(prompts, params)
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs + both]

    fast = run()
    monkeypatch.setattr(Sampler, "batched_greedy", False)
    assert run() == fast


def test_filter_logits_on_hand_made_vector():
    x = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    p = torch.softmax(x, -1)  # ≈ [.032, .636, .086, .234, .012]; order by size: 1, 3, 2, 0, 4

    def kept(y):
        assert torch.equal(y[torch.isfinite(y)], x[torch.isfinite(y)])  # survivors keep their values
        return sorted(torch.nonzero(torch.isfinite(y)).flatten().tolist())

    assert kept(filter_logits(x.clone(), 0, 1.0, 0.0)) == [0, 1, 2, 3, 4]
    assert kept(filter_logits(x.clone(), -1, 1.0, 0.0)) == [0, 1, 2, 3, 4]
    assert kept(filter_logits(x.clone(), 1, 1.0, 0.0)) == [1]
    assert kept(filter_logits(x.clone(), 2, 1.0, 0.0)) == [1, 3]
    assert kept(filter_logits(x.clone(), 5, 1.0, 0.0)) == [0, 1, 2, 3, 4]
    # top-p keeps the smallest most-probable set whose mass reaches p
    assert kept(filter_logits(x.clone(), 0, float(p[1]) - 1e-3, 0.0)) == [1]
    assert kept(filter_logits(x.clone(), 0, 0.7, 0.0)) == [1, 3]
    assert kept(filter_logits(x.clone(), 0, 0.9, 0.0)) == [1, 2, 3]
    assert kept(filter_logits(x.clone(), 0, 1e-6, 0.0)) == [1]
    # min-p drops tokens less likely than min_p × the top probability
    assert kept(filter_logits(x.clone(), 0, 1.0, 0.2)) == [1, 3]  # threshold .127
    assert kept(filter_logits(x.clone(), 0, 1.0, 0.1)) == [1, 2, 3]  # threshold .064
    assert kept(filter_logits(x.clone(), 0, 1.0, 1.0)) == [1]
    # combined: top-k 3 then top-p .8 of the renormalised three
    assert kept(filter_logits(x.clone(), 3, 0.8, 0.0)) == [1, 3]


def _req(prompt, output, **kw) -> Request:
    r = Request("u", prompt, SamplingParams(**kw))
    r.output_token_ids = list(output)
    return r


@pytest.mark.parametrize("seed", [0, 1])
def test_device_dists_are_the_host_samplers_distributions(seed):
    """The speculative graphs' row-wise distributions (per-row temperature, top-k, top-p, min-p on one
    sort) against softmax(filter_logits(row / temperature)) on fresh random rows, ties included."""
    g = torch.Generator().manual_seed(seed)
    n, v = 24, 300
    x = torch.randn(n, v, generator=g) * 3
    x[::3, :40] = x[::3, :1]  # a block of equal logits: top-k keeps every tie, as filter_logits does
    settings = torch.stack([torch.rand(n, generator=g) * 1.5 + 0.2,
                            torch.randint(-1, 60, (n,), generator=g).clamp(min=0).float(),
                            torch.where(torch.rand(n, generator=g) < 0.3, 1.0, torch.rand(n, generator=g) * 0.9 + 0.05),
                            torch.where(torch.rand(n, generator=g) < 0.5, 0.0, torch.rand(n, generator=g) * 0.2)], 1)
    got = device_dists(x, settings.double())
    for i in range(n):
        t, k, p, m = settings[i].tolist()
        want = torch.softmax(filter_logits(x[i] / t, int(k), p, m), dim=-1)
        assert torch.equal(got[i] > 0, want > 0), i  # the same tokens kept
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-7)


def test_inverse_cdf_draws_by_the_cumulative_mass():
    p = torch.tensor([[0.2, 0.0, 0.5, 0.3], [0.0, 0.0, 2.0, 2.0]])  # (rows need not be normalized)
    for u, want in [(0.0, [0, 2]), (0.1, [0, 2]), (0.21, [2, 2]), (0.69, [2, 3]), (0.71, [3, 3]), (0.999, [3, 3])]:
        assert inverse_cdf(p, torch.full((2,), u)).tolist() == want, u
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(3))
    counts = torch.bincount(inverse_cdf(p[:1].expand(len(u), -1), u), minlength=4).double() / len(u)
    torch.testing.assert_close(counts, p[0].double(), atol=5e-3, rtol=0)  # zero mass: never drawn


def test_apply_penalties_as_defined():
    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0, 0.5, -0.5, 2.0])
    prompt, output = [0, 1, 5], [2, 3, 3, 6]  # seen: 0,1,5 (prompt) and 2,3,6 (output; 3 twice)

    # repetition: every seen token (prompt and output), positive logits divided, negative multiplied
    y = apply_penalties(x.clone(), _req(prompt, output, repetition_penalty=2.0))
    want = x.clone()
    for t in (0, 1, 2, 3, 5, 6):
        want[t] = x[t] / 2 if x[t] > 0 else x[t] * 2
    assert torch.equal(y, want)

    # presence: a flat amount off every token that appeared in the output (not the prompt)
    y = apply_penalties(x.clone(), _req(prompt, output, presence_penalty=0.5))
    want = x.clone()
    want[[2, 3, 6]] -= 0.5
    assert torch.equal(y, want)

    # frequency: proportional to the number of times a token appeared in the output
    y = apply_penalties(x.clone(), _req(prompt, output, frequency_penalty=0.25))
    want = x.clone()
    want[2] -= 0.25
    want[3] -= 0.5
    want[6] -= 0.25
    assert torch.equal(y, want)

    # negative values reward repetition; all three together apply repetition first
    y = apply_penalties(x.clone(), _req(prompt, output, presence_penalty=-1.0, frequency_penalty=1.0,
                                         repetition_penalty=1.5))
    want = x.clone()
    for t in (0, 1, 2, 3, 5, 6):
        want[t] = x[t] / 1.5 if x[t] > 0 else x[t] * 1.5
    for t, count in ((2, 1), (3, 2), (6, 1)):
        want[t] -= 1.0 * count - 1.0
    assert torch.allclose(y, want, rtol=0, atol=1e-6)

    # nothing generated yet: presence/frequency leave the logits alone; defaults change nothing
    assert torch.equal(apply_penalties(x.clone(), _req(prompt, [], presence_penalty=2, frequency_penalty=2)), x)
    assert torch.equal(apply_penalties(x.clone(), _req(prompt, output)), x)


# ---- through the engine --------------------------------------------------------------------
def test_seeded_sampling_reproducible_and_batch_independent(llm, prompts):
    p = prompts[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    a = _tokens(llm.generate([p], seeded)[0])
    b = _tokens(llm.generate([p], seeded)[0])
    assert a == b
    # same request amid others (unseeded ones draw from the engine's generator, other seeds)
    others = [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=99, max_tokens=8, ignore_eos=True, top_p=0.9),
              SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)]
    outs = llm.generate([prompts[1], prompts[2], p, prompts[3]], [others[0], others[1], seeded, others[2]])
    assert _tokens(outs[2]) == a
    # a different seed gives a different draw
    c = _tokens(llm.generate([p], SamplingParams(temperature=1.0, seed=1235, max_tokens=8, ignore_eos=True))[0])
    assert c != a
    assert_no_leaks(llm)


def test_truncation_to_one_token_equals_greedy(llm, prompts):
    p = prompts[1]
    params = [greedy(8, logprobs=None),
              SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=2.0, top_p=1e-6, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.5, min_p=1.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=5)]
    outs = llm.generate([p] * len(params), params)
    g = _tokens(outs[0])
    assert _tokens(outs[1]) == g and _tokens(outs[2]) == g and _tokens(outs[3]) == g
    assert _tokens(outs[4]) != g  # plain temperature sampling does leave the argmax
    assert_no_leaks(llm)


def test_logprobs(llm, prompts):
    n = 5
    params = [greedy(6, logprobs=n), SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=n)]
    outs = llm.generate([prompts[2]] * 2, params)
    tok = llm.get_tokenizer()
    for k, out in enumerate(outs):
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 6
        total = 0.0
        for t, entry in zip(c.token_ids, c.logprobs):
            assert n <= len(entry) <= n + 1
            assert t in entry
            assert all(lp.logprob <= 0 and math.isfinite(lp.logprob) for lp in entry.values())
            top = sorted((lp for lp in entry.values() if lp.rank <= n), key=lambda lp: lp.rank)
            assert [lp.rank for lp in top] == list(range(1, n + 1))
            assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
            mine = entry[t]
            assert mine.rank == 1 + sum(lp.logprob > mine.logprob for lp in top) or mine.rank > n
            assert mine.decoded_token == tok.decode([t])
            total += mine.logprob
            if k == 0:  # greedy: the sampled token is the most likely one
                assert mine.rank == 1
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    # without logprobs nothing is reported
    out = llm.generate([prompts[2]], greedy(2, logprobs=None))[0].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None
    assert_no_leaks(llm)


def test_prompt_logprobs(llm, prompts):
    p = prompts[3]
    out = llm.generate([p], greedy(2, prompt_logprobs=3))[0]
    pl = out.prompt_logprobs
    assert len(pl) == len(p) and pl[0] is None
    ref_logits, _ = llm.engine.model.prefill(p)
    ref = torch.log_softmax(ref_logits.float(), -1)
    for i in range(1, len(p)):
        assert p[i] in pl[i] and 3 <= len(pl[i]) <= 4
        assert all(lp.logprob <= 0 for lp in pl[i].values())
        # the logprob of prompt token i given tokens < i, bitwise as the reference computes it
        assert pl[i][p[i]].logprob == float(ref[i - 1, p[i]])
    # the generated part is unaffected by asking for prompt logprobs
    assert _tokens(out) == _tokens(llm.generate([p], greedy(2))[0])
    assert_no_leaks(llm)


def test_prompt_logprobs_of_a_one_token_prompt(llm):
    out = llm.generate([[1234]], greedy(2, prompt_logprobs=1))[0]
    assert out.prompt_logprobs == [None]
    assert len(_tokens(out)) == 2
    assert_no_leaks(llm)


def test_prompt_logprobs_chunked_and_preempted(tiny_ckpt, prompts):
    """Prompt logprobs gathered over several prefill chunks, and across a preemption mid-prefill.

    (Before the fix in Scheduler._preempt the rows gathered before the preemption were kept and the
    recomputed ones appended after them, so entries past the preemption point were wrong.)"""
    from dsv4.cache.paged import plan_budget, unit_bytes
    from dsv4.config import load_config
    from dsv4.model.cache import CacheNumerics

    cfg, num = load_config(tiny_ckpt), CacheNumerics("auto")
    blk, swa, _ = unit_bytes(cfg, num, torch.float32)
    big = plan_budget(cfg, num, torch.float32, 1 << 34, 2, 64, 512)
    mem = big.total_bytes - (big.num_blocks - 3) * (blk + 2 * swa)  # 3 blocks of 256 tokens
    llm = make_llm(tiny_ckpt, "auto", max_num_seqs=2, max_num_batched_tokens=64, max_model_len=512,
                   kv_cache_memory=mem)
    assert llm.engine.kv_cache.budget.num_blocks == 3
    a, b = rand_prompts(32, [254, 300])
    sched = llm.engine.scheduler
    preempted = []
    orig = sched._preempt

    def record(victim):
        preempted.append((len(victim.prompt_token_ids), victim.num_computed, len(victim.output_token_ids)))
        orig(victim)

    sched._preempt = record
    # a (1 block) takes the last free block for its 3rd token while b is still prefilling; b, needing
    # its 2nd block at token 256, is preempted with 254 prompt tokens computed and later recomputed
    outs = llm.generate([a, b], [greedy(8), greedy(2, prompt_logprobs=0)])
    assert any(n == len(b) and 0 < done < n and not out for n, done, out in preempted), preempted
    pl = outs[1].prompt_logprobs
    assert len(pl) == len(b) and pl[0] is None
    ref_logits, _ = llm.engine.model.prefill(b)
    ref = torch.log_softmax(ref_logits.float(), -1)
    got = [pl[i][b[i]].logprob for i in range(1, len(b))]
    want = [float(ref[i - 1, b[i]]) for i in range(1, len(b))]
    assert got == want
    assert_no_leaks(llm)


def test_n_completions(llm, prompts):
    p = prompts[0]
    out = llm.generate([p], SamplingParams(n=3, temperature=1.0, seed=40, max_tokens=5, ignore_eos=True))[0]
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in out.outputs)
    # with a seed, completion i draws with seed + i: the same as a single request with that seed
    singles = llm.generate([p] * 3, [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=5, ignore_eos=True)
                                     for i in range(3)])
    assert [c.token_ids for c in out.outputs] == [_tokens(s) for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # greedy n=3: three identical completions
    out = llm.generate([p], SamplingParams(n=3, temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert_no_leaks(llm)


def test_stop_token_ids_and_min_tokens(llm, prompts):
    p = prompts[1]
    g = _tokens(llm.generate([p], SamplingParams(temperature=0, max_tokens=6))[0])
    assert len(g) == 6 and len(set(g[:2])) == 2
    # a stop id ends the output at its first occurrence (included in token_ids)
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[g[1]]))[0].outputs[0]
    assert out.token_ids == g[:2] and out.finish_reason == "stop" and out.stop_reason == g[1]
    # min_tokens: the stop id cannot be produced before min_tokens tokens exist
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[g[0]], min_tokens=2))[0]
    toks = out.outputs[0].token_ids
    assert len(toks) >= 2 and g[0] not in toks[:2]
    if g[0] in toks:
        assert toks[-1] == g[0] and toks.index(g[0]) == len(toks) - 1 and out.outputs[0].finish_reason == "stop"
    else:
        assert len(toks) == 6 and out.outputs[0].finish_reason == "length"
    # max_tokens ends with "length" and no stop reason
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert out.token_ids == g[:3] and out.finish_reason == "length" and out.stop_reason is None
    assert_no_leaks(llm)


def test_eos_min_tokens_and_ignore_eos(llm, prompts, monkeypatch):
    """With EOS made the argmax at every step: EOS stops, min_tokens holds it off, ignore_eos runs on."""
    engine = llm.engine
    eos = engine.model_config.eos_token_id
    execute = engine.runner.execute

    def eos_wins(batch):  # (the forward both the synchronous and the async step call)
        logits = execute(batch)
        logits[:, eos] = logits.max(dim=-1).values + 100.0  # probability 1 at any temperature
        return logits

    monkeypatch.setattr(engine.runner, "execute", eos_wins)
    p = prompts[2]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == ""  # EOS is a special token: skipped in the text
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=6, min_tokens=3))[0].outputs[0]
    assert len(out.token_ids) == 4 and eos not in out.token_ids[:3] and out.token_ids[3] == eos
    assert out.finish_reason == "stop"
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == [eos] * 4 and out.finish_reason == "length"
    # sampled (not greedy) requests obey min_tokens the same way
    out = llm.generate([p], SamplingParams(temperature=1.0, seed=1, max_tokens=6, min_tokens=2))[0].outputs[0]
    assert eos not in out.token_ids[:2] and out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert_no_leaks(llm)


def test_stop_strings(llm, prompts):
    p = prompts[3]
    full = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    text, g = full.text, full.token_ids
    assert len(text) >= 8, f"need some generated text to pick a stop string from, got {text!r}"
    mid = len(text) // 2
    stop = text[mid: mid + 3]  # very likely spans a token boundary
    at = text.find(stop)
    for include in (False, True):
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop, "\x00never"],
                                               include_stop_str_in_output=include))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (text[: at + len(stop)] if include else text[:at])
        assert out.token_ids == g[: len(out.token_ids)] and len(out.token_ids) <= 12
        # generation stopped at the token that completed the stop string
        assert stop not in llm.get_tokenizer().decode(out.token_ids[:-1], skip_special_tokens=True)
    # a stop string that never appears changes nothing
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop="\x00never"))[0]
    assert out.outputs[0].text == text and out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def test_output_kind_final_only_reports_once_with_the_cumulative_result(llm, prompts):
    """``final_only`` (what ``LLM.generate`` uses): ``step()`` returns a request's output only when
    it finishes — no per-step copy of its growing token list — and that output is the one the
    cumulative kind ends with."""
    eng = llm.engine
    outs = {}
    for kind in ("cumulative", "final_only"):
        rid = eng.add_request(prompt_token_ids=prompts[1], params=greedy(6, logprobs=2, output_kind=kind))
        seen = []
        while eng.has_unfinished_requests():
            seen += [o for o in eng.step() if o.request_id == rid]
        outs[kind] = seen
    cum, fin = outs["cumulative"], outs["final_only"]
    assert [len(o.outputs[0].token_ids) for o in cum] == [1, 2, 3, 4, 5, 6]
    assert len(fin) == 1 and fin[0].finished
    assert signature(fin[0]) == signature(cum[-1]) and fin[0].outputs[0].logprobs == cum[-1].outputs[0].logprobs
    assert_no_leaks(llm)
    with pytest.raises(ValueError, match="SamplingParams.output_kind must be one of cumulative, delta, final_only"):
        SamplingParams(output_kind="cumulativ")


@pytest.mark.parametrize("stop", [None, "ZZ"])
def test_output_kind_delta_adds_up_to_the_cumulative_output(llm, prompts, stop):
    """``delta`` (what the server streams): each step returns only what it added — token ids,
    logprobs, text (held back near a possible stop string, as the cumulative text is) — and the
    deltas joined (``DeltaAccumulator``, ``merge_delta``) are the cumulative kind's last output, for
    n = 2 seeded samples."""
    from dsv4.engine.outputs import DeltaAccumulator

    eng = llm.engine
    outs = {}
    for kind in ("cumulative", "delta"):
        params = SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=10, logprobs=2, ignore_eos=True,
                                stop=[stop] if stop else None, output_kind=kind)
        rid = eng.add_request(prompt_token_ids=prompts[2], params=params)
        seen = []
        while eng.has_unfinished_requests():
            seen += [o for o in eng.step() if o.request_id == rid]
        outs[kind] = seen
    cum, deltas = outs["cumulative"], outs["delta"]
    assert len(deltas) == len(cum) and all(len(o.outputs[0].token_ids) <= 1 for o in deltas)
    acc = DeltaAccumulator()
    for d in deltas:
        acc.add(d)
    whole, last = acc.result(), cum[-1]
    assert whole.finished
    fields = ("index", "text", "token_ids", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason")
    assert [[getattr(c, f) for f in fields] for c in whole.outputs] == \
        [[getattr(c, f) for f in fields] for c in last.outputs]
    assert sum(len(c.text) for c in last.outputs) > 0
    assert_no_leaks(llm)


def test_generate_leaves_the_callers_params_cumulative(llm, prompts):
    sp = greedy(3)
    out = llm.generate([prompts[0]], sp)[0]
    assert out.finished and len(out.outputs[0].token_ids) == 3 and sp.output_kind == "cumulative"
