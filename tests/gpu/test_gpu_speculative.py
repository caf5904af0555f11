"""MTP speculative decoding on the GPU fast path (Triton kernels, bf16) against the same engine
without speculation: greedy tokens must agree wherever the non-speculative run's top-2 logprob
margin exceeds the tolerance (the verify chunk and a one-token decode step take different kernels,
so their bf16 sums differ in the last bits; see tests/gpu/test_gpu_engine_vs_torch.py for TOL).
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = (5, 63, 64, 129, 255, 300)
NEW = 24
TOL = 0.05  # nats, as in test_gpu_engine_vs_torch


def _run(ckpt, **kw):
    from dsv4.engine.sampling_params import SamplingParams
    from dsv4.llm import LLM

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 120000, (n,), generator=g).tolist() for n in LENGTHS]
    llm = LLM(str(ckpt), kv_cache_dtype="fp8_ds_mla", max_model_len=1024, kv_cache_memory=1 << 30,
              max_num_seqs=16, max_num_batched_tokens=512, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2))
    return llm, [o.outputs[0] for o in outs]


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_matches_plain_decoding_on_the_gpu(tiny_ckpt, k):
    spec_llm, spec = _run(tiny_ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    assert spec_llm.engine.runner.paged_attention, "fast path must be batched"
    stats = spec_llm.engine.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_draft_tokens <= k * stats.num_drafts
    _, ref = _run(tiny_ckpt)
    checked = 0
    for n, s, r in zip(LENGTHS, spec, ref):
        for i, (a, b) in enumerate(zip(s.token_ids, r.token_ids)):
            top = sorted(r.logprobs[i].values(), key=lambda lp: -lp.logprob)
            margin = top[0].logprob - top[1].logprob
            if a != b:
                assert margin <= TOL, (f"prompt of {n} tokens, step {i}: speculative run picked {a}, plain "
                                       f"decoding {b} with a top-2 margin of {margin:.3f} > {TOL}")
                break
            checked += 1
    print(f"k={k}: greedy tokens compared {checked} of {len(LENGTHS) * NEW}; "
          f"acceptance length {stats.acceptance_length:.2f}")
    assert checked >= len(LENGTHS) * NEW // 2
