"""The step-level commit of held compressor state (``PagedSequenceView.advance_many``) leaves exactly
the caches that advancing each request's view on its own leaves: ring rows, boundary snapshots, counts."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.paged import CacheAllocation, CacheBudget, PagedKVCache, PagedSequenceView, unit_bytes
from dsv4.config import load_config
from dsv4.model.cache import CacheNumerics, advance_all
from dsv4.model.step import BLOCK


def _cache(cfg) -> PagedKVCache:
    numerics = CacheNumerics("fp8_ds_mla")
    blk, swa, slot = unit_bytes(cfg, numerics, torch.float32, 3)
    return PagedKVCache(cfg, numerics, CacheBudget(8, 24, 4, blk, swa, slot, 3), torch.float32)


def _views(kvc, seed: int):
    """Four requests with held state rows for every compressor: chunks shorter and longer than the
    rings, one crossing a 256-token block (a boundary snapshot), one kept short (a verify chunk)."""
    g = torch.Generator().manual_seed(seed)
    views, counts = [], []
    for slot, (start, length, keep) in enumerate([(0, 300, 300), (5, 3, 3), (250, 40, 17), (77, 1, 1)]):
        alloc = CacheAllocation(blocks=[2 * slot, 2 * slot + 1], slot=slot, num_computed=start)
        v = PagedSequenceView(kvc, alloc)
        for key, ring in kvc.ring.items():
            v.hold_state(key[0], key[1], start, torch.randn(length, ring.shape[2], generator=g))
        views.append(v)
        counts.append(keep)
    return views, counts


@pytest.fixture(scope="module")
def cfg(tiny_ckpt):
    return load_config(tiny_ckpt)


def _expected_rings(kvc, views, counts) -> dict:
    """The rings after the step, written row by row: a view's kept rows, the newest ``size`` of them,
    each at ``ring[slot, position % size]``."""
    rings = {key: ring.clone() for key, ring in kvc.ring.items()}
    for v, n in zip(views, counts):
        for key, (start, rows) in v._chunk.items():
            size = rings[key].shape[1]
            for p in range(max(start, start + n - size), start + n):
                rings[key][v.alloc.slot, p % size] = rows[p - start]
    return rings


def test_advance_many_commits_every_view_as_advancing_each_alone(cfg):
    one, many = _cache(cfg), _cache(cfg)
    for kvc in (one, many):
        for t in list(kvc.ring.values()) + list(kvc.boundary.values()):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(3)))
    views_one, counts = _views(one, 7)
    views_many, _ = _views(many, 7)
    assert any(v.alloc.num_computed // BLOCK != (v.alloc.num_computed + n) // BLOCK for v, n in zip(views_one, counts))
    expected = _expected_rings(many, views_many, counts)
    for v, n in zip(views_one, counts):
        v.advance(n)
    advance_all(zip(views_many, counts))
    for key in one.ring:
        assert torch.equal(many.ring[key], expected[key]), key
        assert torch.equal(one.ring[key], expected[key]), key
    for key in one.boundary:
        assert torch.equal(one.boundary[key], many.boundary[key]), key
    assert [v.alloc.num_computed for v in views_one] == [v.alloc.num_computed for v in views_many] == \
        [s + n for s, n in zip((0, 5, 250, 77), counts)]
    assert all(not v._chunk for v in views_many)
