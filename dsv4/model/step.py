"""A forward's attention metadata, and the paged cache geometry it is laid out in.

Every attention layer of a forward reads one :class:`Step`, built once per step: the requests'
chunks in batch order (:class:`SeqChunk`) and every token's position. Its ``kind`` picks the
attention backend (``dsv4.model.attention.BACKENDS``): a plain :class:`Step` is the reference's,
each chunk through its own sequence cache; a :class:`PagedStep` adds the page tables the batched
attention reads over the paged cache (``dsv4.model.paged_attention``).

The geometry is vLLM's for this model: sliding-window KV in pages of ``SWA_PAGE`` tokens;
compressed entries, indexer keys and the boundary compressor rows in blocks of ``BLOCK`` tokens
(the prefix-cache unit); each request's running compressor state in rings (``ring_rows``).

A paged step's tables are built on the host as int64 arrays (a few Python operations per request,
not per table entry: ``CacheAllocation`` keeps host copies of its page lists) and moved to the
device with the caller's other int64 inputs in one copy (``PagedStep.stage``). A decode step that
a CUDA graph runs is laid out as the graph's static inputs (``decode_tables``: ``lanes`` rows, the
ones past the step *spare*, every entry pointing at the spare page, block and slot each cache
tensor has past its last real one, so whatever they compute never touches a request's pages).
"""

from __future__ import annotations

import array
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..config import LayerType, ModelConfig
from . import branches

# ---- the paged geometry ---------------------------------------------------------------------
SWA_PAGE = 64  # tokens of a sliding-window KV page
BLOCK = 256  # tokens of a block: compressed entries, indexer keys, boundary rows; the prefix-cache unit
BOUNDARY_ROWS = 4  # ratio-4 overlap: entry b needs block b-1's rows
RETAINED_SWA = 2  # SWA pages before a block end that cover the 128-token window (kept with a cached block)


def compressors(cfg: ModelConfig, layer: int) -> list[tuple[str, int, int]]:
    """(kind, ratio, state row width) of each compressor of a layer: what the cache keeps for it."""
    lt = cfg.layer_type(layer)
    if lt == LayerType.CSA:
        return [("kv", 4, 2 * 2 * cfg.head_dim), ("index", 4, 2 * 2 * cfg.index_head_dim)]
    if lt == LayerType.HCA:
        return [("kv", cfg.compress_ratio(layer), 2 * cfg.head_dim)]
    return []


def ring_rows(ratio: int, lookahead: int = 0) -> int:
    """Rows of a compressor's state ring. An entry closing at position c pools rows c − 2r + 1 .. c
    (ratio 4, with the overlap) or c − r + 1 .. c, so after a step whose last kept token is at a the
    rows from a − 2r + 2 (a − r + 2) on must survive. A speculative step run as a CUDA graph stores
    the rows of all its ``lookahead`` drafts, rejected ones too (the graph cannot know how many
    are accepted): a draft's row at a + j overwrites a + j − rows, so the ring keeps lookahead − 1
    more rows than the pooling reads."""
    base = 2 * ratio if ratio == 4 else ratio
    return base + max(0, lookahead - 1)


def table_widths(max_model_len: int) -> tuple[int, int]:
    """(window pages, blocks) of a request of ``max_model_len`` tokens: a CUDA graph's table widths."""
    return -(-max_model_len // SWA_PAGE), -(-max_model_len // BLOCK)


def window_slots(swa_table: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor):
    """(window page, offset) of each token, looked up on the device: its request's table entry, −1
    past the table."""
    col = positions // SWA_PAGE
    page = swa_table[seq_ids, col.clamp(max=swa_table.shape[1] - 1)]
    return torch.where(col < swa_table.shape[1], page, -1), positions % SWA_PAGE


# ---- tables of a forward's positions ----------------------------------------------------------
_FORWARD_TABLES: dict | None = None  # (key, id, version of positions) → (positions, value)


@contextmanager
def shared_tables():
    """Within the ``with`` body (one forward), ``per_forward`` tables of the same positions tensor are
    computed once. Only within one forward: a CUDA graph is captured from a forward run after two
    uncaptured ones on the same static inputs, and a table kept from those would be captured as a
    constant. The entry keeps the positions tensor alive and checks its version, so a tensor modified
    in place, or a new one at a reused address, is never served a stale table."""
    global _FORWARD_TABLES
    before, _FORWARD_TABLES = _FORWARD_TABLES, {}
    try:
        yield
    finally:
        _FORWARD_TABLES = before


def per_forward(key, positions: torch.Tensor, fn):
    """``fn(positions)``, shared by every caller of one forward that asks with the same ``key`` and
    positions tensor (outside ``shared_tables``: computed at every call)."""
    memo = _FORWARD_TABLES
    if memo is None:
        return fn(positions)
    k = (key, id(positions), positions._version)
    hit = memo.get(k)
    if hit is None or hit[0] is not positions:
        if branches.inside():  # made in a concurrent branch: another lane might read it unwritten
            return fn(positions)
        hit = memo[k] = (positions, fn(positions))
    return hit[1]


# ---- the metadata ---------------------------------------------------------------------------
@dataclass
class SeqChunk:
    """One sequence's slice of the batch: tokens [offset, offset+length) at positions start.."""

    cache: object
    start: int
    length: int
    offset: int = 0
    device: torch.device | str = "cpu"

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.length, device=self.device)


@dataclass
class Step:
    """What every attention layer of one forward reads. This kind is the reference's: each chunk
    attends through its own sequence cache (``Attention._attend``)."""

    kind: ClassVar[str] = "reference"
    chunks: list[SeqChunk]
    positions: torch.Tensor  # [T] absolute position of every token
    block: int = 0  # > 0: every chunk is a DSpark draft block of this length (non-causal inside it)

    def __post_init__(self):
        off = 0  # the chunks' offsets in the batch, in their order
        for c in self.chunks:
            c.offset = off
            off += c.length

    @classmethod
    def of(cls, chunks: list[SeqChunk], device) -> "Step":
        """The reference step of ``chunks``, their positions on ``device``."""
        for c in chunks:
            c.device = device
        return cls(chunks, torch.cat([c.positions for c in chunks]))

    def phase(self, ratio: int) -> torch.Tensor:
        """positions % ratio (a compressor's ape row of every token); within a forward
        (``shared_tables``) once per ratio rather than in each of a decode step's ~60 compressors."""
        return per_forward(("phase", ratio), self.positions, lambda p: p % ratio)

    def visible(self, ratio: int) -> torch.Tensor:
        """(positions + 1) // ratio: the compressed entries complete at each token; within a forward
        once per ratio, not once per layer."""
        return per_forward(("visible", ratio), self.positions, lambda p: (p + 1) // ratio)

    def all_visible(self, ratio: int, n: int) -> torch.Tensor:
        """[T, n] the compressed entries 0..visible−1 of every token, then −1: what a layer that reads them
        all (HCA) attends to; within a forward once per (ratio, n), not once per layer."""
        def table(p):
            ar = torch.arange(n, device=p.device)
            return torch.where(ar[None, :] < self.visible(ratio)[:, None], ar[None, :], -1)
        return per_forward(("all_visible", ratio, n), self.positions, table)


@dataclass(kw_only=True)
class PagedStep(Step):
    """A step over the paged cache ``kvc``: the tables the batched attention reads, on the device."""

    kind: ClassVar[str] = "paged"
    kvc: object  # the PagedKVCache the tables index
    seq_ids: torch.Tensor  # [T] request row of every token
    swa_table: torch.Tensor  # [S, n_swa] window page of the request's 64-token page j (-1 freed)
    block_table: torch.Tensor  # [S, n_blocks] block of the request's 256-token block b
    slots: torch.Tensor  # [S] compressor-state slot of each request
    swa_page: torch.Tensor  # [T] where each token's window KV goes
    swa_off: torch.Tensor  # [T]
    decode_only: bool  # every chunk is one token (the batched compressor applies)
    max_end: int  # largest (start + length) of the step: bounds the compressed entries
    # a verify graph's fixed [4, T] closing table listing every token (the op skips those that close
    # nothing); its steps store their state rows into the rings themselves (``paged_attention``)
    static_closing: torch.Tensor | None = None
    _emitting: dict = field(default_factory=dict, repr=False)  # ratio → tokens that close a block

    @classmethod
    def build(cls, kvc, chunks: list[SeqChunk], allocs) -> "PagedStep":
        """The step of ``chunks`` over ``allocs``' pages, its tables moved to the device in one copy."""
        return cls.stage(kvc, chunks, allocs, lambda parts: upload(parts, kvc.device))[0]

    @classmethod
    def stage(cls, kvc, chunks: list[SeqChunk], allocs, upload, parts: list[Part] = ()):
        """(the step, ``parts`` on the device): its tables go to the device in one copy with
        ``parts``, the caller's other int64 inputs (``upload``: a ``HostStaging.upload``)."""
        n = len(parts)
        tensors = upload(list(parts) + host_tables(chunks, allocs))
        return cls._of(kvc, chunks, tensors[n:], all(c.length == 1 for c in chunks),
                       max(c.start + c.length for c in chunks)), tensors[:n]

    @classmethod
    def stage_decode(cls, kvc, chunks: list[SeqChunk], allocs, upload, ids: array.array, lanes: int, n_swa: int,
                     n_blocks: int, into: torch.Tensor):
        """(the step, its token ids) of a decode step that a CUDA graph of ``lanes`` lanes runs: its
        ids and tables staged straight into the graph's static buffer ``into`` (the step's tensors
        are views of its first lanes; the seq_ids, 0..n-1, are also the step's logits rows). None if
        a request's page list is wider than the graph's tables."""
        tables = decode_tables(chunks, allocs, lanes, n_swa, n_blocks, kvc)
        if tables is None:
            return None
        n = len(chunks)
        ids = ids + array.array("q", [0]) * (lanes - n)
        token_ids, *tensors = (t[:n] for t in upload([(ids, (lanes,))] + tables, into=into))
        return cls._of(kvc, chunks, tensors, True, max(c.start + 1 for c in chunks)), token_ids

    @classmethod
    def spare(cls, kvc, tables: list[torch.Tensor], max_end: int) -> "PagedStep":
        """Static decode tables (a CUDA graph's inputs: ``tables`` are the device tensors of
        ``decode_tables``' parts, shaped as ``decode_shapes``), filled as spare lanes; a step
        either lands its tables in them with the staged copy (``stage_decode``) or copies them in
        (``load``)."""
        b = cls._of(kvc, [], tables, True, max_end)
        b.seq_ids.copy_(torch.arange(b.positions.shape[0]))
        b.load(None)
        return b

    @classmethod
    def _of(cls, kvc, chunks: list[SeqChunk], tables: list[torch.Tensor], decode_only: bool,
            max_end: int) -> "PagedStep":
        """From the device tensors of ``host_tables``' (or ``decode_tables``') parts, in their order."""
        positions, seq_ids, swa_page, swa_off, slots, swa_table, block_table = tables
        return cls(chunks, positions, kvc=kvc, seq_ids=seq_ids, swa_table=swa_table, block_table=block_table,
                   slots=slots, swa_page=swa_page, swa_off=swa_off, decode_only=decode_only, max_end=max_end)

    def load(self, step: "PagedStep | None") -> None:
        """Copy a decode step's tables into these static ones; the lanes past it become spare."""
        n = 0 if step is None else step.positions.shape[0]
        kvc = self.kvc
        self.positions.zero_()
        for mine, spare in ((self.swa_table, kvc.spare_swa_page), (self.block_table, kvc.spare_block)):
            mine.fill_(spare)
        self.slots.fill_(kvc.spare_slot)
        self.swa_page.fill_(kvc.spare_swa_page)
        self.swa_off.zero_()
        if step is None:
            return
        self.positions[:n].copy_(step.positions)
        for mine, theirs in ((self.swa_table, step.swa_table), (self.block_table, step.block_table)):
            w = min(mine.shape[1], theirs.shape[1])
            mine[:n].fill_(-1)  # a real row is −1 past its pages, as ``decode_tables`` stages it: the same bytes
            mine[:n, :w].copy_(theirs[:, :w])
        self.slots[:n].copy_(step.slots)
        self.swa_page[:n].copy_(step.swa_page)
        self.swa_off[:n].copy_(step.swa_off)

    def closing(self, r: int):
        """[4, E] device tensor (token index, its chunk's start, chunk offset, request row) of the
        step's tokens that close a compression block of ratio ``r``, or None; computed on the host
        from the chunks and copied without a host synchronisation."""
        if self.static_closing is not None:
            return self.static_closing
        if r not in self._emitting:
            cols = [array.array("q") for _ in range(4)]  # token index, chunk start, chunk offset, request row
            for i, c in enumerate(self.chunks):
                first = (c.start + r) // r * r - 1  # first position ≥ start with (p + 1) % r == 0
                tokens = range(c.offset + first - c.start, c.offset + c.length, r)
                cols[0].extend(tokens)
                for col, v in zip(cols[1:], (c.start, c.offset, i)):
                    col.extend(array.array("q", [v]) * len(tokens))
            t = None
            if cols[0]:
                t = torch.frombuffer(cols[0] + cols[1] + cols[2] + cols[3], dtype=torch.long).view(4, -1)
                cuda = self.kvc.device.type == "cuda"
                t = t.pin_memory().to(self.kvc.device, non_blocking=True) if cuda else t.clone()
            if branches.inside():  # as ``per_forward``: a branch's table is its own
                return t
            self._emitting[r] = t
        return self._emitting[r]


# ---- the host layout and the one-copy upload --------------------------------------------------
Part = tuple[array.array, tuple[int, ...]]  # an int64 array and the shape of its tensor


def pack(parts: list[Part]) -> torch.Tensor:
    """The parts end to end as one host int64 tensor (it shares the packed array's memory)."""
    flat = array.array("q")
    for a, _ in parts:
        flat.extend(a)
    if not flat:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(flat, dtype=torch.long)


def split(flat: torch.Tensor, parts: list[Part]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``parts`` (each contiguous)."""
    out, o = [], 0
    for a, shape in parts:
        out.append(flat[o:o + len(a)].view(shape))
        o += len(a)
    return out


def upload(parts: list[Part], device, into: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The parts as tensors on ``device`` with one copy (from pageable memory: for occasional
    callers; the engine's runner keeps a ``HostStaging``). ``into``: a device int64 buffer
    (a CUDA graph's static inputs) that receives the copy; the tensors are views of it."""
    flat = pack(parts)
    if into is None:
        return split(flat.to(device), parts)
    dest = _dest(into, flat.numel())
    dest.copy_(flat)
    return split(dest, parts)


def _dest(into: torch.Tensor, n: int) -> torch.Tensor:
    if into.dtype != torch.long or into.dim() != 1 or into.numel() < n:
        raise ValueError(f"staging target must be a 1-D int64 tensor of at least {n} values, got "
                         f"{into.dtype} {tuple(into.shape)}")
    return into[:n]


def _pad_rows(rows: list, width: int | None = None, lanes: int | None = None,
              spare: int = -1) -> tuple[array.array, int]:
    """Int64 arrays → one flat row-major array of [len(rows), width], padded with -1; ``width``
    defaults to the longest row (≥ 1). ``lanes`` > len(rows): that many rows, the ones past
    ``rows`` all ``spare``. Filled first, then each row copied into its slice (one memory copy
    per row)."""
    if width is None:
        width = max(1, max((len(r) for r in rows), default=1))
    n = len(rows)
    flat = array.array("q", [-1]) * (n * width)
    if lanes is not None and lanes > n:
        flat.extend(array.array("q", [spare]) * ((lanes - n) * width))
    o = 0
    for r in rows:
        flat[o:o + len(r)] = r if isinstance(r, array.array) else array.array("q", r)
        o += width
    return flat, width


def host_tables(chunks: list[SeqChunk], allocs) -> list[Part]:
    """A step's tables as host int64 parts, in the order ``PagedStep.stage`` reads them: positions,
    seq_ids, swa_page, swa_off [T], slots [S], swa_table [S, n_swa], block_table [S, n_blocks]. Built
    with a few Python operations per request (per window page of a long chunk), not per table entry."""
    pos, sid, page, off = (array.array("q") for _ in range(4))
    swa_rows = [a.swa_row.sync(a.swa, a.swa_released) for a in allocs]
    for i, (c, row) in enumerate(zip(chunks, swa_rows)):
        s, n = c.start, c.length
        if n == 1:  # a decode token
            pos.append(s)
            sid.append(i)
            page.append(row[s // SWA_PAGE])
            off.append(s % SWA_PAGE)
            continue
        pos.extend(range(s, s + n))
        sid.extend(array.array("q", [i]) * n)
        p = s
        while p < s + n:  # one window page at a time
            j = p // SWA_PAGE
            e = min((j + 1) * SWA_PAGE, s + n)
            page.extend(array.array("q", [row[j]]) * (e - p))
            off.extend(range(p - j * SWA_PAGE, e - j * SWA_PAGE))
            p = e
    t, b = len(pos), len(allocs)
    swa, n_swa = _pad_rows(swa_rows)
    blocks, n_blk = _pad_rows([a.block_row.sync(a.blocks) for a in allocs])
    return [(pos, (t,)), (sid, (t,)), (page, (t,)), (off, (t,)), (array.array("q", (a.slot for a in allocs)), (b,)),
            (swa, (b, n_swa)), (blocks, (b, n_blk))]


def decode_shapes(lanes: int, n_swa: int, n_blocks: int) -> list[tuple[int, ...]]:
    """The shapes of ``decode_tables``' parts: a decode graph's static tables."""
    return [(lanes,)] * 5 + [(lanes, n_swa), (lanes, n_blocks)]


def decode_tables(chunks: list[SeqChunk], allocs, lanes: int, n_swa: int, n_blocks: int, kvc):
    """``host_tables`` of a decode step laid out as a CUDA graph's static inputs: ``lanes`` rows
    (the lanes past the step spare: position 0, the spare page, block and slot) and tables of the
    graph's full widths, so the one staged copy lands in the graph's own tensors (nothing to
    ``load``). None if a request's page list is wider than the graph's tables."""
    rows = request_rows(allocs, lanes, n_swa, n_blocks, kvc)
    if rows is None:
        return None
    spare = lanes - len(chunks)
    zeros = array.array("q", [0]) * spare
    pos, page, off = array.array("q"), array.array("q"), array.array("q")
    for c, a in zip(chunks, allocs):  # (request_rows has brought each host page row up to date)
        s = c.start
        pos.append(s)
        page.append(a.swa_row.buf[s // SWA_PAGE])
        off.append(s % SWA_PAGE)
    pos.extend(zeros)
    off.extend(zeros)
    page.extend(array.array("q", [kvc.spare_swa_page]) * spare)
    return [(pos, (lanes,)), (array.array("q", range(lanes)), (lanes,)), (page, (lanes,)), (off, (lanes,))] + rows


def request_rows(allocs, lanes: int, n_swa: int, n_blocks: int, kvc):
    """The per-request parts of a CUDA graph's static inputs: slots [lanes], swa_table [lanes, n_swa],
    block_table [lanes, n_blocks] (a real row −1 past its pages, never read; a spare lane all spare).
    None if a page list is wider than the graph's tables."""
    swa_rows = [a.swa_row.sync(a.swa, a.swa_released) for a in allocs]
    blk_rows = [a.block_row.sync(a.blocks) for a in allocs]
    if max(map(len, swa_rows), default=0) > n_swa or max(map(len, blk_rows), default=0) > n_blocks:
        return None
    slots = array.array("q", [a.slot for a in allocs]) + array.array("q", [kvc.spare_slot]) * (lanes - len(allocs))
    swa, _ = _pad_rows(swa_rows, n_swa, lanes, kvc.spare_swa_page)
    blocks, _ = _pad_rows(blk_rows, n_blocks, lanes, kvc.spare_block)
    return [(slots, (lanes,)), (swa, (lanes, n_swa)), (blocks, (lanes, n_blocks))]
