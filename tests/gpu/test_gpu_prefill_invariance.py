"""A prompt's logits on the GPU path do not depend on what else its prefill step computes.

The TP=2 probe on the H200 found first tokens that changed between batch 1 and batch 8: a
10-token prompt prefilled alone ran the FP8 linears at decode size (split-K partials summed in
order) and among other prompts at prefill size (one K run), different sums. The tiny checkpoint's
K is too short to show it, so this writes a 2-layer flash-width one (real widths: CSA + HCA layers,
hash routing, 256 MXFP4 experts). The target prompt is prefilled alone, first and last in a step
with seven other prompts, and in two chunks; its sampled logits must be bitwise the same.
"""

import pytest
import torch
from step_control import add, step_with

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TARGETS = (10, 70, 300)  # below, just above and well above the 64-row decode tiles


def _prompts(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 120000, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_prefill_logits_identical_alone_in_a_batch_and_chunked(flash_width_ckpt):
    from dsv4.engine.engine import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig(model=str(flash_width_ckpt), kv_cache_dtype="fp8_ds_mla", max_model_len=2048,
                                 max_num_seqs=16, max_num_batched_tokens=8192, kv_cache_memory=4 << 30,
                                 enable_prefix_caching=False, enforce_eager=True,
                                 async_scheduling=False))  # step_with drives synchronous steps
    assert eng.runner.paged_attention, "the GPU path must use the batched paged attention"
    others = _prompts(7, 5, 700, seed=11)

    def run(target, layout):
        t = add(eng, target, max_tokens=2)
        rest = [add(eng, p, max_tokens=2) for p in others] if layout in ("first", "last") else []
        reqs = [t, *rest] if layout != "last" else [*rest, t]
        try:
            if layout == "chunked":  # 7 tokens, then the rest (attention over the cached chunk)
                step_with(eng, [t], tokens=[7])
            return step_with(eng, reqs)[id(t)]
        finally:
            for r in reqs:
                eng.abort_request(r.request_id)

    bad = []
    for n in TARGETS:
        target = _prompts(1, n, n + 1, seed=n)[0]
        alone = run(target, "alone")
        for layout in ("first", "last", "chunked"):
            got = run(target, layout)
            if not torch.equal(got, alone):
                bad.append(f"{n}-token prompt, {layout}: max |Δ logit| {(got - alone).abs().max().item():.3g}")
    assert not bad, "prefill logits depend on the step: " + "; ".join(bad)
