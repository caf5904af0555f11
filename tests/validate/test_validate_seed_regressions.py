"""The bring-up's regression list (seed §15.1), through the engine with greedy decoding and the verdict.

Every output must pass the token-level verdict (no BOS/EOS/pad after the first token, no runs, no
loops, the full ``max_tokens``) and agree with the dense-cache reference model teacher-forced over
all its tokens (bitwise-tight tolerances: on CPU the paged engine is the reference). The runs use
the real ``fp8_ds_mla`` cache (584-byte block-packed records). Short prompts and few tokens except
where a boundary needs length.
"""

from __future__ import annotations

import pytest
import torch
from validate_test_support import assert_healthy, greedy, llm_over, rand_prompt, signature


@pytest.fixture(scope="module")
def llm(tiny_ckpt, validate_model):
    return llm_over(validate_model, tiny_ckpt)


def test_single_request_32_tokens_chinese_chat(llm):
    out = llm.chat([{"role": "user", "content": "你好，请介绍一下你自己。"}], greedy(32), thinking=False)
    assert_healthy(llm, out, 32)


def test_single_request_128_tokens(llm):
    """5 prompt tokens + 128 decoded: decode crosses the 64-token SWA page, the 128-token window and
    the first HCA (ratio 128) entry."""
    out = llm.generate("The capital of France is", greedy(128))
    assert len(out[0].prompt_token_ids) + 128 > 130
    assert_healthy(llm, out, 128)


def test_two_turn_dialogue(llm):
    first = llm.chat([{"role": "user", "content": "Hi! Who are you?"}], greedy(8), thinking=False)
    assert_healthy(llm, first, 8)
    convo = [{"role": "user", "content": "Hi! Who are you?"},
             {"role": "assistant", "content": first[0].outputs[0].text},
             {"role": "user", "content": "Tell me more about that."}]
    second = llm.chat(convo, greedy(8), thinking=False)
    assert len(second[0].prompt_token_ids) > len(first[0].prompt_token_ids) + 8
    assert_healthy(llm, second, 8)


def test_eight_different_prompts(llm):
    tok = llm.get_tokenizer()
    from dsv4.chat import encode_messages

    chats = ["What is 17 + 25?", "Write a haiku about rain.", "你好", "List three primes."]
    raws = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 5, 8,"]
    items = [{"prompt_token_ids": tok.encode(encode_messages([{"role": "user", "content": c}], thinking=False))}
             for c in chats] + [{"prompt": r} for r in raws]
    outs = llm.generate(items, greedy(6))
    assert len({tuple(o.prompt_token_ids) for o in outs}) == 8
    assert_healthy(llm, outs, 6)


def test_two_concurrent_requests_equal_each_alone(llm):
    g = torch.Generator().manual_seed(21)
    a, b = rand_prompt(g, 9), rand_prompt(g, 23)
    alone = [signature(llm.generate([p], greedy(6))[0]) for p in (a, b)]
    eng = llm.engine
    ids = [eng.add_request(p, greedy(6)) for p in (a, b)]
    eng.step()
    assert len(eng.scheduler.running) == 2  # both really ran in the same steps
    done = eng.run_to_completion(ids)
    outs = [done[r] for r in ids]
    assert [signature(o) for o in outs] == alone
    assert_healthy(llm, outs, 6)


# prompt lengths around the CSA ratio 4, the 64-token SWA page, the 128-token window / HCA ratio 128
# and the 256-token block; with 4 decoded tokens 3→7, 62→66, 126→130 and 254→258 cross them in decode
BOUNDARY_LENGTHS = (3, 4, 62, 64, 126, 128, 254, 257)


def test_prompts_crossing_page_window_and_compressor_boundaries(llm):
    g = torch.Generator().manual_seed(5)
    prompts = [rand_prompt(g, n) for n in BOUNDARY_LENGTHS]
    outs = llm.generate(prompts, greedy(4))
    assert [len(o.prompt_token_ids) for o in outs] == list(BOUNDARY_LENGTHS)
    assert_healthy(llm, outs, 4)


def test_prefix_caching_on_off_identical(tiny_ckpt, validate_model):
    """A/B: a 300-token prompt, a second sharing its first 256-token block, then the first again; with
    prefix caching the later runs restore the cached block; tokens and logprobs equal the run without."""
    g = torch.Generator().manual_seed(9)
    a = rand_prompt(g, 300)
    b = a[:256] + rand_prompt(g, 20)
    on = llm_over(validate_model, tiny_ckpt, enable_prefix_caching=True)
    off = llm_over(validate_model, tiny_ckpt, enable_prefix_caching=False)
    sig_on = [signature(on.generate([p], greedy(3))[0]) for p in (a, b, a)]
    assert on.engine.kv.hits >= 2 * 256, f"prefix cache hits: {on.engine.kv.hits} tokens"
    sig_off = [signature(off.generate([p], greedy(3))[0]) for p in (a, b)]
    assert off.engine.kv.hits == 0
    assert sig_on == [sig_off[0], sig_off[1], sig_off[0]]


def test_fifty_repeated_runs_without_nan(llm):
    """Fifty runs of a two-request batch on one engine (pages, blocks and slots reused every run):
    finite logits on every step and identical tokens every run."""
    g = torch.Generator().manual_seed(50)
    prompts = [rand_prompt(g, 5), rand_prompt(g, 7)]
    eng = llm.engine
    inner = eng.runner.run
    seen = {"rows": 0, "bad": 0}

    def checked(schedule):
        batch, logits = inner(schedule)
        seen["rows"] += logits.shape[0]
        seen["bad"] += int((~torch.isfinite(logits)).any(dim=-1).sum())
        return batch, logits

    eng.runner.run = checked
    try:
        first = None
        for i in range(50):
            outs = llm.generate(prompts, greedy(2))  # the sampler raises FloatingPointError on NaN/Inf
            sig = [signature(o) for o in outs]
            first = first or sig
            assert sig == first, f"run {i} differs from run 0"
    finally:
        del eng.runner.run
    assert seen["bad"] == 0 and seen["rows"] == 50 * 2 * 2
    assert_healthy(llm, outs, 2)
