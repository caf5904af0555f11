"""Preallocated paged caches for every cache kind, and a per-request view the model reads through.

Units (one id space each, shared by all layers, as in vLLM):
- a **SWA page** = 64 raw tokens of every layer's sliding-window KV (the MTP layer's or the DSpark stages' too);
- a **block** = 256 raw tokens: per CSA layer a compressed page (64 entries) and an indexer page
  (64 keys), per HCA layer a compressed page (2 entries), and per CSA layer the compressor rows
  of the block's last 4 tokens (the overlap state a prefix-cache hit at the block end needs).
The running compressor state lives in per-request *slots* (rings of 8 rows for ratio 4 and
128 rows for ratio 128, a few more with speculative decoding: ``ring_rows``); the geometry is
``dsv4.model.step``'s. With ``fp8_ds_mla`` the KV pages hold the real 584-byte records in the
block-packed layout and every read uses the writer's address formula (``dsv4.formats``); with
``auto`` they hold model-dtype rows.
"""

from __future__ import annotations

import array
import functools
from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..formats import (
    alloc_indexer_pages,
    alloc_kv_pages,
    indexer_page_stride,
    page_stride,
    read_indexer_k,
    read_kv,
    write_indexer_k,
    write_kv,
)
from ..model.cache import CacheNumerics
from ..model.step import BLOCK, BOUNDARY_ROWS, SWA_PAGE, compressors, ring_rows


@dataclass
class CacheBudget:
    num_blocks: int
    num_swa_pages: int
    num_slots: int
    bytes_per_block: int
    bytes_per_swa_page: int
    bytes_per_slot: int
    lookahead: int = 0  # draft tokens a speculative step stores in the state rings (``ring_rows``)

    @property
    def total_bytes(self) -> int:
        return (self.num_blocks * self.bytes_per_block + self.num_swa_pages * self.bytes_per_swa_page
                + self.num_slots * self.bytes_per_slot)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * BLOCK


def unit_bytes(cfg: ModelConfig, numerics: CacheNumerics, dtype: torch.dtype,
               lookahead: int = 0) -> tuple[int, int, int]:
    """Bytes of one block, one SWA page and one state slot over all layers."""
    elt = torch.tensor([], dtype=dtype).element_size()
    q = numerics.quantized
    n_swa_layers = cfg.num_hidden_layers + cfg.num_draft_layers
    swa = n_swa_layers * (page_stride(SWA_PAGE) if q else SWA_PAGE * cfg.head_dim * elt)
    blk = slot = 0
    for layer in range(cfg.num_hidden_layers):
        for kind, ratio, width in compressors(cfg, layer):
            per = BLOCK // ratio
            if kind == "kv":
                blk += page_stride(per) if q else per * cfg.head_dim * elt
            else:
                blk += indexer_page_stride(per) if q else per * cfg.index_head_dim * elt
            if ratio == 4:
                blk += BOUNDARY_ROWS * width * 4
            slot += ring_rows(ratio, lookahead) * width * 4
    return blk, swa, slot


def plan_budget(cfg: ModelConfig, numerics: CacheNumerics, dtype: torch.dtype, memory_bytes: int,
                max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, lookahead: int = 0) -> CacheBudget:
    """Split a memory budget into blocks, SWA pages and state slots.

    SWA pages: enough for every running request's window (3 pages) plus one prefill budget's
    worth, plus two per block so that each cached block can keep the window its end needs.
    """
    blk, swa, slot = unit_bytes(cfg, numerics, dtype, lookahead)
    extra_swa = max_num_seqs * 3 + -(-max_num_batched_tokens // SWA_PAGE) + 2
    fixed = max_num_seqs * slot + extra_swa * swa
    nb = (memory_bytes - fixed) // (blk + 2 * swa) if memory_bytes > fixed else 0
    need = -(-max_model_len // BLOCK)
    if nb < need:
        min_bytes = fixed + need * (blk + 2 * swa)
        raise ValueError(
            f"KV cache budget too small for one request: max_model_len={max_model_len} needs {need} blocks of "
            f"{BLOCK} tokens, the budget of {memory_bytes / 2**20:.1f} MiB gives {max(nb, 0)}; "
            f"raise --kv-cache-memory to at least {min_bytes / 2**20:.1f} MiB or lower --max-model-len"
        )
    return CacheBudget(int(nb), int(2 * nb + extra_swa), max_num_seqs, blk, swa, slot, lookahead)


class PagedKVCache:
    """All cache tensors of all layers, allocated once from a :class:`CacheBudget`."""

    def __init__(self, cfg: ModelConfig, numerics: CacheNumerics, budget: CacheBudget, dtype: torch.dtype,
                 device="cpu"):
        self.cfg, self.numerics, self.budget, self.dtype = cfg, numerics, budget, dtype
        self.device = torch.device(device)
        q = numerics.quantized
        nl = cfg.num_hidden_layers + cfg.num_draft_layers
        # one spare page past the pool's pages: batched writers send masked-out rows there
        # instead of branching on the host (dsv4.model.paged_attention)
        P, B, S = budget.num_swa_pages + 1, budget.num_blocks + 1, budget.num_slots
        self.swa = [
            alloc_kv_pages(P, SWA_PAGE, device)
            if q
            else torch.zeros(P, SWA_PAGE, cfg.head_dim, dtype=dtype, device=device)
            for _ in range(nl)
        ]
        self.comp: dict[tuple[int, str], torch.Tensor] = {}
        self.boundary: dict[tuple[int, str], torch.Tensor] = {}
        self.ring: dict[tuple[int, str], torch.Tensor] = {}
        self.ratio: dict[tuple[int, str], int] = {}
        for layer in range(cfg.num_hidden_layers):
            for kind, ratio, width in compressors(cfg, layer):
                key = (layer, kind)
                per = BLOCK // ratio
                self.ratio[key] = ratio
                if kind == "kv":
                    self.comp[key] = (
                        alloc_kv_pages(B, per, device)
                        if q
                        else torch.zeros(B, per, cfg.head_dim, dtype=dtype, device=device)
                    )
                else:
                    self.comp[key] = (
                        alloc_indexer_pages(B, per, device)
                        if q
                        else torch.zeros(B, per, cfg.index_head_dim, dtype=dtype, device=device)
                    )
                if ratio == 4:
                    self.boundary[key] = torch.zeros(B, BOUNDARY_ROWS, width, device=device)
                self.ring[key] = torch.zeros(S + 1, ring_rows(ratio, budget.lookahead), width,
                                             device=device)  # + spare slot

    @property
    def spare_swa_page(self) -> int:
        return self.budget.num_swa_pages

    @property
    def spare_block(self) -> int:
        return self.budget.num_blocks

    @property
    def spare_slot(self) -> int:
        return self.budget.num_slots

    def per_block(self, key) -> int:
        return BLOCK // self.ratio[key]


class PageRow:
    """A host int64 copy of one request's page list, kept in step with it at the cost of what
    changed: the lists only grow, and the SWA list turns to -1 below a watermark
    (``swa_released``); a list replaced by a new object (freed, prefix hit) is copied again.
    Building a step's page tables from these costs memory copies, not O(context) Python ints."""

    __slots__ = ("src", "buf", "released")

    def __init__(self):
        self.src, self.buf, self.released = None, array.array("q"), 0

    def sync(self, pages: list[int], released: int = 0) -> array.array:
        if pages is not self.src or len(pages) < len(self.buf):
            self.src, self.buf, self.released = pages, array.array("q"), 0
        n = len(self.buf)
        if len(pages) > n:
            self.buf.extend(pages[n:])
        if released > self.released:
            k = min(released, len(self.buf)) - self.released
            self.buf[self.released : self.released + k] = array.array("q", [-1]) * k
            self.released = released
        return self.buf


@dataclass
class CacheAllocation:
    """What one request holds: block ids, SWA page ids (-1 once freed), its state slot."""

    blocks: list[int] = field(default_factory=list)
    swa: list[int] = field(default_factory=list)
    slot: int = -1
    num_computed: int = 0  # tokens whose KV/state is in the cache
    registered_blocks: int = 0  # leading full blocks already offered to the prefix cache
    swa_released: int = 0  # leading SWA pages already released (every entry below it is -1)
    block_hashes: list[int] = field(default_factory=list)
    # host copies of ``blocks`` / ``swa`` for the per-step tables (``model.step.host_tables``)
    block_row: PageRow = field(default_factory=PageRow, repr=False, compare=False)
    swa_row: PageRow = field(default_factory=PageRow, repr=False, compare=False)


class PagedSequenceView:
    """The :class:`~dsv4.model.cache.SequenceCache` of one request over the paged tensors."""

    def __init__(self, kvc: PagedKVCache, alloc: CacheAllocation):
        self.kvc, self.alloc = kvc, alloc
        self.numerics = kvc.numerics
        self.config = kvc.cfg
        self._chunk: dict[tuple[int, str], tuple[int, torch.Tensor]] = {}

    # page tables as device tensors, made on first use (the batched attention never needs them)
    @functools.cached_property
    def _swa(self) -> torch.Tensor:
        return torch.tensor(self.alloc.swa, dtype=torch.long, device=self.kvc.device)

    @functools.cached_property
    def _blocks(self) -> torch.Tensor:
        return torch.tensor(self.alloc.blocks, dtype=torch.long, device=self.kvc.device)

    @property
    def num_tokens(self) -> int:
        return self.alloc.num_computed

    # ---- sliding-window KV ---------------------------------------------------------------
    def _swa_slots(self, positions):
        pages = self._swa[positions // SWA_PAGE]
        if bool((pages < 0).any()):
            raise RuntimeError(f"window KV of positions {positions.tolist()[:4]}… read after its page was freed")
        return pages, positions % SWA_PAGE

    def write_kv(self, layer, positions, kv):
        pages, off = self._swa_slots(positions)
        t = self.kvc.swa[layer]
        if self.numerics.quantized:
            write_kv(t, pages, off, kv.float(), self.numerics.fmt, SWA_PAGE)
        else:
            t[pages, off] = kv.to(t.dtype)

    def read_kv(self, layer, positions):
        pages, off = self._swa_slots(positions)
        t = self.kvc.swa[layer]
        if self.numerics.quantized:
            return read_kv(t, pages, off, self.numerics.fmt, SWA_PAGE).to(self.kvc.dtype)
        return t[pages, off]

    # ---- compressed KV and indexer keys --------------------------------------------------
    def write_compressed(self, layer, kind, index, entries):
        key = (layer, kind)
        per = self.kvc.per_block(key)
        blk, off = self._blocks[index // per], index % per
        t = self.kvc.comp[key]
        if not self.numerics.quantized:
            t[blk, off] = entries.to(t.dtype)
        elif kind == "kv":
            write_kv(t, blk, off, entries.float(), self.numerics.fmt, per, round_bf16=True)
        else:
            write_indexer_k(t, blk, off, entries.float(), self.numerics.fmt, per)

    def read_compressed(self, layer, kind, index):
        key = (layer, kind)
        per = self.kvc.per_block(key)
        blk, off = self._blocks[index // per], index % per
        t = self.kvc.comp[key]
        if not self.numerics.quantized:
            return t[blk, off]
        if kind == "kv":
            return read_kv(t, blk, off, self.numerics.fmt, per).to(self.kvc.dtype)
        return read_indexer_k(t, blk, off, self.numerics.fmt, per)[0].to(self.kvc.dtype)

    # ---- compressor state ----------------------------------------------------------------
    def write_state(self, layer, kind, positions, rows):
        self.hold_state(layer, kind, int(positions[0]), rows)

    def hold_state(self, layer, kind, start: int, rows):
        """State rows of positions start.. held aside until advance(): writing the ring now could
        overwrite rows this forward still reads (the previous block's rows for the ratio-4 overlap)."""
        self._chunk[(layer, kind)] = (start, rows.float())

    def read_state(self, layer, kind, positions):
        key = (layer, kind)
        start, rows = self._chunk.get(key, (None, None))
        ring = self.kvc.ring[key][self.alloc.slot]
        out = ring[positions % ring.shape[0]]
        if rows is not None:
            inside = (positions >= start) & (positions < start + rows.shape[0])
            if bool(inside.any()):
                out = out.clone()
                out[inside] = rows[positions[inside] - start]
        return out

    def _rows_at(self, key, positions: range) -> torch.Tensor:
        """``read_state`` for positions known on the host: each row from the held chunk where it
        covers the position, else from the ring — decided in Python, so no device→host wait (an 8K
        prefill snapshots 32 blocks × every ratio-4 state: ``read_state``'s masks cost 3 waits each)."""
        start, rows = self._chunk.get(key, (None, None))
        ring = self.kvc.ring[key][self.alloc.slot]
        return torch.stack(
            [
                rows[p - start] if rows is not None and start <= p < start + rows.shape[0] else ring[p % ring.shape[0]]
                for p in positions
            ]
        )

    def restore_boundary(self, block_index: int) -> None:
        """After a prefix hit ending at block ``block_index``: its last rows back into the rings."""
        p_end = (block_index + 1) * BLOCK
        pos = torch.arange(p_end - BOUNDARY_ROWS, p_end, device=self.kvc.device)
        blk = self.alloc.blocks[block_index]
        for key, b in self.kvc.boundary.items():
            ring = self.kvc.ring[key][self.alloc.slot]
            ring[pos % ring.shape[0]] = b[blk]

    def advance(self, n_tokens: int) -> None:
        """After a forward: the first ``n_tokens`` of the chunk are in the cache. Boundary state of
        the blocks that closed is snapshot, and only those tokens' state rows enter the ring.

        Fewer tokens than the forward computed is how a speculative step keeps its accepted
        tokens only: every other write of the rejected ones (window KV, compressed entries and
        indexer keys at their positions) lies at or past the new token count, where no query reads
        until the same position is computed again and overwrites it."""
        self.advance_many([(self, n_tokens)])

    @staticmethod
    def advance_many(views: list[tuple["PagedSequenceView", int]]) -> None:
        """``advance`` of several requests' views after one step: each view's bookkeeping as
        ``advance`` does it, and the held state rows of all of them committed into the rings with one
        index copy per compressor (a step of 16 chunks × 5 compressors: ~11 launches, not ~240)."""
        commits: dict = {}  # compressor key → [(ring slot, first position, rows)]
        for v, n_tokens in views:
            old = v.alloc.num_computed
            new = old + n_tokens
            for p_end in range((old // BLOCK + 1) * BLOCK, new + 1, BLOCK):
                blk = v.alloc.blocks[p_end // BLOCK - 1]
                for key, b in v.kvc.boundary.items():
                    b[blk] = v._rows_at(key, range(p_end - BOUNDARY_ROWS, p_end))
            for key, (start, rows) in v._chunk.items():  # the newest computed rows, for the ring
                n = max(0, min(new - start, rows.shape[0]))
                size = v.kvc.ring[key].shape[1]
                if n:
                    first = max(0, n - size)
                    commits.setdefault(key, []).append((v.alloc.slot, start + first, rows[first:n]))
            v._chunk.clear()
            v.alloc.num_computed = new
        if commits:
            _commit_rings(views[0][0].kvc, commits)


def _commit_rings(kvc: PagedKVCache, commits: dict) -> None:
    """Each compressor's held rows into its ring, one index copy per ring: row p of slot s goes to
    ``ring[s, p % size]`` (a view's rows are at most ``size`` consecutive positions, so no two writes
    of one copy land on the same row)."""
    flat, parts = array.array("q"), []
    for key, entries in commits.items():
        size = kvc.ring[key].shape[1]
        at = len(flat)
        for slot, p0, rows in entries:  # ≤ size positions from p0: at most two runs of ring rows
            base, first = slot * size, p0 % size
            end = first + rows.shape[0]
            flat.extend(range(base + first, base + min(end, size)))
            flat.extend(range(base, base + end - size))  # (the wrap; empty when there is none)
        parts.append((key, at, len(flat)))
    idx = torch.frombuffer(flat, dtype=torch.long)
    if kvc.device.type == "cuda":
        idx = idx.pin_memory().to(kvc.device, non_blocking=True)
    else:
        idx = idx.clone()  # (frombuffer shares the array's memory)
    for key, a, b in parts:
        ring = kvc.ring[key]
        rows = [r for _, _, r in commits[key]]
        src = rows[0] if len(rows) == 1 else torch.cat(rows)
        ring.view(-1, ring.shape[2])[idx[a:b]] = src
