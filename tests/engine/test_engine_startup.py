"""Serving without stalls, the parts a CPU can check: the contention-aware chunking, the device
defaults, the start-up warm-up and the count of kernel builds."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_no_leaks, greedy, make_llm, rand_prompts

from dsv4.engine.settings import EngineConfig
from dsv4.engine.warmup import prefill_lengths


def test_device_defaults_of_the_step_budget_and_the_long_prefill_cap():
    cpu = EngineConfig(model="m").resolved(torch.device("cpu"), "ocp", False)
    gpu = EngineConfig(model="m").resolved(torch.device("cuda"), "ocp", True)
    assert (cpu.max_num_batched_tokens, cpu.long_prefill_token_threshold, cpu.warm_up) == (2048, 0, False)
    assert (gpu.max_num_batched_tokens, gpu.long_prefill_token_threshold, gpu.warm_up) == (8192, 1024, True)
    mine = EngineConfig(model="m", max_num_batched_tokens=4096, long_prefill_token_threshold=0, warm_up=False)
    mine = mine.resolved(torch.device("cuda"), "ocp", True)
    assert (mine.max_num_batched_tokens, mine.long_prefill_token_threshold, mine.warm_up) == (4096, 0, False)


def test_a_long_prefill_is_cut_only_under_contention(tiny_ckpt):
    """Alone a prompt takes the whole budget; beside a decoding request its chunks take at most the
    threshold, and the decode keeps its token every step; the tokens are those of an uncut run."""
    budget, cap = 512, 64
    llm = make_llm(tiny_ckpt, "auto", max_model_len=1024, max_num_batched_tokens=budget,
                   long_prefill_token_threshold=cap)
    eng = llm.engine
    long, short = rand_prompts(51, [900, 10])
    eng.add_request(prompt_token_ids=long, params=greedy(2), request_id="alone")
    assert [sc.num_tokens for sc in eng.scheduler.schedule()] == [budget]
    eng.abort_request("alone")
    assert_no_leaks(llm)

    eng.add_request(prompt_token_ids=short, params=greedy(12), request_id="decode")
    eng.step()  # its prefill
    eng.add_request(prompt_token_ids=long, params=greedy(2), request_id="long")
    chunks = []
    real = eng.scheduler.schedule

    def watch():
        out = real()
        chunks.append({sc.req.request_id: sc.num_tokens for sc in out})
        return out

    eng.scheduler.schedule = watch
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    eng.scheduler.schedule = real
    beside = [c for c in chunks if "decode" in c and "long" in c]
    assert beside and all(c["long"] <= cap and c["decode"] == 1 for c in beside)
    assert any(set(c) == {"long"} and c["long"] > cap for c in chunks)  # alone again: past the cap
    uncut = make_llm(tiny_ckpt, "auto", max_model_len=1024, max_num_batched_tokens=budget)
    want = uncut.generate([long, short], [greedy(2), greedy(12)])
    assert done["long"] == want[0].outputs[0].token_ids and done["decode"] == want[1].outputs[0].token_ids
    assert_no_leaks(llm)


def test_prefill_lengths_cover_powers_of_two_and_their_neighbours():
    assert prefill_lengths(40) == [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40]
    got = prefill_lengths(8192)
    assert got[-1] == 8192 and {1023, 1024, 1025, 4095, 4096, 4097} <= set(got) and len(got) == len(set(got))


def test_warm_up_leaves_the_engine_as_it_was(tiny_ckpt):
    """The warm-up runs every planned step shape through the real engine, then drops its cache
    blocks and counters; what a request computes afterwards is bitwise what it computes without."""
    warm = make_llm(tiny_ckpt, "fp8_ds_mla", max_model_len=400, max_num_batched_tokens=128, warm_up=True)
    eng = warm.engine
    rep = eng.warm_up_report
    assert rep["context"] == 399 and rep["prefill_lengths"][-1] == 128 and rep["steps"] > len(rep["prefill_lengths"])
    assert eng.startup["warm_up"] > 0 and "weights" in eng.startup and eng.startup["kernels_built"] >= 0
    assert eng.kv.hits == 0 and eng.kv.queries == 0 and not eng.kv.blocks.evictable and not eng.requests
    assert_no_leaks(warm)
    cold = make_llm(tiny_ckpt, "fp8_ds_mla", max_model_len=400, max_num_batched_tokens=128)
    prompts = rand_prompts(52, [70, 300])
    a = warm.generate(prompts, greedy(3))
    b = cold.generate(prompts, greedy(3))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert [lp for lp in x.outputs[0].logprobs] == [lp for lp in y.outputs[0].logprobs]


def test_kernel_builds_are_counted_through_tritons_hook():
    knobs = pytest.importorskip("triton.knobs")
    from dsv4.ops import compiles

    assert compiles.install() and compiles.install()  # idempotent
    before = compiles.count()

    class Fn:
        name = "_fake_kernel"

    knobs.runtime.jit_post_compile_hook(key=None, repr="", fn=Fn(), compile={}, is_manual_warmup=False,
                                        already_compiled=False)
    assert compiles.count() == before + 1 and compiles.recent()[-1] == "_fake_kernel"
