"""Bad input raises ValueError naming the limit or field and the offending value, and leaves nothing behind."""

from __future__ import annotations

import re

import pytest
from engine_helpers import assert_no_leaks, greedy, make_llm, rand_prompts

from dsv4.engine.sampling_params import SamplingParams

MAX_LEN = 256


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return make_llm(tiny_ckpt, "auto", max_model_len=MAX_LEN, max_num_seqs=4)


def _raises(fn, *needles):
    with pytest.raises(ValueError) as e:
        fn()
    msg = str(e.value)
    for n in needles:
        assert n in msg, f"{n!r} not in the message {msg!r}"
    return msg


def test_prompt_longer_than_max_model_len(llm):
    long = rand_prompts(41, [MAX_LEN + 44])[0]
    _raises(lambda: llm.generate([long], greedy(4)), f"{MAX_LEN + 44} tokens", f"max_model_len={MAX_LEN}")
    # the prompt fits but not with the requested new tokens
    near = long[: MAX_LEN - 2]
    _raises(lambda: llm.generate([near], greedy(4)), f"{MAX_LEN - 2} tokens", "max_tokens=4",
            f"max_model_len={MAX_LEN}")
    _raises(lambda: llm.engine.add_request(long, greedy(1)), f"max_model_len={MAX_LEN}")
    assert_no_leaks(llm)
    # a prompt that exactly fills the context with its new tokens is fine
    out = llm.generate([long[: MAX_LEN - 2]], greedy(2))[0]
    assert len(out.outputs[0].token_ids) == 2
    assert_no_leaks(llm)


BAD_PARAMS = [
    ("temperature", -0.5),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("min_p", 2),
    ("max_tokens", 0),
    ("n", 0),
    ("logprobs", 50),
    ("prompt_logprobs", 21),
    ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("min_tokens", -1),
    ("stop", ""),
    ("stop_token_ids", [-1]),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_invalid_sampling_value(field, value):
    msg = _raises(lambda: SamplingParams(**{field: value}), repr(value))
    assert re.search(rf"\b{field}\b", msg), f"{field!r} not named in {msg!r}"


def test_min_tokens_above_max_tokens():
    _raises(lambda: SamplingParams(min_tokens=5, max_tokens=3), "min_tokens", "5", "max_tokens", "3")
    SamplingParams(min_tokens=3, max_tokens=3)  # equal is fine


def test_cache_budget_too_small_for_one_request(tiny_ckpt):
    msg = _raises(lambda: make_llm(tiny_ckpt, "auto", max_model_len=1024, max_num_seqs=4, kv_cache_memory=8 << 20),
                  "max_model_len=1024", "8.0 MiB")
    assert re.search(r"at least \d+(\.\d+)? MiB", msg)  # and says what would be enough


def test_out_of_vocabulary_token_id(llm):
    vocab = llm.engine.model_config.vocab_size
    for bad in (vocab, vocab + 1000, -1):
        _raises(lambda: llm.generate([[5, 6, bad, 7]], greedy(2)), f"token id {bad}", str(vocab))
    assert_no_leaks(llm)
    out = llm.generate([[5, 6, vocab - 1, 7]], greedy(1))[0]  # the last id is fine
    assert len(out.outputs[0].token_ids) == 1
    assert_no_leaks(llm)


def test_other_request_errors_leave_nothing_behind(llm):
    good = rand_prompts(42, [10])[0]
    _raises(lambda: llm.generate([[]], greedy(2)), "empty")
    # a batch whose second prompt is bad: the first, already added, is withdrawn again
    _raises(lambda: llm.generate([good, [good[0], -5]], greedy(2)), "token id -5")
    assert_no_leaks(llm)
    rid = llm.engine.add_request(good, greedy(2), request_id="dup")
    _raises(lambda: llm.engine.add_request(good, greedy(2), request_id="dup"), "'dup'")
    llm.engine.run_to_completion([rid])
    assert_no_leaks(llm)


def test_a_request_that_fails_in_the_engine_fails_alone(llm, monkeypatch):
    """Sampling one request raises: the engine finishes that request with ``finish_reason="error"``
    and ``RequestOutput.error`` naming the failure, serves the others, and frees its pages; a failed
    forward fails the requests of its step only."""
    from dsv4.engine.sampler import Sampler

    eng = llm.engine
    true_sample = Sampler.sample

    def sample(self, req, logits, mask=None):
        if req.request_id == "bad" and req.output_token_ids:
            raise RuntimeError("scripted sampling failure")
        return true_sample(self, req, logits, mask)

    monkeypatch.setattr(Sampler, "sample", sample)
    monkeypatch.setattr(Sampler, "batched_greedy", False)
    prompts = rand_prompts(43, [20, 30])
    eng.add_request(prompt_token_ids=prompts[0], params=greedy(4), request_id="bad")
    eng.add_request(prompt_token_ids=prompts[1], params=greedy(4), request_id="good")
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done["bad"].outputs[0].finish_reason == "error" and "scripted sampling failure" in done["bad"].error
    assert done["good"].error is None and len(done["good"].outputs[0].token_ids) == 4
    assert_no_leaks(llm)

    runner_execute = eng.runner.execute

    def failing(batch):
        raise RuntimeError("simulated device error")

    eng.runner.execute = failing
    try:
        eng.add_request(prompt_token_ids=prompts[0], params=greedy(2), request_id="step")
        outs = eng.step()
    finally:
        eng.runner.execute = runner_execute
    assert [o.request_id for o in outs] == ["step"] and outs[0].finished
    assert outs[0].outputs[0].finish_reason == "error" and "simulated device error" in outs[0].error
    assert not eng.has_unfinished_requests()
    assert_no_leaks(llm)

    def always_fails(self, req, logits, mask=None):
        raise RuntimeError("scripted sampling failure")

    monkeypatch.setattr(Sampler, "sample", always_fails)
    with pytest.raises(RuntimeError, match="scripted sampling failure"):  # LLM.generate raises what failed it
        llm.generate([prompts[0]], greedy(3))
    assert_no_leaks(llm)


def test_a_step_failure_fails_the_requests_it_carries_whatever_its_message_says(llm):
    """A ``RequestError`` escaping a step fails exactly its ``request_ids``: its message names another
    request and not the failed one, and the step's other requests go on to the tokens a clean run gives."""
    from dsv4.engine.errors import RequestError

    eng = llm.engine
    prompts = rand_prompts(47, [12, 18, 25])
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(4))]
    execute = eng.runner.execute
    failed = []

    def fail_once(batch):
        if not failed:
            failed.append(True)
            raise RequestError("a fault in the row beside request a", ["b"])
        return execute(batch)

    for rid, p in zip("abc", prompts):
        eng.add_request(prompt_token_ids=p, params=greedy(4), request_id=rid)
    eng.runner.execute = fail_once
    try:
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        eng.runner.execute = execute
    assert failed and sorted(done) == ["a", "b", "c"]
    assert done["b"].outputs[0].finish_reason == "error" and "a fault in the row" in done["b"].error
    assert [done[r].outputs[0].token_ids for r in "ac"] == [want[0], want[2]]
    assert done["a"].error is None and done["c"].error is None
    assert_no_leaks(llm)


def test_request_errors_keep_their_ids_across_processes():
    """A data-parallel rank pickles a failed request's error into its reply: type, message and ids survive."""
    import pickle

    from dsv4.engine.errors import GrammarError, NonFiniteLogitsError, RequestError

    for e in (NonFiniteLogitsError.at("r1", 3), GrammarError.of("r2", "no token"), RequestError("x", ["a", "b"])):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and back.request_ids == e.request_ids
    assert str(NonFiniteLogitsError.at("r1", 3)) == "request r1: non-finite logits at output token 3"
    assert isinstance(NonFiniteLogitsError.at("r1", 3), FloatingPointError)
    assert isinstance(GrammarError.of("r2", "no token"), ValueError)


def test_context_length_is_checked_in_one_place():
    """``context_budget``: max_tokens, or what the prompt leaves; a refusal carries the lengths (and pickles)."""
    import pickle

    from dsv4.engine.errors import ContextLengthError, context_budget

    assert context_budget(10, None, 16) == 6 and context_budget(10, 6, 16) == 6 and context_budget(10, 0, 16) == 0
    for n, m in ((16, None), (16, 1), (10, 7), (20, 0)):
        with pytest.raises(ContextLengthError) as e:
            context_budget(n, m, 16)
        back = pickle.loads(pickle.dumps(e.value))
        assert (back.prompt_len, back.max_tokens, back.max_model_len, str(back)) == (n, m, 16, str(e.value))
        assert back.prompt_too_long == (n >= 16)
