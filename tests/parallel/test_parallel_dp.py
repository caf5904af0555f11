"""Data-parallel attention with expert parallelism through ``LLM`` on CPU (gloo): DP=2 + EP gives
the single process's greedy tokens, with requests spread over both ranks, a prefix-cache hit on the
rank that cached the block, a rank left idle (its dummy forwards serve the other's tokens),
preemption on both ranks, and a killed rank ending in ``EngineDeadError``. The engine runs the
GPU's paths (the batched paged attention, with its torch ops, and the decode graphs, emulated on
CPU): prefill and mixed steps eager with the sparse all-to-all, decode steps replaying one agreed
bucket on both ranks with the dense exchange, the idle rank replaying it with spare lanes.

Bitwise, not just the same tokens: every part of a DP rank's forward is the single process's on
the same tokens (batch-invariant CPU ops, the experts' outputs summed back in the reference's
order), so the sampled tokens' logprobs are compared with ``==`` too.
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


def _sampled(outs) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
            for o in outs]


def test_dp2_expert_parallel_matches_one_process_then_a_killed_rank_kills_the_engine(tiny_ckpt, tp1_reference,
                                                                                       caplog):
    caplog.set_level(logging.INFO, logger="dsv4.parallel")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)  # the 4th computes token 257
    one = LLM(str(tiny_ckpt), **ENGINE, **GPU_PATHS)
    want = _sampled(one.generate(preempting_prompts(), sp))
    del one

    llm = LLM(str(tiny_ckpt), data_parallel_size=2, enable_expert_parallel=True, distributed_timeout=60, **SMALL,
              **GPU_PATHS)
    eng = llm.engine
    pids = eng.worker_pids
    try:
        assert eng.stats.kv_capacity_tokens == 2 * 768  # KV capacity adds up over the ranks
        eng.capture_decode_graphs()
        assert eng.engine0.runner.graphs.buckets == [1, 2, 4, 8]
        got = greedy_llm(llm)  # (7, 150, 300) spread 0, 1, 0; then the prefix prompt alone on rank 0
        stats = [dict(s) for s in eng.rank_stats]
        preempted = _sampled(llm.generate(preempting_prompts(), sp))  # two per rank
        after = [dict(s) for s in eng.rank_stats]
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=rf"data-parallel rank 1 \(pid {pids[1]}\) exited with code -9"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        assert time.monotonic() - t0 < 30
        with pytest.raises(EngineDeadError):  # dead for good
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()
    assert got == tp1_reference[0]
    check_spread_over_two_ranks(stats)
    assert preempted == want  # tokens and logprobs, bitwise
    assert all(after[r]["preemptions"] - stats[r]["preemptions"] > 0 for r in range(2)), after
    report = [r.getMessage() for r in caplog.records if "started in" in r.getMessage() and "weights" in r.getMessage()]
    assert len(report) == 2 and all("KV cache 768 tokens" in line and "peak host RSS" in line for line in report)
    assert all(gone(pid) for pid in pids.values())
