"""Tensor parallelism inside data-parallel ranks (``-tp 2 -dp 2 --enable-expert-parallel``) through
``LLM`` on CPU (gloo): four processes, each data-parallel rank a tensor-parallel group of two, the
16 routed experts split over all four. The greedy tokens are the single process's with requests
spread over both ranks, a prefix-cache hit on the rank that cached the block, a rank left idle
(its group's dummy forwards serve the other's tokens), preemption on both ranks. The GPU's paths
run: the batched paged attention's torch ops, and the decode graphs (emulated on CPU: both groups
replay one agreed bucket with the dense exchange, each rank sending its padded share; the idle
group replays it with spare lanes). A killed tensor-parallel process ends in ``EngineDeadError``
naming it. Tokens only: tensor parallelism sums partial results in another order, so the logits
differ from one process's in the last bits (docs/distributed.md).
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
from parallel_helpers import ENGINE, GPU_PATHS, SMALL, check_spread_over_two_ranks, gone, greedy_llm, preempting_prompts

from dsv4 import LLM, SamplingParams
from dsv4.engine.errors import EngineDeadError


def test_tp2_inside_dp2_matches_one_process_then_a_killed_tp_rank_kills_the_engine(tiny_ckpt, tp1_reference, caplog):
    caplog.set_level(logging.INFO, logger="dsv4.parallel")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    one = LLM(str(tiny_ckpt), **ENGINE, **GPU_PATHS)
    want = [o.outputs[0].token_ids for o in one.generate(preempting_prompts(), sp)]
    del one

    llm = LLM(str(tiny_ckpt), data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout=60, **SMALL, **GPU_PATHS)
    eng = llm.engine
    pids = eng.worker_pids
    try:
        assert sorted(pids) == [1, 2, 3]
        assert eng.stats.kv_capacity_tokens == 2 * 768  # two ranks' caches (each mirrored in its group)
        assert [s["experts"] for s in eng.startup_reports] == [[0, 4], [4, 8], [8, 12], [12, 16]]
        eng.capture_decode_graphs()  # (emulated on CPU: every process runs the graphs' static inputs eagerly)
        assert eng.engine0.runner.graphs.buckets == [1, 2, 4, 8]
        got = greedy_llm(llm)  # (7, 150, 300) spread 0, 1, 0; then the prefix prompt alone on rank 0
        stats = [dict(s) for s in eng.rank_stats]
        preempted = [o.outputs[0].token_ids for o in llm.generate(preempting_prompts(), sp)]  # two per rank
        after = [dict(s) for s in eng.rank_stats]
        os.kill(pids[3], signal.SIGKILL)  # data-parallel rank 1's second tensor-parallel process
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=rf"data-parallel process 3 \(pid {pids[3]}\) exited with code -9"):
            llm.generate([[5, 6, 7], [8, 9, 10]], SamplingParams(max_tokens=2))
        assert time.monotonic() - t0 < 30
        with pytest.raises(EngineDeadError):  # dead for good
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()
    assert got == tp1_reference[0]
    check_spread_over_two_ranks(stats)  # (each rank's graphs replayed on both processes of its group)
    assert preempted == want
    assert all(after[r]["preemptions"] - stats[r]["preemptions"] > 0 for r in range(2)), after
    report = [r.getMessage() for r in caplog.records if "started in" in r.getMessage() and "weights" in r.getMessage()]
    assert len(report) == 4, report
    assert sum("KV cache 768 tokens" in line for line in report) == 2
    assert sum("mirrors its leader's" in line for line in report) == 2
    assert all(gone(pid) for pid in pids.values())
