"""The step plan carries what a worker needs to rebuild each request's allocation exactly."""

import pickle
from types import SimpleNamespace

import torch

from dsv4.cache.paged import CacheAllocation
from dsv4.model.attention import SeqChunk
from dsv4.parallel.plan import plan_step


def test_plan_sends_only_the_unreleased_window_pages_and_rebuilds_the_allocation():
    released = 1000  # a 64K-token context: its first 1000 window pages are released
    a = CacheAllocation(blocks=list(range(257)), swa=[-1] * released + [5, 6, 7], slot=3, num_computed=65600,
                        swa_released=released)
    fresh = CacheAllocation(blocks=[9], swa=[1, 2], slot=0, num_computed=100)
    chunks = [SeqChunk(SimpleNamespace(alloc=x), x.num_computed, 1) for x in (a, fresh)]
    plan = plan_step(torch.tensor([1, 2]), chunks, None, [], paged=True)
    assert plan.chunks[0].swa == [5, 6, 7] and plan.chunks[0].swa_released == released
    assert len(pickle.dumps(plan)) < 4000  # the 1000 released pages are not in the message
    for c, x in zip(pickle.loads(pickle.dumps(plan)).chunks, (a, fresh)):
        b = c.allocation()
        assert (b.blocks, b.swa, b.slot, b.num_computed, b.swa_released) == \
               (x.blocks, x.swa, x.slot, x.num_computed, x.swa_released)
