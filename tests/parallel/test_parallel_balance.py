"""Which data-parallel rank takes a request (``dsv4.parallel.balance``): the least loaded; among those,
the one that was sent the longest run of the prompt's leading 256-token blocks; else the lowest."""

from __future__ import annotations

from dsv4.parallel.balance import RankBalancer


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 50000 + 2 for i in range(n)]


def test_least_loaded_first_then_prefix_affinity_then_the_lowest_rank():
    b = RankBalancer(3)
    a, c = _prompt(1, 600), _prompt(2, 300)
    for want, p in ((0, a), (1, c), (2, _prompt(3, 5))):  # all equally loaded: the lowest rank, in turn
        assert b.pick(p) == want
        b.added(want, p)
    assert b.pick(_prompt(4, 5)) == 0
    b.removed(1)
    assert b.pick(a[:512] + [9, 9]) == 1  # rank 1 is the least loaded: load wins over affinity
    b.removed(0)
    b.removed(2)  # all idle now
    assert b.pick(a[:512] + [9, 9]) == 0  # two blocks of `a` were sent to rank 0
    assert b.pick(c[:256] + a[:256]) == 1  # one leading block matches rank 1's prompt
    assert b.pick(a[256:] + c) == 0  # no leading block matches anywhere: the lowest rank
    assert b.pick(a[:200]) == 0  # shorter than a block: no affinity


def test_a_rank_remembers_only_its_most_recent_blocks():
    b = RankBalancer(2, memory=2)
    old, new = _prompt(1, 512), _prompt(2, 512)
    b.added(1, old)
    b.added(1, new)  # rank 1 now remembers only `new`'s two blocks
    b.removed(1)
    b.removed(1)
    assert b.pick(new + [5]) == 1
    assert b.pick(old + [5]) == 0
