"""MTP and DSpark speculative decoding on the GPU fast path (Triton kernels, bf16) against the same engine
without speculation: greedy tokens must agree wherever the non-speculative run's top-2 logprob
margin exceeds the tolerance (``gpu_greedy.TOL``: the verify chunk and a one-token decode step take
different kernels, so their bf16 sums differ in the last bits).
"""

import pytest
import torch
from gpu_greedy import assert_greedy_agrees, greedy_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = (5, 63, 64, 129, 255, 300)
NEW = 24


@pytest.fixture(scope="module")
def plain_mtp(tiny_ckpt):
    return greedy_run(tiny_ckpt, LENGTHS, NEW, seed=7)[1]


@pytest.mark.parametrize("k,graphs", [(1, True), (2, True), (3, True), (4, True), (3, False)])
def test_mtp_greedy_matches_plain_decoding_on_the_gpu(tiny_ckpt, plain_mtp, k, graphs):
    """Plain greedy requests run their speculative steps as CUDA graphs (``engine.spec_graphs``);
    requests asking for logprobs take the eager path (their rows go to the host)."""
    spec_llm, spec = greedy_run(tiny_ckpt, LENGTHS, NEW, seed=7, logprobs=None if graphs else 2,
                                speculative_config={"method": "mtp", "num_speculative_tokens": k})
    eng = spec_llm.engine
    assert eng.runner.paged_attention, "fast path must be batched"
    assert (eng.spec_graphs.replays > 0) == graphs
    stats = eng.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_draft_tokens <= k * stats.num_drafts
    checked = assert_greedy_agrees(spec, plain_mtp, LENGTHS, "the speculative run (plain decoding: the second)")
    print(f"k={k} graphs={graphs}: greedy tokens compared {checked} of {len(LENGTHS) * NEW}; "
          f"acceptance length {stats.acceptance_length:.2f}; graph steps {eng.spec_graphs.replays}")
    assert checked >= len(LENGTHS) * NEW // 2


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_sampled_graph_steps_at_top_k_1_agree_with_greedy_on_the_gpu(tiny_ckpt, tiny_dspark_ckpt, plain_mtp, method):
    """Sampling at top-k 1 (one-hot distributions) through the sampled CUDA graphs: the rejection rule,
    the device draws and the kept draft distributions give greedy's tokens."""
    ckpt = tiny_ckpt if method == "mtp" else tiny_dspark_ckpt
    spec_llm, spec = greedy_run(ckpt, LENGTHS, NEW, seed=7, logprobs=None,
                                params={"temperature": 0.7, "top_k": 1, "seed": 3},
                                speculative_config={"method": method, "num_speculative_tokens": 3})
    eng = spec_llm.engine
    assert eng.spec_graphs.replays > 0 and eng.spec_stats.num_drafts > 0
    ref = plain_mtp if method == "mtp" else greedy_run(ckpt, LENGTHS, NEW, seed=7)[1]
    checked = assert_greedy_agrees(spec, ref, LENGTHS, f"the sampled {method} run (greedy: the second)")
    print(f"sampled top-k 1 {method}: greedy tokens compared {checked} of {len(LENGTHS) * NEW}; "
          f"graph steps {eng.spec_graphs.replays}")
    assert checked >= len(LENGTHS) * NEW // 2


@pytest.mark.parametrize("k,graphs", [(1, True), (2, True), (3, True), (4, True), (5, True), (3, False)])
def test_dspark_greedy_matches_plain_decoding_on_the_gpu(tiny_dspark_ckpt, k, graphs):
    """The tiny DSpark checkpoint (8-token vocabulary): its own drafts, blocks of k = 1..4 and of
    k = dspark_block_size, as CUDA graph steps; requests asking for logprobs take the eager path."""
    spec_llm, spec = greedy_run(tiny_dspark_ckpt, LENGTHS, NEW, seed=7, logprobs=None if graphs else 2,
                                speculative_config={"method": "dspark", "num_speculative_tokens": k})
    eng = spec_llm.engine
    assert eng.runner.paged_attention, "fast path must be batched"
    assert (eng.spec_graphs.replays > 0) == graphs
    stats = eng.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_draft_tokens <= k * stats.num_drafts
    assert stats.num_confident_drafts == stats.num_drafts
    _, ref = greedy_run(tiny_dspark_ckpt, LENGTHS, NEW, seed=7)
    checked = assert_greedy_agrees(spec, ref, LENGTHS, "the DSpark run (plain decoding: the second)")
    print(f"dspark k={k} graphs={graphs}: greedy tokens compared {checked} of {len(LENGTHS) * NEW}; "
          f"acceptance length {stats.acceptance_length:.2f}; graph steps {eng.spec_graphs.replays}; "
          f"confidence cuts {stats.confidence_cuts()[::5]}")
    assert checked >= len(LENGTHS) * NEW // 2
