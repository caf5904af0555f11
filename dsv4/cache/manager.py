"""KV cache manager: who holds which pages, sliding-window freeing, prefix caching.

Prefix caching: every full 256-token block of a request gets a hash chained from the start
(``hash(parent, tokens)``). A later request whose prompt starts with the same blocks reuses
them up to the longest chain whose last block still has (a) its compressed/indexer pages,
(b) the boundary compressor rows, and (c) the two SWA pages that hold the 128-token window
before the block end. So a hit always restores every cache kind at a multiple of 256 tokens,
and the output cannot change. Unreferenced cached blocks are evicted LRU.
"""

from __future__ import annotations

from dataclasses import dataclass

from .paged import BLOCK, SWA_PAGE, CacheAllocation, PagedKVCache, PagedSequenceView
from .pool import PagePool

RETAINED_SWA = 2  # SWA pages before a block end that cover the 128-token window


@dataclass
class _CachedBlock:
    block: int
    swa: tuple[int, ...]  # retained SWA pages (window before the block end)


class KVCacheManager:
    def __init__(self, kvc: PagedKVCache, enable_prefix_caching: bool = True):
        self.kvc = kvc
        b = kvc.budget
        self.blocks = PagePool(b.num_blocks, "block")
        self.swa = PagePool(b.num_swa_pages, "SWA page")
        self.free_slots = list(range(b.num_slots - 1, -1, -1))
        self.prefix = enable_prefix_caching
        self.window = kvc.cfg.sliding_window
        self.cached: dict[int, _CachedBlock] = {}  # chain hash → block
        self.block_hash: dict[int, int] = {}  # block id → chain hash (registered blocks only)
        self.hits = self.queries = 0  # prefix-cache statistics, in tokens

    # ---- accounting ----------------------------------------------------------------------
    def usage(self) -> float:
        return 1.0 - self.blocks.num_available / max(1, self.blocks.n)

    def _evict_block(self, bid: int) -> None:
        h = self.block_hash.pop(bid)
        entry = self.cached.pop(h)
        for p in entry.swa:
            self.swa.decref(p, keep=False)

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
        # evicting a cached block also frees its retained SWA pages
        return nb <= self.blocks.num_available and ns <= self.swa.num_free + RETAINED_SWA * len(self.blocks.evictable)

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
            if not self.swa.free:  # make room by evicting cached blocks (their retained pages)
                while not self.swa.free and self.blocks.evictable:
                    bid, _ = self.blocks.evictable.popitem(last=False)
                    self._evict_block(bid)
                    self.blocks.free.append(bid)
            alloc.swa.append(self.swa.take(self._evict_swa))

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
        """Forget every cached (unreferenced) block: its pages go back to the free lists."""
        while self.blocks.evictable:
            bid, _ = self.blocks.evictable.popitem(last=False)
            self._evict_block(bid)
            self.blocks.free.append(bid)
        for bid in list(self.block_hash):  # cached blocks still held by running requests
            self._evict_block(bid)

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

    def match_prefix(self, token_ids: list[int], max_tokens: int) -> list[_CachedBlock]:
        """Longest chain of cached blocks covering at most ``max_tokens`` of ``token_ids``."""
        if not self.prefix:
            return []
        n = max_tokens // BLOCK
        out, parent = [], 0
        for i in range(n):
            parent = hash((parent, tuple(token_ids[i * BLOCK: (i + 1) * BLOCK])))
            e = self.cached.get(parent)
            if e is None:
                break
            out.append(e)
        return out

    def apply_prefix(self, alloc: CacheAllocation, hit: list[_CachedBlock], token_ids: list[int]) -> int:
        """Take the hit blocks into ``alloc``; returns the number of tokens restored."""
        if not hit:
            return 0
        if alloc.slot < 0:
            alloc.slot = self.free_slots.pop()
        for e in hit:
            self.blocks.incref(e.block)
            alloc.blocks.append(e.block)
        p = len(hit) * BLOCK
        alloc.swa = [-1] * (p // SWA_PAGE - RETAINED_SWA) + list(hit[-1].swa)
        for pid in hit[-1].swa:
            self.swa.incref(pid)
        alloc.num_computed = p
        alloc.registered_blocks = len(hit)
        alloc.block_hashes = self.chain_hashes(token_ids, len(hit))
        self.view(alloc).restore_boundary(len(hit) - 1)
        return p
