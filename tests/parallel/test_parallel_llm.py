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
from parallel_helpers import ENGINE, free_port, gone, greedy_llm

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


def test_tp2_with_the_batched_paged_attention_matches_tp1(tiny_ckpt, reference):
    """The GPU's attention path (one batched attention over the pages, rebuilt from the step plan on
    every worker), here with its torch ops: TP=2 gives the TP=1 greedy tokens."""
    llm = LLM(str(tiny_ckpt), tensor_parallel_size=2, attention="batched", backend="torch", **ENGINE)
    try:
        assert llm.engine.runner.paged_attention
        got = greedy_llm(llm)
    finally:
        llm.shutdown()
    assert got == reference


def test_tp2_decode_graph_replay_matches_tp1(tiny_ckpt, reference):
    """The decode CUDA-graph path at TP=2, emulated on CPU: every rank captures its graphs at
    once, each replay on rank 0 is announced to the worker, which loads the same static inputs
    (spare lanes padded to the bucket) and replays its own; the greedy tokens are TP=1's."""
    llm = LLM(str(tiny_ckpt), tensor_parallel_size=2, attention="batched", backend="torch", **ENGINE)
    try:
        llm.engine.capture_decode_graphs()
        graphs = llm.engine.runner.graphs
        assert graphs.buckets == [1, 2, 4, 8]
        used = []
        run = graphs.run
        graphs.run = lambda batch: used.append(graphs.bucket(len(batch.chunks))) or run(batch)
        got = greedy_llm(llm)
    finally:
        llm.shutdown()
    assert 4 in used, f"no padded decode step replayed the graphs (buckets used: {used})"
    assert got == reference
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
