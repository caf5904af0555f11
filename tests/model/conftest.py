"""Shared fixtures of the reference-model numerics tests (the checkpoints come from tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

N_PROMPT = 640  # 160 CSA windows (ratio 4) and 5 HCA windows (ratio 128); window 128


def random_prompt(n: int = N_PROMPT, seed: int = 0, vocab: int = 129280) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g)


@pytest.fixture(scope="session")
def full_forward_640(tiny_model_auto, tiny_model_fp8):
    """get(kv_cache_dtype) → ForwardOutput (logits [640, V] of every row, streams [640, 4, H]) of one
    whole-prompt forward of ``random_prompt()`` on ``tiny``; computed once per cache dtype and
    shared by the self-consistency and FP8 tests."""
    from dsv4.model.step import SeqChunk

    models = {"auto": tiny_model_auto, "fp8_ds_mla": tiny_model_fp8}
    done = {}

    def get(kv_cache_dtype: str):
        if kv_cache_dtype not in done:
            model = models[kv_cache_dtype]
            with torch.no_grad():
                done[kv_cache_dtype] = model.forward(random_prompt(), [SeqChunk(model.new_cache(), 0, N_PROMPT)])
        return done[kv_cache_dtype]

    return get
