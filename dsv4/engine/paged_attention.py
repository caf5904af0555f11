"""The engine's batched attention: one step's tokens of all requests attend over the paged tensors.

The reference attention (``dsv4.model.attention``) runs the sequence-dependent parts per request
through a :class:`~dsv4.cache.paged.PagedSequenceView` — exact, but a Python loop per request and
host synchronisations in the codecs. This path does the same work for the whole step at once:

- every token's window KV is normalized, roped and inserted at its (page, offset) by one op
  (``kv_norm_rope_insert``, from the raw wkv projection; with validation hooks installed the
  attention hands over the finished KV and ``kv_insert`` stores it);
- the compressors run once for all tokens of the step. Decode tokens' state rows go straight into
  the per-request rings (a CUDA graph's input); in a step with prefill chunks each chunk's rows
  are held by its view until the step ends (the ring keeps only the newest rows, and the prefix
  cache snapshots block boundaries from them). The entries of blocks that close are pooled from
  those rows and the ring and inserted for all requests together by one op
  (``compressor_pool_insert``: ring store, pooling, RMSNorm, RoPE, insert — the same op and
  arithmetic for decode and chunk steps, so an entry never depends on the chunking); invalid
  writes are skipped or go to a spare page, so there is no data-dependent branch and no host
  synchronisation;
- the Lightning Indexer's queries are roped (and FP8 fake-quantized like the keys) by one op
  (``indexer_q_rope_quant``) and scored against their own request's paged indexer keys
  (``indexer`` op) and the sparse attention reads the window and the selected compressed
  entries from the pages in-kernel (``sparse_attention`` op).

All tables are built once per step on the host (:class:`PagedBatch`), so the ops see only
tensors and a token's result never depends on the other tokens of the step.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field

import torch

from ..cache.paged import SWA_PAGE, PagedKVCache
from ..config import LayerType
from ..model.attention import SeqChunk
from ..model.linear import linear
from ..model.rope import cos_sin
from ..ops.torch_compressor import insert_dense
from .staging import upload

ATTENTION_OPS = ("kv_insert", "kv_norm_rope_insert", "compressor_pool_insert", "sparse_attention", "indexer",
                 "indexer_q_rope_quant")


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


def host_tables(chunks: list[SeqChunk], allocs) -> list:
    """A step's tables as host int64 parts (``staging.Part``), in the order of
    :meth:`PagedBatch.from_parts`: positions, seq_ids, swa_page, swa_off [T], slots [S],
    swa_table [S, n_swa], block_table [S, n_blocks]. Built with a few Python operations per
    request (per window page of a long chunk), not per table entry."""
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


def decode_tables(chunks: list[SeqChunk], allocs, lanes: int, n_swa: int, n_blocks: int, kvc: PagedKVCache):
    """``host_tables`` of a decode step laid out as a CUDA graph's static inputs: ``lanes`` rows
    (the lanes past the step spare: position 0, the spare page, block and slot) and tables of the
    graph's full widths, so the one staged copy lands in the graph's own tensors (nothing to
    ``load``). None if a request's page list is wider than the graph's tables."""
    n = len(chunks)
    swa_rows = [a.swa_row.sync(a.swa, a.swa_released) for a in allocs]
    blk_rows = [a.block_row.sync(a.blocks) for a in allocs]
    if max(map(len, swa_rows), default=0) > n_swa or max(map(len, blk_rows), default=0) > n_blocks:
        return None
    spare = lanes - n
    zeros = array.array("q", [0]) * spare
    pos, page, off = array.array("q"), array.array("q"), array.array("q")
    for c, row in zip(chunks, swa_rows):
        s = c.start
        pos.append(s)
        page.append(row[s // SWA_PAGE])
        off.append(s % SWA_PAGE)
    slots = array.array("q", [a.slot for a in allocs])
    pos.extend(zeros)
    off.extend(zeros)
    page.extend(array.array("q", [kvc.spare_swa_page]) * spare)
    slots.extend(array.array("q", [kvc.spare_slot]) * spare)
    # a real row is −1 past its pages (never read), a spare lane spare
    swa, _ = _pad_rows(swa_rows, n_swa, lanes, kvc.spare_swa_page)
    blocks, _ = _pad_rows(blk_rows, n_blocks, lanes, kvc.spare_block)
    return [(pos, (lanes,)), (array.array("q", range(lanes)), (lanes,)), (page, (lanes,)), (off, (lanes,)),
            (slots, (lanes,)), (swa, (lanes, n_swa)), (blocks, (lanes, n_blocks))]


@dataclass
class PagedBatch:
    """Per-step tables for the batched attention (host-built, device-resident)."""

    kvc: PagedKVCache
    chunks: list[SeqChunk]
    positions: torch.Tensor  # [T] absolute position of every token
    seq_ids: torch.Tensor  # [T] request row of every token
    swa_table: torch.Tensor  # [S, n_swa] window page of the request's 64-token page j (-1 freed)
    block_table: torch.Tensor  # [S, n_blocks] block of the request's 256-token block b
    slots: torch.Tensor  # [S] compressor-state slot of each request
    swa_page: torch.Tensor  # [T] where each token's window KV goes
    swa_off: torch.Tensor  # [T]
    decode_only: bool  # every chunk is one token (the batched compressor applies)
    max_end: int  # largest (start + length) of the step: bounds the compressed entries
    ops: dict
    _emitting: dict = field(default_factory=dict, repr=False)  # ratio → tokens that close a block

    @classmethod
    def build(cls, kvc: PagedKVCache, chunks: list[SeqChunk], allocs, ops: dict) -> "PagedBatch":
        """The step's tables, moved to the device in one copy (the engine's runner stages them with
        its other inputs instead: ``host_tables`` and ``from_parts``)."""
        return cls.from_parts(kvc, chunks, upload(host_tables(chunks, allocs), kvc.device), ops)

    @classmethod
    def from_parts(cls, kvc: PagedKVCache, chunks: list[SeqChunk], parts: list[torch.Tensor], ops: dict) -> "PagedBatch":
        """From the device tensors of ``host_tables``' parts."""
        positions, seq_ids, swa_page, swa_off, slots, swa_table, block_table = parts
        return cls(kvc, chunks, positions, seq_ids, swa_table, block_table, slots, swa_page, swa_off,
                   all(c.length == 1 for c in chunks), max(c.start + c.length for c in chunks), ops)

    @classmethod
    def spare(cls, kvc: PagedKVCache, tables: list[torch.Tensor], ops: dict, max_end: int) -> "PagedBatch":
        """Static decode tables (a CUDA graph's inputs: ``tables`` are the device tensors of
        ``decode_tables``' parts), filled as spare lanes; a step either lands its tables in them
        with the staged copy (``decode_tables``) or copies them in (``load``)."""
        positions, seq_ids, swa_page, swa_off, slots, swa_table, block_table = tables
        b = cls(kvc, [], positions, seq_ids, swa_table, block_table, slots, swa_page, swa_off, True, max_end, ops)
        seq_ids.copy_(torch.arange(positions.shape[0]))
        b.load(None)
        return b

    def load(self, step: "PagedBatch | None") -> None:
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
            mine[:n, :w].copy_(theirs[:, :w])
        self.slots[:n].copy_(step.slots)
        self.swa_page[:n].copy_(step.swa_page)
        self.swa_off[:n].copy_(step.swa_off)

    # ---- the attention of one layer ------------------------------------------------------
    def attend(self, attn, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, kv: torch.Tensor | None,
               kv_raw: torch.Tensor | None = None, cos: torch.Tensor | None = None,
               sin: torch.Tensor | None = None) -> torch.Tensor:
        """Everything ``Attention._attend`` does per chunk, for all tokens of the step at once.

        ``kv``: the window KV (normed and roped), or None: then ``kv_raw`` (the wkv projection) and the
        main rope's ``cos``/``sin`` go to ``kv_norm_rope_insert``, which computes and stores it in one op."""
        kvc, cfg, layer = self.kvc, attn.cfg, attn.layer
        numerics = kvc.numerics
        fmt = numerics.fmt if numerics.quantized else None
        if kv is None:  # the window KV of every token: norm, rope and insert in one op (page −1 skipped)
            self.ops["kv_norm_rope_insert"](kvc.swa[layer], self.swa_page, self.swa_off, kv_raw, attn.kv_norm,
                                            cfg.rms_norm_eps, cos, sin, fmt, SWA_PAGE)
        else:  # validation hooks: the unfused KV, which the hook sees
            if fmt is not None:
                self.ops["kv_insert"](kvc.swa[layer], self.swa_page, self.swa_off, kv.float(), fmt, SWA_PAGE, False)
            else:
                insert_dense(kvc.swa[layer], self.swa_page, self.swa_off, kv)
            attn._check("k_window", kv)
        comp_pages, per = None, 1
        comp_idx = torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
        if attn.compressor is not None:
            self._compress(attn.compressor, x)
            if attn.type == LayerType.CSA:
                self._compress(attn.idx_compressor, x)
            n_max = self.max_end // attn.ratio
            comp_pages, per = kvc.comp[(layer, "kv")], kvc.per_block((layer, "kv"))
            if n_max > 0:
                visible = (self.positions + 1) // attn.ratio
                if attn.type == LayerType.CSA:
                    comp_idx = self._indexer(attn, x, qr, visible, n_max)
                else:
                    ar = torch.arange(n_max, device=q.device)
                    comp_idx = torch.where(ar[None, :] < visible[:, None], ar[None, :], -1)
        return self.ops["sparse_attention"](q, self.positions, self.seq_ids, kvc.swa[layer], self.swa_table,
                                            comp_pages, self.block_table, per, comp_idx, attn.sink,
                                            cfg.head_dim ** -0.5, cfg.sliding_window, fmt)

    # ---- compressor ----------------------------------------------------------------------
    def _compress(self, comp, x: torch.Tensor) -> None:
        """What ``Compressor.run`` does per chunk, for every token of the step at once: a decode-only
        step stores its rows straight into the state rings and pools the closing entries from them
        (``compressor_pool_insert``'s decode form); a step with prefill chunks goes to
        ``_compress_chunks``."""
        if not self.decode_only:
            return self._compress_chunks(comp, x)
        self._pool_insert(comp, comp.state_rows(x, self.positions), None)

    def _compress_chunks(self, comp, x: torch.Tensor) -> None:
        """A step with prefill chunks: state rows of all tokens in one pass, held by each chunk's
        view until the step ends; every entry closing in the step pooled from the step's rows
        (positions ≥ its chunk's start) and the ring (earlier positions), by the same op as a
        decode step (``compressor_pool_insert``'s chunk form)."""
        rows = comp.state_rows(x, self.positions)  # [T, 2·width] fp32
        for c in self.chunks:
            c.cache.hold_state(comp.layer, comp.kind, c.start, rows[c.offset: c.offset + c.length])
        plan = self._closing(comp.ratio)
        if plan is not None:
            self._pool_insert(comp, rows, plan)

    def _pool_insert(self, comp, rows: torch.Tensor, closing) -> None:
        kvc = self.kvc
        key = (comp.layer, comp.kind)
        numerics = kvc.numerics
        self.ops["compressor_pool_insert"](
            kvc.comp[key], kvc.ring[key], rows, self.positions, self.seq_ids, self.slots, self.block_table, closing,
            comp.norm, comp.cfg.rms_norm_eps, comp.cfg.rope_compress, comp.ratio, comp.overlap, comp.kind,
            numerics.fmt if numerics.quantized else None, kvc.per_block(key))

    def _closing(self, r: int):
        """[4, E] device tensor (token index, its chunk's start, chunk offset, request row) of the
        step's tokens that close a compression block of ratio ``r``, or None; computed on the host
        from the chunks and copied without a host synchronisation."""
        if r not in self._emitting:
            start, length, offset = (torch.tensor(v, dtype=torch.long) for v in
                                     zip(*((c.start, c.length, c.offset) for c in self.chunks)))
            first = (start + r) // r * r - 1  # first position ≥ start with (p + 1) % r == 0
            count = ((start + length - first + r - 1) // r).clamp(min=0)  # closing positions per chunk
            seq = torch.repeat_interleave(torch.arange(len(self.chunks)), count)
            k = torch.arange(int(count.sum())) - torch.repeat_interleave(count.cumsum(0) - count, count)
            t = torch.stack([offset[seq] + first[seq] + k * r - start[seq], start[seq], offset[seq], seq])
            if t.shape[1] and self.kvc.device.type == "cuda":
                t = t.pin_memory().to(self.kvc.device, non_blocking=True)
            self._emitting[r] = t if t.shape[1] else None
        return self._emitting[r]

    # ---- Lightning Indexer ---------------------------------------------------------------
    def _indexer(self, attn, x, qr, visible, n_max: int) -> torch.Tensor:
        """Top-k compressed entries of every query, ascending, −1 last ([T, min(k, n_max)])."""
        cfg, kvc = attn.cfg, self.kvc
        t = x.shape[0]
        q = linear(qr, attn.idx_wq_b, attn.act_quant).view(t, cfg.index_n_heads, cfg.index_head_dim)
        cos, sin = cos_sin(cfg.rope_compress, self.positions)
        fmt = kvc.numerics.fmt if kvc.numerics.quantized else None
        q = self.ops["indexer_q_rope_quant"](q, cos, sin, fmt)  # fp32; FP8 fake-quantized like the keys
        w = linear(x, attn.idx_weights).float() * (cfg.index_n_heads ** -0.5) * (cfg.index_head_dim ** -0.5)
        key = (attn.layer, "index")
        n_cols = -(-n_max // 64) * 64  # fixed-width columns (a score never depends on the others)
        k = min(cfg.index_topk, n_max)
        return self.ops["indexer"](q, w, self.seq_ids, visible, kvc.comp[key], self.block_table,
                                   kvc.per_block(key), n_cols, k, fmt, ascending=True)
