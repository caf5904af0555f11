"""Tensor / expert parallelism through ``LLM`` on CPU (gloo): the same greedy tokens as TP=1.

Each engine here starts real worker processes (spawned, or a headless "node" subprocess), so the
step-plan broadcast, the sharded loads, the all-reduces, the vocab-parallel head and the replay
of prefix-cache restores on the workers are all exercised.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as torch_dist
from parallel_helpers import ENGINE, GPU_PATHS, free_port, gone, greedy_llm, prefix_prompt, prompts
from tiny_vocab import SMALL_VOCAB

from dsv4 import LLM, SamplingParams
from dsv4.engine.errors import EngineDeadError


@pytest.fixture(scope="module")
def reference(tp1_reference):
    return tp1_reference[0]


def test_tp2_matches_tp1_and_a_hung_worker_times_out(tiny_ckpt, reference, caplog):
    caplog.set_level(logging.INFO, logger="dsv4.parallel")
    llm = LLM(str(tiny_ckpt), tensor_parallel_size=2, distributed_timeout=10, **ENGINE)
    pids = llm.engine.executor.worker_pids
    try:
        got = greedy_llm(llm)
        hits = llm.engine.kv.hits
        os.kill(pids[1], signal.SIGSTOP)  # alive but silent: only the collective timeout can tell
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"distributed_timeout=10 s"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        waited = time.monotonic() - t0
        with pytest.raises(EngineDeadError):  # dead for good: no step can be matched up again
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        os.kill(pids[1], signal.SIGCONT)
        llm.shutdown()
    assert got == reference
    assert hits >= 256  # the last prompt reused a cached block: its boundary rows were restored on every rank
    assert 9 < waited < 40
    report = [r.getMessage() for r in caplog.records if "loaded its shard" in r.getMessage()]
    assert len(report) == 2 and all("peak host RSS" in line for line in report), report
    assert all(gone(pid) for pid in pids.values())


def test_tp2_expert_parallel_over_two_nodes_matches_tp1(tiny_ckpt, reference, tmp_path):
    """TP=2 + EP laid out as two one-rank "nodes": this process is node 0, node 1 is a headless
    `dsv4 serve --node-rank 1` (it takes the engine settings from node 0 at the rendezvous)."""
    port = free_port()
    log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "dsv4.cli", "serve", str(tiny_ckpt), "-tp", "2",
                              "--enable-expert-parallel", "--nnodes", "2", "--node-rank", "1",
                              "--master-port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        llm = LLM(str(tiny_ckpt), tensor_parallel_size=2, enable_expert_parallel=True, nnodes=2, node_rank=0,
                  master_port=port, distributed_timeout=120, **ENGINE)
        try:
            got = greedy_llm(llm)
        finally:
            llm.shutdown()
        assert node1.wait(60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        log.close()
    assert got == reference


def _preempting_prompts() -> list[list[int]]:
    """Two 254-token prompts: with a KV cache of 2 blocks both start, and their 3rd output token
    (position 256) needs a block neither can get: the newer one is preempted and recomputed."""
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, SMALL_VOCAB, (254,), generator=g).tolist() for _ in range(2)]


def test_tp2_async_scheduling_with_the_batched_paged_attention_matches_tp1_then_a_killed_worker_kills_it(
        tiny_ckpt, reference):
    """The GPU's paths at TP=2: one batched attention over the pages (rebuilt from the step plan on
    every worker, here with its torch ops) and async scheduling — each step launched before the
    previous one's greedy picks are read, every rank filling the placeholder tokens from the picks
    it made itself. The greedy tokens are one synchronous process's, through a prefix-cache hit and
    a preemption; then a SIGKILLed worker makes the next request fail with EngineDeadError."""
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    one = LLM(str(tiny_ckpt), **ENGINE)
    want = [o.outputs[0].token_ids for o in one.generate(_preempting_prompts(), sp)]
    del one
    # 2 blocks of KV cache (greedy_llm's batch admits as the blocks allow; _preempting_prompts preempts)
    small = {**ENGINE, "max_model_len": 512, "kv_cache_memory": 46 << 20}
    llm = LLM(str(tiny_ckpt), tensor_parallel_size=2, attention="batched", backend="torch", async_scheduling=True,
              distributed_timeout=60, **small)
    eng = llm.engine
    pids = eng.executor.worker_pids
    try:
        assert eng.runner.paged_attention and eng.config.async_scheduling
        assert eng.kv_cache.budget.capacity_tokens == 512
        got = greedy_llm(llm)
        hits = eng.kv.hits
        preempted = [o.outputs[0].token_ids for o in llm.generate(_preempting_prompts(), sp)]
        overlapped = eng.num_overlapped_steps
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=rf"tensor-parallel worker rank 1 \(pid {pids[1]}\) exited with "
                                                  r"code -9"):
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
        assert time.monotonic() - t0 < 30
        with pytest.raises(EngineDeadError):  # dead for good
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    finally:
        llm.shutdown()
    assert got == reference
    assert hits >= 256  # the prefix prompt reused a cached block: its boundary rows were restored on the worker
    assert preempted == want
    assert eng.scheduler.num_preemptions > 0
    assert overlapped > 5  # the decode steps were launched before the previous step was read
    assert all(gone(pid) for pid in pids.values())


def test_tp2_decode_graph_replay_matches_tp1(tiny_ckpt, reference):
    """The decode CUDA-graph path at TP=2, emulated on CPU: every rank captures its graphs at
    once, each replay on rank 0 is announced to the worker, which loads the same static inputs
    (spare lanes padded to the bucket) and replays its own; the greedy tokens are TP=1's. With async
    scheduling (the CUDA default): each replay's placeholder tokens are filled into the graphs'
    static inputs from the picks every rank kept of the step before."""
    llm = LLM(str(tiny_ckpt), tensor_parallel_size=2, attention="batched", backend="torch", async_scheduling=True,
              **ENGINE)
    try:
        llm.engine.capture_decode_graphs()
        graphs = llm.engine.runner.graphs
        assert graphs.buckets == [1, 2, 4, 8]
        used = []
        run = graphs.run
        graphs.run = lambda batch: used.append(graphs.bucket(len(batch.step.chunks))) or run(batch)
        got = greedy_llm(llm)
    finally:
        llm.shutdown()
    assert 4 in used, f"no padded decode step replayed the graphs (buckets used: {used})"
    assert got == reference
    assert llm.engine.num_overlapped_steps > 5
    # shutdown resets the graphs before the group goes (NCCL: a live graph hangs its teardown)
    assert llm.engine.runner.graphs is None and graphs.graphs.graphs == {} and graphs.buckets == []


def test_tp2_engine_dropped_without_shutdown_releases_its_graphs_then_stops_the_workers(tiny_ckpt):
    """`dsv4 probe`, `generate` and scripts never call shutdown(): the engine's finalizer (run when it
    is collected, or at interpreter exit before the driver's own) must still reset the captured
    graphs before the group goes — on the H200 the probe at TP=2 aborted at exit (code -6)."""
    import gc

    llm = LLM(str(tiny_ckpt), tensor_parallel_size=2, attention="batched", backend="torch", **ENGINE)
    llm.engine.capture_decode_graphs()
    graphs, pids = llm.engine.runner.graphs, llm.engine.executor.worker_pids
    assert graphs.buckets
    greedy_llm(llm)
    order = []
    release, destroy = graphs.release, torch_dist.destroy_process_group
    graphs.release = lambda: order.append("release") or release()
    torch_dist.destroy_process_group = lambda *a, **k: order.append("destroy") or destroy(*a, **k)
    try:
        del llm
        gc.collect()
    finally:
        torch_dist.destroy_process_group = destroy
    assert order == ["release", "destroy"], order
    assert graphs.buckets == [] and not torch_dist.is_initialized()
    assert all(gone(pid) for pid in pids.values())


def test_tp2_speculative_mtp_matches_tp1(tiny_ckpt, reference):
    """MTP speculative decoding at TP=2 with the batched paged attention: the verify forward and every
    MTP pass run on both ranks (a pass's input streams broadcast from rank 0), the workers commit
    every verify row to their state rings. Drafts are replaced after each step by TP=1's tokens with
    one wrong at a rotating position, so steps accept none, some and all of them: TP=1's tokens."""
    from dsv4.engine.request import Drafts

    k = 2
    truth = {tuple(p): ids for p, ids in zip(prompts() + [prefix_prompt()], reference)}
    llm = LLM(str(tiny_ckpt), tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": k},
              **ENGINE, **GPU_PATHS)
    eng = llm.engine
    finish, calls = eng._finish_step, {}

    def scripted(schedule, touched):
        for sc in schedule:
            r = sc.req
            if r.finished or not r.drafts:
                continue
            n = calls[r.request_id] = calls.get(r.request_id, -1) + 1
            toks = list(truth[tuple(r.prompt_token_ids)][len(r.output_token_ids):][:len(r.drafts)])
            wrong = (n + 1) % (k + 1)  # the second, then none (the outputs are short), then the first
            if wrong < len(toks):
                toks[wrong] = (toks[wrong] + 1) % eng.model_config.vocab_size
            r.drafts = Drafts(toks, None)
        return finish(schedule, touched)

    eng._finish_step = scripted
    try:
        got = greedy_llm(llm)
    finally:
        llm.shutdown()
    assert got == reference
    st = eng.spec_stats
    assert st.accepted_per_position[k - 1] > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
