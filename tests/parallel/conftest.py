"""tests/parallel: the TP=1 reference every parallel run is compared with (once per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_ckpt_small_vocab):
    """The parallel tests send token ids: the tiny checkpoint of the small vocabulary (``tiny_vocab``)."""
    return tiny_ckpt_small_vocab


@pytest.fixture(scope="session")
def tp1_reference(tiny_ckpt):
    """(greedy token ids per prompt, their per-token texts) of the single-process engine."""
    from parallel_helpers import ENGINE, greedy_llm

    from dsv4 import LLM

    llm = LLM(str(tiny_ckpt), **ENGINE)
    assert llm.engine.executor.one_process  # TP=1: no process group, no workers
    ids = greedy_llm(llm)
    tok = llm.get_tokenizer()
    return ids, [[tok.decode([t]) for t in seq] for seq in ids]
