"""Async scheduling (``EngineConfig.async_scheduling``, ``engine/overlap.py``): the next step is
scheduled and launched before the previous step's greedy picks are read.

The tokens must be exactly the synchronous engine's (same picks of the same logits), also where a
request stops on a token nobody could predict (its one extra computed token is dropped), where the
scheduler preempts, where a request is aborted while its step is in flight, where a non-greedy
request forces synchronous steps, and through the (CPU-emulated) decode graphs; and nothing may leak.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_no_leaks, make_llm, rand_prompts

from dsv4.engine.sampling_params import SamplingParams


def _plain(max_tokens: int, **kw) -> SamplingParams:
    """Plain greedy (no logprobs): the samples async scheduling keeps on the device."""
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def _results(outs) -> list[tuple]:
    return [(tuple(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def _pair(tiny_ckpt, kv_dtype="auto", **kw):
    return (make_llm(tiny_ckpt, kv_dtype, async_scheduling=False, **kw),
            make_llm(tiny_ckpt, kv_dtype, async_scheduling=True, **kw))


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_ds_mla"])
def test_async_greedy_equals_sync(tiny_ckpt, kv_dtype):
    """Mixed prompt lengths (one decodes across a 256-token block: prefix-cache registration while a
    step is in flight), max_tokens 1..9 (a request ending at its first token never gets a placeholder)."""
    prompts = rand_prompts(41, [5, 63, 126, 250, 30])
    params = [_plain(n) for n in (1, 2, 7, 9, 5)]
    sync, asy = _pair(tiny_ckpt, kv_dtype, max_num_seqs=8)
    want = _results(sync.generate(prompts, params))
    got = _results(asy.generate(prompts, params))
    assert got == want
    assert asy.engine.num_overlapped_steps >= 5  # the steady decode steps overlapped
    assert_no_leaks(asy)
    again = _results(asy.generate(prompts[::-1], params[::-1]))  # prefix-cache hits, other order
    assert again == want[::-1]
    assert_no_leaks(asy)


def test_async_stops_drop_the_extra_token(tiny_ckpt):
    """Stops decided by the picked token (a stop id, a stop string, max_tokens) end the request at the
    same token as without async scheduling, although the next step was already computed for it."""
    prompts = rand_prompts(42, [12, 40, 70])
    sync, asy = _pair(tiny_ckpt, max_num_seqs=8)
    base = sync.generate(prompts, _plain(10))
    stop_id = base[0].outputs[0].token_ids[3]
    params = [_plain(10, stop_token_ids=[stop_id]), _plain(10), _plain(3)]
    text = base[1].outputs[0].text
    if len(text) >= 4:
        params[1] = _plain(10, stop=[text[len(text) // 2: len(text) // 2 + 2]])
    want = _results(sync.generate(prompts, params))
    assert want[0][2] == "stop" and len(want[0][0]) <= 4
    got = _results(asy.generate(prompts, params))
    assert got == want
    assert asy.engine.num_overlapped_steps > 0
    assert_no_leaks(asy)


def test_async_with_a_sampled_request_runs_its_steps_synchronously(tiny_ckpt):
    """A seeded temperature-0.8 request samples on the host: while it samples, steps are not deferred;
    the greedy requests around it and the sampled one give the synchronous engine's tokens."""
    prompts = rand_prompts(43, [20, 33, 9])
    params = [_plain(6), SamplingParams(temperature=0.8, seed=7, max_tokens=3, ignore_eos=True), _plain(8)]
    sync, asy = _pair(tiny_ckpt, max_num_seqs=8)
    assert _results(asy.generate(prompts, params)) == _results(sync.generate(prompts, params))
    assert asy.engine.num_overlapped_steps > 0  # once the sampled request ended
    assert_no_leaks(asy)


def test_async_under_preemption(tiny_ckpt):
    """Three 256-token blocks for two requests that each need two: the second one, decoding (so
    holding a placeholder under async scheduling), is preempted when the first needs its second block,
    and recomputed later; the tokens are the synchronous engine's and every page comes back."""
    from dsv4.cache.paged import plan_budget, unit_bytes
    from dsv4.config import load_config
    from dsv4.engine.engine import EngineConfig
    from dsv4.model.cache import CacheNumerics

    cfg, num = load_config(tiny_ckpt), CacheNumerics("auto")
    dtype = EngineConfig(model=str(tiny_ckpt)).torch_dtype(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    blk, swa, _ = unit_bytes(cfg, num, dtype)  # the engine's compute dtype sizes its pages
    big = plan_budget(cfg, num, dtype, 1 << 34, 2, 64, 512)
    mem = big.total_bytes - (big.num_blocks - 3) * (blk + 2 * swa)
    kw = dict(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=512, kv_cache_memory=mem)
    sync, asy = _pair(tiny_ckpt, **kw)
    prompts = rand_prompts(44, [250, 252])
    params = [_plain(12), _plain(12)]
    want = _results(sync.generate(prompts, params))
    sched = asy.engine.scheduler
    held = []
    preempt = sched._preempt
    sched._preempt = lambda victim: held.append(victim.pending_tokens > 0) or preempt(victim)
    got = _results(asy.generate(prompts, params))
    assert sync.engine.scheduler.num_preemptions > 0 and any(held), held
    assert got == want
    assert_no_leaks(asy)


def test_async_abort_while_in_flight(tiny_ckpt):
    prompts = rand_prompts(45, [17, 29])
    sync, asy = _pair(tiny_ckpt, max_num_seqs=8)
    want = _results(sync.generate(prompts[1:], _plain(8)))
    eng = asy.engine
    ra = eng.add_request(prompt_token_ids=prompts[0], params=_plain(8))
    rb = eng.add_request(prompt_token_ids=prompts[1], params=_plain(8))
    for _ in range(3):
        eng.step()
    assert eng._inflight is not None
    eng.abort_request(ra)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id != ra
            if out.finished:
                done[out.request_id] = out
    assert _results([done[rb]]) == want
    assert_no_leaks(asy)


def test_async_through_the_emulated_decode_graphs(tiny_ckpt):
    """The graph path stages a decode step's ids into the graph's static tensors; the placeholders'
    tokens are then written there on the device. (On CUDA the engines capture real graphs: the other
    tests here run through them.)"""
    from dsv4.engine.cuda_graphs import DecodeGraphs

    if torch.cuda.is_available():
        pytest.skip("CPU emulation of the decode graphs; on CUDA every engine here replays captured graphs")

    prompts = rand_prompts(46, [30, 126, 254])
    kw = dict(attention="batched", backend="torch", max_num_seqs=8)
    sync, asy = _pair(tiny_ckpt, "fp8_ds_mla", **kw)
    want = _results(sync.generate(prompts, _plain(6)))
    eng = asy.engine
    graphs = DecodeGraphs(eng.model, eng.kv_cache, 8, eng.max_model_len)
    graphs.capture()
    staged = []
    run = graphs.run
    graphs.run = lambda batch: staged.append(batch.graph_staged) or run(batch)
    eng.runner.graphs = graphs
    assert _results(asy.generate(prompts, _plain(6))) == want
    assert staged and all(staged) and eng.num_overlapped_steps > 0
    assert_no_leaks(asy)


def test_async_non_finite_logits_name_the_request(tiny_ckpt):
    """As the synchronous sampler: a non-finite row fails with the request's id in the message."""
    for mode in (False, True):
        llm = make_llm(tiny_ckpt, "auto", max_num_seqs=8, async_scheduling=mode)
        eng = llm.engine
        calls = []
        execute = eng.runner.execute

        def poisoned(batch, execute=execute, calls=calls):
            logits = execute(batch)
            calls.append(1)
            if len(calls) == 3:
                logits = logits.clone()
                logits[0, 5] = float("nan")
            return logits

        eng.runner.execute = poisoned
        with pytest.raises(FloatingPointError, match=r"request \d+: non-finite logits"):
            llm.generate(rand_prompts(47, [8]), _plain(6))
        eng.runner.execute = execute
        while eng.has_unfinished_requests():
            eng.step()
        assert_no_leaks(llm)


def test_async_refuses_data_parallel(tiny_ckpt):
    with pytest.raises(ValueError, match=r"async_scheduling is not supported with data parallelism"):
        make_llm(tiny_ckpt, "auto", async_scheduling=True, data_parallel_size=2, enable_expert_parallel=True)


def test_async_default_is_on_for_cuda_engines_without_data_parallelism():
    """None (the default) resolves to on for a CUDA engine, one process or tensor-parallel (vLLM's
    default for its multiprocessing executor), off on the CPU and with data parallelism; an explicit
    choice stands (True with data parallelism is refused)."""
    from dsv4.cli import build_parser
    from dsv4.engine.build import resolve_async_scheduling
    from dsv4.engine.engine import EngineConfig

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert EngineConfig(model="m").async_scheduling is None
    assert resolve_async_scheduling(EngineConfig(model="m"), cuda) is True
    assert resolve_async_scheduling(EngineConfig(model="m"), cpu) is False
    assert resolve_async_scheduling(EngineConfig(model="m", tensor_parallel_size=2), cuda) is True
    assert resolve_async_scheduling(EngineConfig(model="m", tensor_parallel_size=2), cpu) is False
    assert resolve_async_scheduling(EngineConfig(model="m", tensor_parallel_size=2, nnodes=2), cuda) is True
    assert resolve_async_scheduling(EngineConfig(model="m", tensor_parallel_size=2, async_scheduling=True),
                                    cpu) is True
    dp = EngineConfig(model="m", data_parallel_size=2, enable_expert_parallel=True)
    assert resolve_async_scheduling(dp, cuda) is False
    assert resolve_async_scheduling(EngineConfig(model="m", async_scheduling=False), cuda) is False
    assert resolve_async_scheduling(EngineConfig(model="m", async_scheduling=True), cpu) is True
    with pytest.raises(ValueError, match=r"not supported with data parallelism \(data_parallel_size=2"):
        resolve_async_scheduling(dp.replace(async_scheduling=True), cuda)
    parse = build_parser().parse_args
    assert parse(["generate", "--prompt", "x"]).async_scheduling is None
    assert parse(["generate", "--prompt", "x", "--async-scheduling"]).async_scheduling is True
    assert parse(["generate", "--prompt", "x", "--no-async-scheduling"]).async_scheduling is False


def test_step_control_refuses_an_async_engine(tiny_ckpt):
    """The batch-invariance harness fixes one synchronous step's batch: an async engine is refused by name."""
    from step_control import step_with

    llm = make_llm(tiny_ckpt, "auto", async_scheduling=True)
    with pytest.raises(RuntimeError, match="async_scheduling=False"):
        step_with(llm.engine, [])


def test_engine_device_follows_a_model_passed_in(tiny_ckpt_release_vocab, tiny_model_auto, monkeypatch):
    """On a machine with a GPU, an engine over a model built on the CPU runs on the CPU (where its
    weights are), with the CPU's defaults (no graphs, no async scheduling), instead of failing at
    graph capture with tensors on two devices."""
    from dsv4.engine.engine import EngineConfig, LLMEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as far as the engine can tell
    eng = LLMEngine(EngineConfig(model=str(tiny_ckpt_release_vocab), kv_cache_memory=64 << 20, max_model_len=256,
                                 max_num_seqs=4,
                                 fp8_format="ocp"),  # (auto would ask the pretend GPU for its properties)
                    model=tiny_model_auto)
    assert eng.kv_cache.device.type == "cpu" and eng.runner.graphs is None
    assert eng.config.async_scheduling is False
    eng.add_request(prompt_token_ids=[5, 6, 7], params=_plain(2))
    while eng.has_unfinished_requests():
        eng.step()
    assert_no_leaks(eng)
