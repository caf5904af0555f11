"""Batch invariance of the GPU decode path: a request's logits are bitwise identical alone and
inside any decode batch (issue 8). The target request is prefilled alone each time (so its cache
bytes are the same), the other requests are prefilled alone too, then every decode step runs
the target together with B-1 others at a varying position in the batch.
"""

import pytest
import torch
from step_control import add, decode_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 6


def _engine(ckpt, kv_cache_dtype):
    from dsv4.engine.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(ckpt), kv_cache_dtype=kv_cache_dtype, max_model_len=1024,
                                  max_num_seqs=64, max_num_batched_tokens=4096, kv_cache_memory=2 << 30,
                                  enable_prefix_caching=False,
                                  async_scheduling=False))  # step_with drives synchronous steps


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 120000, (int(torch.randint(5, 400, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "auto"])
def test_decode_logits_identical_alone_and_in_batches(tiny_ckpt, kv_cache_dtype):
    target = torch.randint(3, 120000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    eng = _engine(tiny_ckpt, kv_cache_dtype)  # one engine (graph capture is the slow part); pages differ per run
    assert eng.runner.paged_attention, "the GPU path must use the batched paged attention"
    assert eng.runner.graphs is not None, "decode steps must replay CUDA graphs"

    def run(b):
        t = add(eng, target)
        others = [add(eng, p) for p in _prompts(b - 1, b)]
        try:
            return decode_logits(eng, t, others, STEPS, target_at=b // 2)
        finally:
            for r in [t, *others]:
                eng.abort_request(r.request_id)

    alone = run(1)
    bad = []
    for b in (2, 3, 8, 17, 33, 64):
        for s, (x, y) in enumerate(zip(alone, run(b))):
            if not torch.equal(x, y):
                bad.append(f"batch {b} step {s}: max |Δ| {(x - y).abs().max().item():.3g}")
    assert not bad, "decode logits depend on the batch: " + "; ".join(bad[:8])
