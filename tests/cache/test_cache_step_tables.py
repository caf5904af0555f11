"""A step's closing tables (``PagedStep.closing``) against a brute-force walk over every token."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from dsv4.model.step import PagedStep, SeqChunk


def _brute(chunks, r):
    rows = []
    for i, c in enumerate(chunks):
        for p in range(c.start, c.start + c.length):
            if (p + 1) % r == 0:
                rows.append((c.offset + p - c.start, c.start, c.offset, i))
    return rows


def test_closing_lists_exactly_the_tokens_that_close_a_block():
    rng = random.Random(3)
    for _ in range(200):
        chunks, off = [], 0
        for _ in range(rng.randint(1, 6)):
            n = rng.choice([1, 1, 2, rng.randint(1, 40), rng.randint(100, 700)])
            chunks.append(SeqChunk(None, rng.randint(0, 600), n, off))
            off += n
        tables = SimpleNamespace(chunks=chunks, _emitting={}, kvc=SimpleNamespace(device=torch.device("cpu")),
                                 static_closing=None)
        for r in (4, 128):
            want = _brute(chunks, r)
            got = PagedStep.closing(tables, r)
            if not want:
                assert got is None
                continue
            assert got.dtype == torch.long and got.shape == (4, len(want))
            assert [tuple(col) for col in got.t().tolist()] == want
