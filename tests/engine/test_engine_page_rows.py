"""The host copies of a request's page lists (``PageRow``) stay equal to the lists through every
way the cache manager changes them: growth, window release below a watermark, replacement."""

import array
import random

import torch

from dsv4.cache.paged import CacheAllocation, PageRow
from dsv4.engine.paged_attention import _table


def test_page_row_follows_appends_releases_and_replacements():
    rng = random.Random(0)
    alloc, row = CacheAllocation(), PageRow()
    next_page = 0
    for step in range(400):
        op = rng.random()
        if op < 0.6:  # allocate: append pages
            for _ in range(rng.randint(0, 3)):
                alloc.swa.append(next_page)
                next_page += 1
        elif op < 0.9:  # release_out_of_window: -1 below a rising watermark
            end = rng.randint(alloc.swa_released, len(alloc.swa))
            for i in range(alloc.swa_released, end):
                alloc.swa[i] = -1
            alloc.swa_released = end
        elif op < 0.95:  # a prefix hit: a new list with leading -1s
            alloc.swa = [-1] * rng.randint(0, 5) + [next_page, next_page + 1]
            alloc.swa_released = 0
            next_page += 2
        else:  # free (preemption): empty lists, watermark reset
            alloc.swa, alloc.swa_released = [], 0
        got = row.sync(alloc.swa, alloc.swa_released)
        assert got.tolist() == alloc.swa, f"step {step}"


def test_tables_pad_with_minus_one():
    rows = [array.array("q", [3, 4, 5]), array.array("q"), array.array("q", [7])]
    assert _table(rows, torch.device("cpu")).tolist() == [[3, 4, 5], [-1, -1, -1], [7, -1, -1]]
    assert _table([array.array("q")], torch.device("cpu")).tolist() == [[-1]]
    assert _table([], torch.device("cpu")).shape == (0, 1)
