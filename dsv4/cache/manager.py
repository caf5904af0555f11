"""KV cache manager: who holds which pages, sliding-window freeing, prefix caching.

Prefix caching: every full 256-token block of a request gets a hash chained from the start
(``hash(parent, tokens)``). A later request whose prompt starts with the same blocks reuses
them up to the longest chain whose last block still has (a) its compressed/indexer pages,
(b) the boundary compressor rows, and (c) the two SWA pages that hold the 128-token window
before the block end. So a hit always restores every cache kind at a multiple of 256 tokens,
and the output cannot change. Unreferenced cached blocks are evicted LRU.

With a host tier (``dsv4.cache.host_tier``) an evicted cached block is copied out to host memory
first, and the match walks the chain block by block: a block cached on the device is taken as it is,
one held only by the host tier is restored into fresh pages (and cached on the device again). Every
entry of either tier keeps its window pages, so a hit may end at any of them.

The cache writes the manager makes outside a forward — host-tier offloads and restores
(``HostTransfer``) and a prefix hit's boundary rows put back into a state ring (``BoundaryRestore``) —
are published, in the order they are made, to the functions registered with ``add_listener`` (a
tensor-parallel engine replays them on every rank's own cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..model.step import BLOCK, RETAINED_SWA, SWA_PAGE
from .host_tier import HostTransfer
from .paged import CacheAllocation, PagedKVCache, PagedSequenceView
from .pool import PagePool

__all__ = ["KVCacheManager", "BoundaryRestore", "CacheEvent"]


@dataclass(frozen=True)
class BoundaryRestore:
    """A prefix hit's boundary compressor rows restored into state ring ``slot``: those kept with
    block ``block``, the hit's block number ``index`` (its last)."""

    slot: int
    index: int
    block: int


CacheEvent = HostTransfer | BoundaryRestore  # what listeners receive


@dataclass
class _CachedBlock:
    block: int
    swa: tuple[int, ...]  # retained SWA pages (window before the block end)


@dataclass
class _HostBlock:
    """A block of a prefix match held only by the host tier (restored by ``apply_prefix``)."""

    hash: int


class KVCacheManager:
    def __init__(self, kvc: PagedKVCache, enable_prefix_caching: bool = True, host=None):
        """``host``: a :class:`~dsv4.cache.host_tier.HostKVTier` over ``kvc`` (used only with
        prefix caching on)."""
        self.kvc = kvc
        b = kvc.budget
        self.blocks = PagePool(b.num_blocks, "block")
        self.swa = PagePool(b.num_swa_pages, "SWA page")
        self.free_slots = list(range(b.num_slots - 1, -1, -1))
        self.prefix = enable_prefix_caching
        self.window = kvc.cfg.sliding_window
        self.cached: dict[int, _CachedBlock] = {}  # chain hash → block
        self.block_hash: dict[int, int] = {}  # block id → chain hash (registered blocks only)
        self.host = host if enable_prefix_caching else None
        # prefix-cache statistics, in tokens: queries, and hits served by the device / the host tier
        self.hits = self.queries = self.host_hits = self.host_queries = 0
        self._listeners: list[Callable[[CacheEvent], None]] = []
        if self.host is not None:
            self.host.listeners.append(self._publish)

    def add_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Call ``fn`` with every cache write made outside a forward (``CacheEvent``), in order."""
        self._listeners.append(fn)

    def _publish(self, event: CacheEvent) -> None:
        for fn in self._listeners:
            fn(event)

    # ---- accounting ----------------------------------------------------------------------
    def usage(self) -> float:
        return 1.0 - self.blocks.num_available / max(1, self.blocks.n)

    def stats(self) -> dict:
        """Counters and gauges of both tiers (tokens, blocks, bytes), for the server's metrics."""
        out = {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
               "device_usage": self.usage(), "device_capacity_tokens": self.kvc.budget.capacity_tokens,
               "device_cached_blocks": len(self.cached)}
        if self.host is not None:
            out.update(host_prefix_cache_queries=self.host_queries, host_prefix_cache_hits=self.host_hits,
                       **self.host.stats())
        return out

    def reset_stats(self) -> None:
        self.hits = self.queries = self.host_hits = self.host_queries = 0

    def count_query(self, num_tokens: int) -> None:
        """A prompt of ``num_tokens`` looked up in the prefix cache (each tier is asked)."""
        self.queries += num_tokens
        if self.host is not None:
            self.host_queries += num_tokens

    def _evict_block(self, bid: int, offload: bool = True) -> None:
        """The device pool takes back cached block ``bid``: its content moves to the host tier (if
        any) before its pages can be reused, then the device forgets it."""
        h = self.block_hash.pop(bid)
        entry = self.cached.pop(h)
        if offload and self.host is not None:
            self.host.offload(h, entry.block, entry.swa)  # queued: issued before any page is rewritten
        for p in entry.swa:
            self.swa.decref(p, keep=False)

    def _take_swa(self) -> int:
        """A fresh SWA page, evicting cached blocks (their retained pages) while none is free."""
        while not self.swa.free and self.blocks.evictable:
            bid, _ = self.blocks.evictable.popitem(last=False)
            self._evict_block(bid)
            self.blocks.free.append(bid)
        return self.swa.take(self._evict_swa)

    def _can_take(self, nb: int, ns: int) -> bool:
        # evicting a cached block also frees its retained SWA pages
        return nb <= self.blocks.num_available and ns <= self.swa.num_free + RETAINED_SWA * len(self.blocks.evictable)

    def wait_copies(self) -> None:
        """Before a step launches: the host-tier copies queued so far are issued, and the step's
        compute waits for them (it reads restored pages, or rewrites pages an offload reads)."""
        if self.host is not None:
            self.host.wait()

    def _evict_swa(self, pid: int) -> None:  # SWA pages are never cached on their own
        raise RuntimeError("SWA pages are not evictable")

    def new_pages_needed(self, alloc: CacheAllocation, num_new: int) -> tuple[int, int]:
        end = alloc.num_computed + num_new
        nb = max(0, -(-end // BLOCK) - len(alloc.blocks))
        ns = max(0, -(-end // SWA_PAGE) - len(alloc.swa))
        return nb, ns

    def can_allocate(self, alloc: CacheAllocation, num_new: int) -> bool:
        nb, ns = self.new_pages_needed(alloc, num_new)
        if alloc.slot < 0 and not self.free_slots:
            return False
        return self._can_take(nb, ns)

    def try_allocate(self, alloc: CacheAllocation, num_new: int) -> bool:
        """``can_allocate`` then ``allocate``; a decode token inside its pages (most of a step's
        requests) costs one check instead of two full passes."""
        end = alloc.num_computed + num_new
        if alloc.slot >= 0 and end <= len(alloc.swa) * SWA_PAGE and end <= len(alloc.blocks) * BLOCK:
            return True  # no new page: what can_allocate and allocate would find, with nothing to take
        if not self.can_allocate(alloc, num_new):
            return False
        self.allocate(alloc, num_new)
        return True

    def allocate(self, alloc: CacheAllocation, num_new: int) -> None:
        """Give ``alloc`` the pages for ``num_new`` more tokens (caller checked can_allocate)."""
        if alloc.slot < 0:
            alloc.slot = self.free_slots.pop()
        nb, ns = self.new_pages_needed(alloc, num_new)
        for _ in range(nb):
            alloc.blocks.append(self.blocks.take(self._evict_block))
        for _ in range(ns):
            alloc.swa.append(self._take_swa())

    def free(self, alloc: CacheAllocation) -> None:
        """Release everything a finished, aborted or preempted request holds."""
        for bid in alloc.blocks:
            self.blocks.decref(bid, keep=bid in self.block_hash)
        for pid in alloc.swa:
            if pid >= 0:
                self.swa.decref(pid, keep=False)
        if alloc.slot >= 0:
            self.free_slots.append(alloc.slot)
        alloc.blocks, alloc.swa, alloc.slot = [], [], -1
        alloc.num_computed = alloc.registered_blocks = alloc.swa_released = 0
        alloc.block_hashes = []

    def view(self, alloc: CacheAllocation) -> PagedSequenceView:
        return PagedSequenceView(self.kvc, alloc)

    def reset_prefix_cache(self) -> None:
        """Forget every cached (unreferenced) block: its pages go back to the free lists; the host
        tier forgets its blocks too."""
        while self.blocks.evictable:
            bid, _ = self.blocks.evictable.popitem(last=False)
            self._evict_block(bid, offload=False)
            self.blocks.free.append(bid)
        for bid in list(self.block_hash):  # cached blocks still held by running requests
            self._evict_block(bid, offload=False)
        if self.host is not None:
            self.host.reset()

    def leaks(self) -> list[str]:
        """With no request alive: anything not free or cached. Empty when the books balance."""
        out = []
        held = [b for b in range(self.blocks.n) if self.blocks.ref[b] > 0]
        if held:
            out.append(f"{len(held)} blocks still referenced: {held[:8]}")
        retained = {p for e in self.cached.values() for p in e.swa}
        swa_held = [p for p in range(self.swa.n) if self.swa.ref[p] > 0 and p not in retained]
        if swa_held:
            out.append(f"{len(swa_held)} SWA pages still referenced: {swa_held[:8]}")
        if len(self.free_slots) != self.kvc.budget.num_slots:
            out.append(f"{self.kvc.budget.num_slots - len(self.free_slots)} state slots not returned")
        return out

    # ---- sliding window ------------------------------------------------------------------
    def release_out_of_window(self, alloc: CacheAllocation) -> None:
        """Drop SWA pages no future query of this request can read (all tokens < p - window + 1)."""
        first_needed = max(0, alloc.num_computed - (self.window - 1))
        end = min(first_needed // SWA_PAGE, len(alloc.swa))
        for i in range(alloc.swa_released, end):  # pages below the watermark are gone already
            if alloc.swa[i] >= 0:
                self.swa.decref(alloc.swa[i], keep=False)
                alloc.swa[i] = -1
        alloc.swa_released = max(alloc.swa_released, end)

    # ---- prefix caching ------------------------------------------------------------------
    @staticmethod
    def chain_hashes(token_ids: list[int], n_blocks: int, parent: int = 0, start: int = 0) -> list[int]:
        out = []
        for i in range(start, n_blocks):
            parent = hash((parent, tuple(token_ids[i * BLOCK: (i + 1) * BLOCK])))
            out.append(parent)
        return out

    def has_new_full_blocks(self, alloc: CacheAllocation) -> bool:
        """Whether ``register_full_blocks`` has anything to offer (prefix caching on, a block closed)."""
        return self.prefix and alloc.num_computed // BLOCK > alloc.registered_blocks

    def register_full_blocks(self, alloc: CacheAllocation, token_ids: list[int]) -> None:
        """Offer newly completed blocks to the prefix cache (keeping their window pages)."""
        if not self.has_new_full_blocks(alloc):
            return
        full = alloc.num_computed // BLOCK
        parent = alloc.block_hashes[-1] if alloc.block_hashes else 0
        new = self.chain_hashes(token_ids, full, parent, len(alloc.block_hashes))
        alloc.block_hashes.extend(new)
        for i in range(alloc.registered_blocks, full):
            h, bid = alloc.block_hashes[i], alloc.blocks[i]
            if h in self.cached or bid in self.block_hash:
                continue
            first = (i + 1) * BLOCK // SWA_PAGE - RETAINED_SWA
            pages = alloc.swa[first: first + RETAINED_SWA]
            if len(pages) < RETAINED_SWA or any(p < 0 for p in pages):
                continue  # window already gone: this block can only be an interior block of a hit
            for p in pages:
                self.swa.incref(p)
            self.cached[h] = _CachedBlock(bid, tuple(pages))
            self.block_hash[bid] = h
        alloc.registered_blocks = full

    def match_prefix(self, token_ids: list[int], max_tokens: int) -> list[_CachedBlock | _HostBlock]:
        """Longest chain of cached blocks covering at most ``max_tokens`` of ``token_ids``: each block
        from the device tier, else from the host tier."""
        if not self.prefix:
            return []
        n = max_tokens // BLOCK
        out, parent = [], 0
        host = self.host
        for i in range(n):
            parent = hash((parent, tuple(token_ids[i * BLOCK: (i + 1) * BLOCK])))
            e = self.cached.get(parent)
            if e is None:
                if host is None or parent not in host:
                    break
                e = _HostBlock(parent)
            out.append(e)
        return out

    def _restore(self, hit: list) -> list[_CachedBlock]:
        """``hit`` with its host-tier blocks restored into fresh device pages (and cached on the
        device again), cut before the first one there is no room for. The device blocks of the hit
        are referenced first, so making room cannot evict them."""
        for e in hit:
            if isinstance(e, _HostBlock):
                self.host.touch(e.hash)  # most recent: the offloads that making room causes evict others first
            else:
                self.blocks.incref(e.block)
        out: list[_CachedBlock] = []
        for i, e in enumerate(hit):
            if isinstance(e, _HostBlock):
                restored = None
                if e.hash in self.host and self._can_take(1, RETAINED_SWA):
                    bid = self.blocks.take(self._evict_block)
                    swa = tuple(self._take_swa() for _ in range(RETAINED_SWA))
                    if e.hash in self.host:  # (a tier smaller than the offloads just made may have dropped it)
                        self.host.restore(e.hash, bid, swa)
                        restored = self.cached[e.hash] = _CachedBlock(bid, swa)  # the cache holds the pages
                        self.block_hash[bid] = e.hash
                        self.host_hits += BLOCK
                    else:
                        self.blocks.decref(bid, keep=False)
                        for p in swa:
                            self.swa.decref(p, keep=False)
                if restored is None:  # the hit ends before this block
                    for later in hit[i + 1:]:
                        if not isinstance(later, _HostBlock):
                            self.blocks.decref(later.block, keep=True)
                    break
                out.append(restored)
            else:
                out.append(e)
                self.hits += BLOCK
        return out

    def apply_prefix(self, alloc: CacheAllocation, hit: list, token_ids: list[int]) -> int:
        """Take the hit blocks into ``alloc`` (host-tier blocks restored first); returns the number of
        tokens restored."""
        if not hit:
            return 0
        if alloc.slot < 0:
            alloc.slot = self.free_slots.pop()
        if self.host is not None and any(isinstance(e, _HostBlock) for e in hit):
            hit = self._restore(hit)  # takes the device blocks' references
            if not hit:
                self.free_slots.append(alloc.slot)
                alloc.slot = -1
                return 0
            self.wait_copies()  # the boundary rows below are read from restored blocks
        else:
            for e in hit:
                self.blocks.incref(e.block)
            self.hits += len(hit) * BLOCK
        alloc.blocks.extend(e.block for e in hit)
        p = len(hit) * BLOCK
        alloc.swa = [-1] * (p // SWA_PAGE - RETAINED_SWA) + list(hit[-1].swa)
        for pid in hit[-1].swa:
            self.swa.incref(pid)
        alloc.num_computed = p
        alloc.registered_blocks = len(hit)
        alloc.block_hashes = self.chain_hashes(token_ids, len(hit))
        self.view(alloc).restore_boundary(len(hit) - 1)
        if self._listeners:
            self._publish(BoundaryRestore(alloc.slot, len(hit) - 1, alloc.blocks[len(hit) - 1]))
        return p
