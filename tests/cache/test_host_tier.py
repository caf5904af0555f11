"""The host tier's store and index on their own: row copies, the byte-exact round trip of every
cache tensor a block's restore needs, transfer ordering, LRU. No model runs here."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.copies import CopyEngine, copy_runs, rows_view, runs
from dsv4.cache.host_tier import HostKVStore, HostKVTier, HostTransfer
from dsv4.cache.paged import CacheBudget, PagedKVCache, unit_bytes
from dsv4.config import load_config
from dsv4.formats import alloc_kv_pages
from dsv4.model.cache import CacheNumerics
from dsv4.model.step import RETAINED_SWA


@pytest.fixture(scope="module")
def cfg(tiny_ckpt):
    return load_config(tiny_ckpt)


def _cache(cfg, kv_dtype: str, num_blocks: int = 6, num_swa: int = 16) -> PagedKVCache:
    numerics = CacheNumerics(kv_dtype)
    blk, swa, slot = unit_bytes(cfg, numerics, torch.float32)
    return PagedKVCache(cfg, numerics, CacheBudget(num_blocks, num_swa, 2, blk, swa, slot), torch.float32)


def _fill(kvc: PagedKVCache, seed: int) -> None:
    """Random bytes in every row of every cache tensor (padding between rows included)."""
    g = torch.Generator().manual_seed(seed)
    for t in (*kvc.swa, *kvc.comp.values(), *kvc.boundary.values()):
        r = rows_view(t)
        if r.dtype == torch.uint8:
            r.copy_(torch.randint(0, 256, r.shape, generator=g, dtype=torch.uint8))
        else:
            r.copy_(torch.randn(r.shape, generator=g).to(r.dtype))


def _payload(kvc: PagedKVCache, block: int, swa: tuple[int, ...]) -> list[torch.Tensor]:
    """The bytes a restore of ``block`` needs, as the device cache holds them."""
    rows = [rows_view(t)[block].clone() for t in (*kvc.comp.values(), *kvc.boundary.values())]
    return rows + [rows_view(t)[p].clone() for t in kvc.swa for p in swa]


def _bytes(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    return [r.contiguous().view(torch.uint8) for r in rows]


def test_runs_merge_rows_consecutive_on_both_sides():
    assert runs([0, 1, 2, 5, 6, 9], [3, 4, 5, 9, 7, 8]) == [(0, 3, 3), (5, 9, 1), (6, 7, 1), (9, 8, 1)]
    assert runs([], []) == []
    with pytest.raises(ValueError, match="2 source rows for 1 destination rows"):
        runs([0, 1], [0])


def test_run_copies_equal_the_indexed_copy_and_the_row_loop():
    """The CUDA engine's copy (one copy_ per run) against the CPU engine's indexed copy and a plain
    per-row loop, over block-packed pages whose row stride exceeds the page."""
    g = torch.Generator().manual_seed(0)
    src = alloc_kv_pages(12, 8)
    assert src.stride(0) > src.shape[1]  # padded rows: rows_view covers the padding too
    rows_view(src).copy_(torch.randint(0, 256, rows_view(src).shape, generator=g, dtype=torch.uint8))
    src_rows = [3, 4, 5, 0, 11, 7, 8]
    dst_rows = [0, 1, 2, 9, 4, 5, 6]
    plain, indexed, by_runs = (rows_view(alloc_kv_pages(10, 8)) for _ in range(3))
    for s, d in zip(src_rows, dst_rows):
        plain[d] = rows_view(src)[s]
    CopyEngine().issue([(rows_view(src), src_rows, indexed, dst_rows)])
    spans = runs(src_rows, dst_rows)
    assert spans == [(3, 0, 3), (0, 9, 1), (11, 4, 1), (7, 5, 2)]
    copy_runs(rows_view(src), by_runs, spans)
    assert torch.equal(indexed, plain) and torch.equal(by_runs, plain)


def test_rows_view_refuses_rows_that_are_not_contiguous():
    with pytest.raises(ValueError, match="not contiguous"):
        rows_view(torch.zeros(4, 6)[:, ::2])


@pytest.mark.parametrize("kv_dtype", ["fp8_ds_mla", "auto"])
def test_a_restored_block_is_byte_equal_to_the_offloaded_one(cfg, kv_dtype):
    """Every tensor a hit at a block end reads — compressed KV records, indexer keys, compressor
    boundary rows, the two window pages before the block end, of every layer — comes back byte for
    byte into other block and page ids, and nothing else is written."""
    kvc = _cache(cfg, kv_dtype)
    assert set(kvc.comp) == {(1, "kv"), (1, "index"), (2, "kv"), (3, "kv"), (3, "index")}  # CSA, HCA, CSA
    assert len(kvc.boundary) == 4 and len(kvc.swa) == cfg.num_hidden_layers + cfg.num_mtp_layers
    store = HostKVStore(kvc, 3, CopyEngine())
    assert store.slot_bytes == sum(r.numel() for r in _bytes(_payload(kvc, 0, (0, 1))))
    _fill(kvc, 1)
    blocks = {1: (2, 3), 4: (7, 6)}  # block → its window pages
    before = {b: _payload(kvc, b, swa) for b, swa in blocks.items()}
    store.execute([HostTransfer("out", slot, b, swa) for slot, (b, swa) in zip((2, 0), blocks.items())])
    assert [torch.equal(a, b) for a, b in zip(_bytes(store.slot_payload(2)), _bytes(before[1]))] == \
           [True] * len(before[1])
    _fill(kvc, 2)  # the device pages are reused by others
    untouched = _payload(kvc, 0, (0, 1))
    store.execute([HostTransfer("in", 2, 5, (9, 8)), HostTransfer("in", 0, 3, (4, 5))])
    for (b, swa), (nb, nswa) in zip(blocks.items(), ((5, (9, 8)), (3, (4, 5)))):
        got = _bytes(_payload(kvc, nb, nswa))
        assert all(torch.equal(x, y) for x, y in zip(got, _bytes(before[b]))), f"block {b} changed on its way"
    assert all(torch.equal(x, y) for x, y in zip(_bytes(_payload(kvc, 0, (0, 1))), _bytes(untouched)))


def test_transfers_run_in_order_when_a_slot_or_page_is_written_twice(cfg):
    """A slot the tier reuses within one batch of offloads, and a page restored twice, end with the
    later write; a restore queued after an offload of the same slot reads what the offload wrote."""
    kvc = _cache(cfg, "fp8_ds_mla")
    store = HostKVStore(kvc, 2, CopyEngine())
    _fill(kvc, 3)
    b2 = _payload(kvc, 2, (4, 5))
    store.execute([HostTransfer("out", 0, 1, (2, 3)), HostTransfer("out", 0, 2, (4, 5)),  # slot 0 rewritten
                   HostTransfer("in", 0, 4, (8, 9)),  # reads the second write
                   HostTransfer("out", 1, 3, (6, 7)),
                   HostTransfer("in", 1, 5, (10, 11)), HostTransfer("in", 0, 5, (10, 11))])  # block 5 rewritten
    assert all(torch.equal(x, y) for x, y in zip(_bytes(_payload(kvc, 4, (8, 9))), _bytes(b2)))
    assert all(torch.equal(x, y) for x, y in zip(_bytes(_payload(kvc, 5, (10, 11))), _bytes(b2)))
    with pytest.raises(ValueError, match="direction must be 'in' or 'out'"):
        store.execute([HostTransfer("up", 0, 1, (2, 3))])
    with pytest.raises(ValueError, match=f"moves {RETAINED_SWA} window pages"):
        store.execute([HostTransfer("in", 0, 1, (2,))])
    with pytest.raises(ValueError, match="at least one slot"):
        HostKVStore(kvc, 0, CopyEngine())


def test_the_tier_is_lru_and_a_held_block_costs_no_copy(cfg):
    kvc = _cache(cfg, "auto")
    tier = HostKVTier(HostKVStore(kvc, 3, CopyEngine()))
    seen = []
    tier.listeners.append(seen.append)
    for h, b in ((11, 0), (12, 1), (13, 2)):
        tier.offload(h, b, (2 * b, 2 * b + 1))
    assert [t.slot for t in tier.pending] == [0, 1, 2] and list(tier.entries) == [11, 12, 13]
    tier.restore(11, 5, (10, 11))  # used: most recent
    tier.offload(14, 3, (6, 7))  # full: the least recently used (12) goes
    assert list(tier.entries) == [13, 11, 14] and 12 not in tier and tier.entries[14] == 1
    n = len(tier.pending)
    tier.offload(13, 4, (8, 9))  # already held (restored from here and evicted again): no copy
    assert len(tier.pending) == n and list(tier.entries) == [11, 14, 13]
    assert seen == tier.pending  # every queued transfer went to the listener, in order
    tier.wait()
    assert tier.pending == []
    s = tier.stats()
    assert (s["host_offloaded_blocks"], s["host_restored_blocks"], s["host_evicted_blocks"]) == (4, 1, 1)
    assert s["host_usage_blocks"] == 3 and s["host_usage"] == 1.0
    assert s["host_offloaded_bytes"] == 4 * tier.store.slot_bytes and s["host_restored_bytes"] == tier.store.slot_bytes
    tier.reset()
    assert len(tier) == 0 and sorted(tier.free) == [0, 1, 2]
