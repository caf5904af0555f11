"""Sampling with speculation follows the target's distribution: chi-square tests for MTP on the
canary and for DSpark on the tiny DSpark checkpoint.

Many seeded requests draw the next ``LENGTH`` tokens of one prompt at temperature 1, top-p 0.9,
with and without speculation (k=2); the counts of each drawn sequence are tested against its
exact probability, computed from the reference model over the whole top-p tree. The canary's
trained MTP layer gets most drafts accepted, so every draft position and the rejection rule's
resampling are exercised: the second token is a judged draft, the third the replacement or the
bonus. The negative control keeps every draft unverified (the output then follows the drafter);
the same test must reject it (the test has power). Measured here (300 samples): p = 0.12 without
speculation, 0.48 with it, 0 for unverified drafts. Greedy acceptance (keep a draft that is the
target's first choice, else draw from p) is wrong too, but its bias here, q(a)(1 - p(a)) = 0.08 on
one token of the second position, is below what 300 samples resolve (p = 0.23): it is no control
within this test's time. (Keeping the draft when it equals the target's own draw, else emitting that
draw, is exact sampling from p whatever the drafts: no control at all.)

DSpark: the tiny DSpark checkpoint (random, 8-token vocabulary) at temperature 1, top-k 3, k=2:
its drafts, drawn from its own top-3 with the Markov bias, fall in the target's top-3 often enough
that both the acceptance and the residual draw are exercised; the unverified-drafts control must
fail there too. Measured here: p = 0.54 with DSpark (150 samples, 77 of 150 drafts accepted), 0 for
unverified drafts (60 samples).

Deterministic (fixed seeds); the thresholds leave orders of magnitude on both sides of the
p-values measured here, so a CPU whose kernels round differently (a few draws flip) cannot
change an outcome. Exact probabilities are only trusted where no top-p cut is within
``CUT_MARGIN`` of the threshold (asserted), since a logit rounded differently cannot move a token
across such a cut.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_llm

from dsv4.canary import default_model_dir
from dsv4.canary.tokenizer import CharCodec
from dsv4.engine import spec_graphs, speculative
from dsv4.engine.sampler import filter_logits
from dsv4.engine.sampling_params import SamplingParams

PROMPT = "987*65="  # the canary is sure of the first digit, unsure of the next two: 36 sequences in top-p 0.9
LENGTH = 3
TOP_P = 0.9
SAMPLES = 300
CUT_MARGIN = 1e-3
PASS_P = 1e-3  # a correct sampler: measured p-values are far above it
REJECT_P = 1e-8  # a wrong rule: measured p-values are far below it


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    codec = CharCodec()
    return [codec.bos] + codec.encode(PROMPT)


@pytest.fixture(scope="module")
def llms():
    """Without speculation, with it (k=2) and with it as graph steps (emulated on the CPU: the rule,
    the residual draw and the drafts' draws on the device); batched paged attention (its torch ops:
    under the suite's ``TRITON_INTERPRET=1`` the registry would pick the interpreted kernels), the
    default cache dtype."""
    base = dict(max_model_len=256, max_num_seqs=64, max_num_batched_tokens=2048, attention="batched",
                backend="torch")
    plain = make_llm(default_model_dir(), "auto", **base)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    spec = make_llm(default_model_dir(), "auto", speculative_config=mtp, **base)
    graphs = make_llm(default_model_dir(), "auto", speculative_config=mtp, **base)
    graphs.engine.capture_spec_graphs()
    return {"plain": plain, "mtp": spec, "mtp-graphs": graphs}


def exact_sequences(model, prompt_ids: list[int], length: int, top_k: int = 0,
                    top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    """Every sequence of ``length`` tokens reachable under top-k / top-p at temperature 1, and its
    exact probability (the engine's reference model on dense caches of the same numerics)."""
    tree = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, prob in tree.items():
            logits = model.prefill(prompt_ids + list(prefix))[0][-1].float()
            ranked = logits.sort(descending=True).values
            if top_k:  # a rounding cannot move a token across the k-th place
                assert float(ranked[top_k - 1] - ranked[top_k]) > CUT_MARGIN, (prefix, "a top-k cut is too close")
            if top_p < 1.0:
                probs = torch.softmax(logits, dim=-1).sort(descending=True).values
                before = torch.cumsum(probs, dim=-1) - probs  # filter_logits cuts where this reaches top_p
                assert float((before - top_p).abs().min()) > CUT_MARGIN, (prefix, "a top-p cut is too close to call")
            p = torch.softmax(filter_logits(logits, top_k, top_p, 0.0), dim=-1)
            for tok in torch.nonzero(p).flatten().tolist():
                grown[prefix + (tok,)] = prob * float(p[tok])
        tree = grown
    return tree


@pytest.fixture(scope="module")
def target(llms, prompt_ids) -> dict[tuple[int, ...], float]:
    return exact_sequences(llms["plain"].engine.model, prompt_ids, LENGTH, top_p=TOP_P)


def sample_counts(llm, prompt_ids, top_k: int = 0, top_p: float = TOP_P,
                  samples: int = SAMPLES) -> dict[tuple[int, ...], int]:
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=LENGTH, ignore_eos=True,
                             seed=1000 + i) for i in range(samples)]
    outs = llm.generate([{"prompt_token_ids": prompt_ids}] * samples, params)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        seq = tuple(o.outputs[0].token_ids)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def chi_square_p(counts: dict, target: dict) -> float:
    """Pearson's test of the counts against the target's probabilities; a sequence outside the
    target's support fails outright (p = 0), cells expected below 5 draws are pooled into one."""
    if set(counts) - set(target):
        return 0.0
    n = sum(counts.values())
    cells, pooled = [], [0.0, 0.0]
    for seq, prob in target.items():
        if prob * n >= 5:
            cells.append((counts.get(seq, 0), prob * n))
        else:
            pooled[0] += counts.get(seq, 0)
            pooled[1] += prob * n
    if pooled[1] > 0:
        cells.append(tuple(pooled))
    stat = sum((obs - exp) ** 2 / exp for obs, exp in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _accept_always(sampler, req, x, draft, q):
    """Wrong: every draft is kept (no verification: the output follows the drafter's q)."""
    return draft


def accept_always(monkeypatch) -> None:
    """Every draft kept, on the host (the eager rule) and on the device (the graphs' rule)."""
    monkeypatch.setattr(speculative, "_judge", _accept_always)
    monkeypatch.setattr(spec_graphs, "accept_drafts", lambda u, p, q: torch.ones_like(u, dtype=torch.bool))


@pytest.mark.parametrize("mode", ["plain", "mtp", "mtp-graphs"])
def test_sampled_sequences_follow_the_target(mode, llms, prompt_ids, target):
    llm = llms[mode]
    before = llm.engine.spec_stats.num_accepted_tokens
    replays = getattr(llm.engine.spec_graphs, "replays", 0)
    p = chi_square_p(sample_counts(llm, prompt_ids), target)
    assert p > PASS_P, p
    if mode != "plain":  # the drafts were really judged: most of them accepted
        stats = llm.engine.spec_stats
        assert stats.num_accepted_tokens - before > SAMPLES // 2
    if mode == "mtp-graphs":  # every request's verify step was a graph step
        assert llm.engine.spec_graphs.replays - replays >= SAMPLES // 64


@pytest.mark.parametrize("mode", ["mtp", "mtp-graphs"])
def test_unverified_drafts_are_rejected(mode, llms, prompt_ids, target, monkeypatch):
    accept_always(monkeypatch)
    p = chi_square_p(sample_counts(llms[mode], prompt_ids), target)
    assert p < REJECT_P, p


# ---- DSpark ------------------------------------------------------------------------------------
DSPARK_TOP_K = 3
DSPARK_PROMPT = [5, 3, 7, 2, 6, 4, 4, 3, 6, 5, 2]
DSPARK_SAMPLES = 150  # 27 sequences in the top-3 tree: enough draws per cell, half the MTP test's time
DSPARK_CONTROL_SAMPLES = 60  # unverified drafts leave the target's support within a few requests


@pytest.fixture(scope="module")
def dspark_llms(tiny_dspark_ckpt):
    """Batched paged attention (its torch ops, as for MTP above): k=2 eagerly, and k=1 as graph steps
    (emulated): a request whose first draft is rejected then has its next draft drawn on the device
    and judged there against the distribution the graph kept for it."""
    base = dict(max_model_len=256, max_num_seqs=64, max_num_batched_tokens=2048, attention="batched",
                backend="torch")
    eager = make_llm(tiny_dspark_ckpt, "auto", speculative_config={"method": "dspark", "num_speculative_tokens": 2},
                     **base)
    graphs = make_llm(tiny_dspark_ckpt, "auto", speculative_config={"method": "dspark", "num_speculative_tokens": 1},
                      **base)
    graphs.engine.capture_spec_graphs()
    return {"dspark": eager, "dspark-graphs": graphs}


@pytest.fixture(scope="module")
def dspark_target(dspark_llms) -> dict[tuple[int, ...], float]:
    return exact_sequences(dspark_llms["dspark"].engine.model, DSPARK_PROMPT, LENGTH, top_k=DSPARK_TOP_K)


@pytest.mark.parametrize("mode", ["dspark", "dspark-graphs"])
def test_dspark_sampled_sequences_follow_the_target(mode, dspark_llms, dspark_target):
    llm = dspark_llms[mode]
    stats = llm.engine.spec_stats
    before = stats.since(type(stats)())  # a copy
    replays = getattr(llm.engine.spec_graphs, "replays", 0)
    counts = sample_counts(llm, DSPARK_PROMPT, DSPARK_TOP_K, 1.0, DSPARK_SAMPLES)
    p = chi_square_p(counts, dspark_target)
    assert p > PASS_P, p
    run = stats.since(before)  # the drafts were really judged: accepted and rejected alike
    assert run.num_drafts >= DSPARK_SAMPLES
    assert DSPARK_SAMPLES // 10 < run.num_accepted_tokens < run.num_draft_tokens
    if mode == "dspark-graphs":  # second graph steps: the drafts the first ones drew on the device
        assert llm.engine.spec_graphs.replays - replays >= 2 * DSPARK_SAMPLES // 64


@pytest.mark.parametrize("mode", ["dspark", "dspark-graphs"])
def test_dspark_unverified_drafts_are_rejected(mode, dspark_llms, dspark_target, monkeypatch):
    accept_always(monkeypatch)
    p = chi_square_p(sample_counts(dspark_llms[mode], DSPARK_PROMPT, DSPARK_TOP_K, 1.0, DSPARK_CONTROL_SAMPLES),
                     dspark_target)
    assert p < REJECT_P, p
