"""Shared fixtures of the reference-model numerics tests (the checkpoints come from tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

N_PROMPT = 640  # 160 CSA windows (ratio 4) and 5 HCA windows (ratio 128); window 128


def random_prompt(n: int = N_PROMPT, seed: int = 0, vocab: int = 129280) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g)


@pytest.fixture(scope="session")
def full_logits_640(tiny_model_auto, tiny_model_fp8):
    """get(kv_cache_dtype) → logits [640, V] of one whole-prompt forward of ``random_prompt()``
    on ``tiny`` (computed once per cache dtype, shared by the self-consistency and FP8 tests)."""
    models = {"auto": tiny_model_auto, "fp8_ds_mla": tiny_model_fp8}
    done: dict[str, torch.Tensor] = {}

    def get(kv_cache_dtype: str) -> torch.Tensor:
        if kv_cache_dtype not in done:
            done[kv_cache_dtype] = models[kv_cache_dtype].prefill(random_prompt())[0]
        return done[kv_cache_dtype]

    return get
