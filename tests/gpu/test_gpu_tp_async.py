"""Async scheduling under tensor parallelism on two GPUs (NCCL, decode CUDA graphs): on by default,
and the same greedy tokens as the same layout without it — the same kernels on the same logits,
every rank filling the placeholder tokens from the greedy picks it kept on its own device."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

ENGINE = dict(dtype="float32", kv_cache_dtype="auto", max_model_len=1024, max_num_seqs=8,
              kv_cache_memory=256 << 20, tensor_parallel_size=2, distributed_timeout=120)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (7, 150, 300, 40)]


def _greedy(ckpt, **kw):
    from dsv4 import LLM, SamplingParams

    llm = LLM(str(ckpt), **ENGINE, **kw)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        eng = llm.engine
        return [o.outputs[0].token_ids for o in outs], eng.config.async_scheduling, eng.num_overlapped_steps, \
            eng.runner.graphs is not None
    finally:
        llm.shutdown()


def test_tp2_async_scheduling_is_the_default_and_matches_sync(tiny_ckpt):
    got, on, overlapped, graphs = _greedy(tiny_ckpt)
    assert on and graphs  # the CUDA defaults: async scheduling and decode graphs, also at TP=2
    assert overlapped > 10
    want, off, _, _ = _greedy(tiny_ckpt, async_scheduling=False)
    assert not off
    assert got == want
