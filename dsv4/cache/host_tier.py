"""The host tier of the prefix cache: blocks the device pool evicts, kept in host memory, LRU.

A host **slot** holds one complete 256-token block's restore payload — everything a prefix hit at
that block's end reads, as the device cache stores it (``dsv4.cache.paged``):

- per compressed layer and kind, the block's compressed page (KV records, indexer keys);
- per ratio-4 compressor, the block's boundary rows (the state a hit at the block end puts back
  into the request's ring);
- per layer (the MTP layer's too), the ``RETAINED_SWA`` window pages before the block end.

``HostKVStore`` owns the host tensors and moves payloads through a copy engine
(``dsv4.cache.copies``); ``HostKVTier`` decides which block lives in which slot (keyed by the same
chain hash as the device prefix cache, least recently used first out). The KV cache manager offloads
a cached block when the device pool evicts it and restores it on a prefix hit that misses the device
tier; the copies are queued (``HostTransfer``) and issued in order before the next step reads or
rewrites any page (``HostKVTier.flush`` / ``wait``). Every rank of a tensor-parallel engine holds
the same cache, so rank 0's transfers are replayed on each rank's own store.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..model.step import BLOCK, RETAINED_SWA
from .copies import CopyEngine, rows_view
from .paged import PagedKVCache


@dataclass(frozen=True)
class HostTransfer:
    """One block's payload between the device cache and a host slot: ``out`` (device → host: an
    offload) or ``in`` (host → device: a restore into ``block`` and the window pages ``swa``)."""

    direction: str  # "out" | "in"
    slot: int
    block: int
    swa: tuple[int, ...]


class HostKVStore:
    """Host copies of device-cache blocks: for each cache tensor a host tensor of ``num_slots``
    rows (``RETAINED_SWA`` rows per slot for the window pages), pinned for asynchronous copies when
    the cache is on a CUDA device."""

    def __init__(self, kvc: PagedKVCache, num_slots: int, copies: CopyEngine, pin_memory: bool = False):
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.kvc, self.num_slots, self.copies = kvc, int(num_slots), copies
        self.pin_memory = bool(pin_memory)

        def host(dev: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
            d = rows_view(dev)
            return d, torch.empty((rows, d.shape[1]), dtype=d.dtype, pin_memory=self.pin_memory)

        # (device rows view, host rows): a block's tensors have one row per block, the window's one per page
        self.block_pairs = [host(t, self.num_slots) for t in (*kvc.comp.values(), *kvc.boundary.values())]
        self.swa_pairs = [host(t, self.num_slots * RETAINED_SWA) for t in kvc.swa]
        self.slot_bytes = self.payload_bytes(kvc)

    @staticmethod
    def payload_bytes(kvc: PagedKVCache) -> int:
        """Bytes of one slot: the block's rows of every block tensor and ``RETAINED_SWA`` window pages
        of every layer (row padding included: it is copied with the row)."""
        def row(t: torch.Tensor) -> int:
            return rows_view(t).shape[1] * t.element_size()

        blk = sum(row(t) for t in (*kvc.comp.values(), *kvc.boundary.values()))
        return blk + RETAINED_SWA * sum(row(t) for t in kvc.swa)

    @property
    def capacity_tokens(self) -> int:
        return self.num_slots * BLOCK

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def execute(self, transfers: list[HostTransfer]) -> None:
        """Issue ``transfers`` in order: each maximal run of one direction whose destinations are
        distinct becomes one batch (one indexed copy per tensor; on CUDA one copy per run of
        consecutive rows), so a slot or page written twice is written in order."""
        group: list[HostTransfer] = []
        dests: set[tuple[str, int]] = set()
        for t in transfers:
            if t.direction not in ("in", "out"):
                raise ValueError(f"host transfer direction must be 'in' or 'out', got {t.direction!r}")
            if len(t.swa) != RETAINED_SWA:
                raise ValueError(f"a host transfer moves {RETAINED_SWA} window pages, got {t.swa}")
            dest = [("slot", t.slot)] if t.direction == "out" else [("block", t.block)] + [("page", p) for p in t.swa]
            if group and (t.direction != group[0].direction or not dests.isdisjoint(dest)):
                self._issue(group)
                group, dests = [], set()
            group.append(t)
            dests.update(dest)
        if group:
            self._issue(group)

    def _issue(self, group: list[HostTransfer]) -> None:
        slots = [t.slot for t in group]
        blocks = [t.block for t in group]
        host_pages = [RETAINED_SWA * t.slot + j for t in group for j in range(RETAINED_SWA)]
        dev_pages = [p for t in group for p in t.swa]
        if group[0].direction == "out":
            moves = [(d, blocks, h, slots) for d, h in self.block_pairs]
            moves += [(d, dev_pages, h, host_pages) for d, h in self.swa_pairs]
        else:
            moves = [(h, slots, d, blocks) for d, h in self.block_pairs]
            moves += [(h, host_pages, d, dev_pages) for d, h in self.swa_pairs]
        self.copies.issue(moves)

    def wait(self) -> None:
        """Compute launched from now on runs after every transfer executed so far."""
        self.copies.wait()

    def slot_payload(self, slot: int) -> list[torch.Tensor]:
        """The host rows of ``slot`` (block tensors, then window pages), after every copy is done."""
        self.copies.synchronize()
        rows = [h[slot] for _, h in self.block_pairs]
        return rows + [h[RETAINED_SWA * slot + j] for _, h in self.swa_pairs for j in range(RETAINED_SWA)]


class HostKVTier:
    """Which block is in which host slot: chain hash → slot, least recently used first out.

    ``offload`` and ``restore`` queue transfers; ``flush`` issues what is queued, ``wait`` also makes
    the next step's compute wait for it. Each queued transfer is also handed to every function in
    ``listeners`` (the KV cache manager's, which publishes it: ``KVCacheManager.add_listener``)."""

    def __init__(self, store: HostKVStore):
        self.store = store
        self.entries: OrderedDict[int, int] = OrderedDict()  # chain hash → slot, LRU order (oldest first)
        self.free: list[int] = list(range(store.num_slots - 1, -1, -1))  # pop() gives the lowest slot first
        self.pending: list[HostTransfer] = []
        self.listeners: list = []
        self._unwaited = False  # transfers issued since the last wait()
        # statistics: blocks and bytes moved each way, blocks dropped from the tier
        self.offloaded_blocks = self.restored_blocks = self.evicted_blocks = 0
        self.offloaded_bytes = self.restored_bytes = 0

    def __contains__(self, h: int) -> bool:
        return h in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_slots(self) -> int:
        return self.store.num_slots

    def touch(self, h: int) -> None:
        """Mark ``h`` most recently used."""
        self.entries.move_to_end(h)

    def offload(self, h: int, block: int, swa: tuple[int, ...]) -> None:
        """Keep the evicted device block ``block`` (chain hash ``h``, window pages ``swa``) in a host
        slot, evicting the least recently used entry when the tier is full. A block already held (it
        was restored from here and is evicted again) only becomes the most recent."""
        if h in self.entries:
            self.touch(h)
            return
        if self.free:
            slot = self.free.pop()
        else:
            _, slot = self.entries.popitem(last=False)
            self.evicted_blocks += 1
        self.entries[h] = slot
        self._queue(HostTransfer("out", slot, block, tuple(swa)))
        self.offloaded_blocks += 1
        self.offloaded_bytes += self.store.slot_bytes

    def restore(self, h: int, block: int, swa: tuple[int, ...]) -> None:
        """Copy entry ``h`` back into the device block ``block`` and window pages ``swa`` (the copy
        stays in the tier: a later eviction of the block costs no copy)."""
        slot = self.entries[h]
        self.touch(h)
        self._queue(HostTransfer("in", slot, block, tuple(swa)))
        self.restored_blocks += 1
        self.restored_bytes += self.store.slot_bytes

    def _queue(self, t: HostTransfer) -> None:
        self.pending.append(t)
        for fn in self.listeners:
            fn(t)

    def flush(self) -> None:
        """Issue the queued transfers, in order."""
        if self.pending:
            pending, self.pending = self.pending, []
            self.store.execute(pending)
            self._unwaited = True

    def wait(self) -> None:
        """``flush``, then make the compute launched from now on wait for every transfer issued."""
        self.flush()
        if self._unwaited:
            self.store.wait()
            self._unwaited = False

    def reset(self) -> None:
        """Forget every entry (queued transfers still run: a queued restore feeds a running request)."""
        self.entries.clear()
        self.free = list(range(self.num_slots - 1, -1, -1))

    def stats(self) -> dict:
        used = len(self.entries)
        return {
            "host_capacity_blocks": self.num_slots, "host_capacity_tokens": self.store.capacity_tokens,
            "host_capacity_bytes": self.store.nbytes, "host_usage_blocks": used,
            "host_usage_bytes": used * self.store.slot_bytes, "host_usage": used / self.num_slots,
            "host_offloaded_blocks": self.offloaded_blocks, "host_restored_blocks": self.restored_blocks,
            "host_evicted_blocks": self.evicted_blocks, "host_offloaded_bytes": self.offloaded_bytes,
            "host_restored_bytes": self.restored_bytes,
        }
