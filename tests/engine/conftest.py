"""Fixtures for the serving-engine tests.

The checkpoint ``tiny_ckpt`` is, here, ``tests/conftest.py``'s ``tiny_ckpt_small_vocab`` (the tests send
token ids; those of text and grammars take ``tiny_ckpt_release_vocab``). The oracle is
``ReferenceModel.greedy`` on a fresh dense cache; its results are memoized for the session (keyed by
vocabulary, cache dtype, prompt and length) because several tests compare against the same prompts.
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import BOUNDARY_LENGTHS, rand_prompts


@pytest.fixture(scope="module", autouse=True)
def _engine_test_threads():
    """Run the engine tests on ``DSV4_ENGINE_TEST_THREADS`` torch threads (default 1), restored afterwards.

    The engine's CPU steps are many small ops; on a 2-core machine shared with other work,
    OpenMP's spin-waiting made steps 10-20x slower with 2 threads than with 1 (measured here).
    Every comparison is within one process, so the thread count cannot make a test pass or fail
    by itself; set DSV4_ENGINE_TEST_THREADS=2 to run them multi-threaded.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("DSV4_ENGINE_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_ckpt_small_vocab):
    """The engine's tests send token ids: the tiny checkpoint of the small vocabulary (``tiny_vocab``)."""
    return tiny_ckpt_small_vocab


@pytest.fixture(scope="session")
def reference_greedy():
    """``reference_greedy(model, prompt, n)`` → (tokens, step logits [n, V]) from the reference model."""
    memo: dict = {}

    def run(model, prompt: list[int], n: int):
        key = (model.cfg.vocab_size, model.numerics.kv_cache_dtype, str(model.dtype), tuple(prompt), n)
        if key not in memo:
            memo[key] = model.greedy(list(prompt), n)  # fresh DenseSequenceCache each call
        return memo[key]

    return run


@pytest.fixture(scope="session")
def boundary_prompts():
    """Eight prompts whose lengths cross every paging/compression boundary of the tiny model."""
    return rand_prompts(1234, BOUNDARY_LENGTHS)
