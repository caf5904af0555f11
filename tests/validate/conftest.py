"""Fixtures for tests/validate: one tiny reference model shared by every engine, probe and diff here.

Engines are built over the shared model (``LLMEngine(..., model=model)``) so each test pays for
its own KV cache, not for a weight load. Planted faults are monkeypatched module or class
attributes, so sharing the model object never carries a fault from one test to the next.
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _validate_test_threads():
    """One torch thread (``DSV4_ENGINE_TEST_THREADS`` overrides), as in tests/engine: on a busy 2-core
    machine two OpenMP threads made every engine step several times slower (measured here: 4x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("DSV4_ENGINE_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def validate_model(tiny_ckpt):
    """The tiny checkpoint's reference model: float32 compute, fp8_ds_mla cache numerics, OCP."""
    from dsv4.model.cache import CacheNumerics
    from dsv4.model.model import ReferenceModel

    return ReferenceModel(tiny_ckpt, dtype=torch.float32, numerics=CacheNumerics("fp8_ds_mla"))
