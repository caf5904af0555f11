"""Structured outputs (JSON schema, regex, choice, Lark grammar) and logit_bias in the engine.

The tiny checkpoint's weights are random, so what it writes is arbitrary: every output below is only
well-formed because the grammar's mask allowed nothing else.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
from engine_helpers import assert_no_leaks, greedy, make_llm, rand_prompts
from tiny_vocab import RELEASE_TOKEN_HI

from dsv4.engine.request import Request
from dsv4.engine.sampler import Sampler
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.structured import StructuredOutputsParams, apply_bitmask, bitmask_rows


@pytest.fixture(scope="module")
def llm(tiny_ckpt_release_vocab):  # grammars need every token of the tokenizer
    return make_llm(tiny_ckpt_release_vocab, "auto", max_num_seqs=24, max_model_len=512)


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded schema (every string, array and number has a size limit), so each output ends."""
    kinds = ["string", "integer", "boolean", "enum"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "integer":
        return {"type": "integer", "minimum": -50, "maximum": rng.randint(0, 999)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, None, True], rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": _random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    names = rng.sample(["id", "name", "tags", "ok", "size", "kind"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: _random_schema(rng, depth + 1) for n in names},
            "required": names, "additionalProperties": False}


def _object_schema(rng: random.Random) -> dict:
    while (s := _random_schema(rng, 1))["type" if "type" in s else "enum"] != "object":
        pass
    return s


def test_twenty_random_json_schemas(llm):
    """Every output parses and validates against its schema, greedy and sampled, in one batch."""
    rng = random.Random(36)
    schemas = [_object_schema(rng) for _ in range(20)]
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=300,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(s) if i % 3 else s))
              for i, s in enumerate(schemas)]
    prompts = rand_prompts(7, [5 + i % 9 for i in range(len(params))], RELEASE_TOKEN_HI)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (i, c.text)
        jsonschema.validate(json.loads(c.text), schemas[i])
    assert_no_leaks(llm)


def test_json_object_regex_choice_and_lark(llm):
    cases = [
        (StructuredOutputsParams(regex=r"[a-z]{2,4}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-z]{2,4}-[0-9]{2}", t)),
        (StructuredOutputsParams(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        (StructuredOutputsParams(grammar='start: "x" ("+" NUM)~1..3\nNUM: /[0-9]/'),
         lambda t: re.fullmatch(r"x(\+[0-9]){1,3}", t)),
        (StructuredOutputsParams(grammar='start: "v=" %json {"type": "object", "properties": {"k": {"type": "string", '
                                         '"maxLength": 3}}, "required": ["k"], "additionalProperties": false}'),
         lambda t: t.startswith("v=") and isinstance(json.loads(t[2:])["k"], str)),
        (StructuredOutputsParams(json_object=True), None),
    ]
    prompts = rand_prompts(8, [6, 11], RELEASE_TOKEN_HI)
    params = [SamplingParams(temperature=t, seed=3, max_tokens=60, structured_outputs=so)
              for so, _ in cases for t in (0.0, 0.8)]
    outs = llm.generate([{"prompt_token_ids": prompts[i % 2]} for i in range(len(params))], params)
    for i, out in enumerate(outs):
        so, ok = cases[i // 2]
        c = out.outputs[0]
        if ok is None:  # any object: a random model need not close it in 60 tokens, but it opens one
            assert c.text.startswith("{") and (c.finish_reason == "length" or isinstance(json.loads(c.text), dict))
            continue
        assert c.finish_reason == "stop" and ok(c.text), (so, c.text)


def test_n_sequences_each_follow_the_grammar(llm):
    so = StructuredOutputsParams(regex=r"(ab|cd|ef){1,4}!")
    out = llm.generate({"prompt_token_ids": rand_prompts(9, [7], RELEASE_TOKEN_HI)[0]},
                       SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=30, structured_outputs=so))[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert re.fullmatch(r"(ab|cd|ef){1,4}!", c.text) and c.finish_reason == "stop", c.text


def test_guided_greedy_is_batch_invariant_and_keeps_raw_logprobs(llm):
    """A guided greedy request gives the same tokens and logprobs alone and batched with others, and
    its logprobs are the model's raw ones (the first token's equal the unguided request's)."""
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}},
                                       "required": ["a"], "additionalProperties": False})
    p = rand_prompts(10, [13], RELEASE_TOKEN_HI)[0]
    alone = llm.generate({"prompt_token_ids": p}, greedy(40, logprobs=3, structured_outputs=so))[0].outputs[0]
    others = rand_prompts(11, [9, 30, 4], RELEASE_TOKEN_HI)
    batch = llm.generate([{"prompt_token_ids": q} for q in [others[0], p, *others[1:]]],
                         [greedy(12), greedy(40, logprobs=3, structured_outputs=so), greedy(7), greedy(20)])
    together = batch[1].outputs[0]
    assert together.token_ids == alone.token_ids
    assert [{k: v.logprob for k, v in d.items()} for d in together.logprobs] == \
           [{k: v.logprob for k, v in d.items()} for d in alone.logprobs]
    free = llm.generate({"prompt_token_ids": p}, greedy(1, logprobs=3))[0].outputs[0]
    assert free.token_ids[0] != alone.token_ids[0]  # (the random model would not write '{' unguided)
    top_free = {k: v.logprob for k, v in free.logprobs[0].items() if v.rank <= 3}
    top_guided = {k: v.logprob for k, v in alone.logprobs[0].items() if v.rank <= 3}
    assert top_free == top_guided
    assert json.loads(alone.text)


def test_logit_bias(llm):
    p = rand_prompts(12, [10], RELEASE_TOKEN_HI)[0]
    base = llm.generate({"prompt_token_ids": p}, greedy(4))[0].outputs[0].token_ids
    forced = llm.generate({"prompt_token_ids": p}, greedy(4, logit_bias={"4242": 100}))[0].outputs[0]
    assert forced.token_ids == [4242] * 4
    # the logprob reported is the raw distribution's, not the biased one
    raw = llm.generate({"prompt_token_ids": p}, greedy(1, logprobs=0))[0].outputs[0]
    assert forced.logprobs[0][4242].logprob < raw.logprobs[0][raw.token_ids[0]].logprob
    banned = llm.generate({"prompt_token_ids": p}, greedy(4, logit_bias={base[0]: -100}))[0].outputs[0]
    assert banned.token_ids[0] != base[0]
    sampled = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=1.0, seed=5, max_tokens=6,
                                                                   logit_bias={77: 100}))[0].outputs[0]
    assert sampled.token_ids == [77] * 6


def test_bad_constraints_are_errors_naming_the_field(llm):
    eng = llm.engine
    p = rand_prompts(13, [5], RELEASE_TOKEN_HI)[0]
    with pytest.raises(ValueError, match=r"structured_outputs\.json: invalid json"):
        eng.add_request(prompt_token_ids=p, params=SamplingParams(
            structured_outputs=StructuredOutputsParams(json={"type": "objectx"})))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        eng.add_request(prompt_token_ids=p, params=SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar"):
        eng.add_request(prompt_token_ids=p, params=SamplingParams(
            structured_outputs=StructuredOutputsParams(grammar="start: missing_rule")))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"response_format\.json: not valid JSON"):
        StructuredOutputsParams(json="{not json", source="response_format")
    with pytest.raises(ValueError, match=r"choice: must be a non-empty list of strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match=r"logit_bias: token id 999999 is outside the vocabulary"):
        eng.add_request(prompt_token_ids=p, params=SamplingParams(logit_bias={999999: 1}))
    for bad in ({"x": 1}, {5: 101}, {5: float("nan")}, {-1: 1}, {5: "1"}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    assert eng.requests == {}  # nothing was added by the refused requests
    # a grammar that is complete ends the output, even before min_tokens (it can take no more tokens)
    eng.add_request(prompt_token_ids=p, request_id="short", params=SamplingParams(
        temperature=0, min_tokens=3, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a")))
    eng.add_request(prompt_token_ids=p, request_id="fine", params=greedy(3))
    done = eng.run_to_completion(["short", "fine"])
    assert done["short"].outputs[0].text == "a" and done["short"].outputs[0].finish_reason == "stop"
    assert done["fine"].outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def test_a_mask_that_allows_nothing_is_an_error_naming_the_request():
    req = Request("r7", [5, 6], SamplingParams(temperature=0), eos_token_id=1)
    with pytest.raises(ValueError, match="request r7: the structured output's grammar allows no token"):
        Sampler(1).sample(req, torch.randn(100), mask=torch.zeros(4, dtype=torch.int32))


def test_guide_rollback_and_bitmask(llm):
    """Rolling a guide back restores its mask (what a rejected speculative draft needs); the mask
    sets to −inf exactly the tokens whose bit is 0."""
    eng = llm.engine
    tok = eng.tokenizer
    (g,) = eng.grammars.guides(StructuredOutputsParams(regex=r"hello (world|there)"), 1)
    ids = tok.encode("hello wor")
    m0 = bitmask_rows([g], eng.model_config.vocab_size)
    for t in ids[:1]:
        g.accept(t)
    m1 = bitmask_rows([g], eng.model_config.vocab_size)
    for t in ids[1:]:
        g.accept(t)
    assert not g.done
    g.rollback(len(ids) - 1)
    assert torch.equal(bitmask_rows([g], eng.model_config.vocab_size), m1)
    g.rollback(1)
    assert torch.equal(bitmask_rows([g], eng.model_config.vocab_size), m0)
    with pytest.raises(ValueError, match="does not continue the grammar"):
        g.accept(tok.encode("xyz")[0])
    v = eng.model_config.vocab_size
    x = torch.randn(1, v)
    allowed = apply_bitmask(x, m0)[0]
    bits = [(int(m0[0, i // 32]) >> (i % 32)) & 1 for i in range(v)]
    assert torch.equal(torch.isfinite(allowed), torch.tensor(bits, dtype=torch.bool))
    assert torch.equal(allowed[torch.isfinite(allowed)], x[0][torch.isfinite(allowed)])
