"""A reference-counted pool of page ids with an LRU of evictable (cached, unreferenced) pages."""

from __future__ import annotations

from collections import OrderedDict


class PagePool:
    """Ids 0..n-1. A page is free, held (ref > 0), or cached (ref 0 but kept for prefix reuse)."""

    def __init__(self, n: int, name: str):
        self.n, self.name = n, name
        self.ref = [0] * n
        self.free: list[int] = list(range(n - 1, -1, -1))  # pop() gives the lowest id first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.n - len(self.free)

    def take(self, evict) -> int:
        """A fresh page (ref 1); evicts the least recently used cached page if none is free."""
        if not self.free:
            if not self.evictable:
                raise RuntimeError(f"{self.name} pool exhausted ({self.n} pages)")
            pid, _ = self.evictable.popitem(last=False)
            evict(pid)  # the owner forgets the page's cached content; it returns via release()
            if self.ref[pid] != 0:
                raise RuntimeError(f"{self.name} page {pid} evicted while referenced")
        else:
            pid = self.free.pop()
        self.ref[pid] = 1
        return pid

    def incref(self, pid: int) -> None:
        if self.ref[pid] == 0:
            self.evictable.pop(pid, None)
        self.ref[pid] += 1

    def decref(self, pid: int, keep: bool) -> None:
        """Drop one reference; at zero the page is cached (``keep``) or freed."""
        if self.ref[pid] <= 0:
            raise RuntimeError(f"{self.name} page {pid} released more often than taken")
        self.ref[pid] -= 1
        if self.ref[pid] == 0:
            if keep:
                self.evictable[pid] = None
            else:
                self.free.append(pid)
