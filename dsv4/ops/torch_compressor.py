"""Reference (torch) backend of ``compressor_pool_insert``: the batched compressor's pooling and insert.

The arithmetic is that of the oracle's ``dsv4.model.attention.Compressor.run``: per closing entry e
of ratio r, the block's r state rows (and, for the ratio-4 overlap, the previous block's r rows:
their first ``dim`` channels, kv 0 / score −inf for entry 0) → a per-channel softmax over the rows
in float64, rounded to fp32 → Σ kv·w in fp32 → RMSNorm (``rms_norm``) → RoPE at position e·r
(``cos_sin`` / ``apply_rope``) → the entry written into the compressed pages. Every write is
sync-free: masked entries (page −1) go to the spare page past the pool's last page, so the op can
be captured in a CUDA graph (the Triton backend skips them instead).

Two forms, one arithmetic (an entry does not depend on which form pooled it):

* decode (``closing=None``): row t is the single token of request ``seq_ids[t]``; it is stored into
  the state ring at ``ring[slots[seq_ids[t]], positions[t] % ring.shape[1]]`` and every token that
  closes a block pools its entry from the ring;
* chunk (``closing`` = the [4, E] table of ``PagedStep.closing``: token index, its chunk's start,
  the chunk's row offset, request row): nothing is stored; rows at positions ≥ the chunk's start
  come from ``rows``, earlier ones from the ring. A listed token that closes no block is skipped,
  so a fixed-shape table may list every token of the step (a verify graph's).
"""

from __future__ import annotations

import torch

from ..formats import _paging, quantize_indexer_k, quantize_kv
from ..formats.indexer_record import INDEXER_VALUE_BYTES
from ..formats.indexer_record import _scale_start as _idx_scale_start
from ..formats.kv_record import DATA_BYTES
from ..formats.kv_record import _scale_start as _kv_scale_start
from ..model.norms import rms_norm
from ..model.opset import eager_only
from ..model.rope import apply_rope, cos_sin

__all__ = ["compressor_pool_insert", "pool", "insert_entries", "insert_dense", "spare_ids"]


@eager_only
def compressor_pool_insert(pages: torch.Tensor, ring: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                           seq_ids: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor,
                           closing: torch.Tensor | None, norm: torch.Tensor, eps: float, rope, ratio: int,
                           overlap: bool, kind: str, fmt, block_size: int, ape: torch.Tensor | None = None) -> None:
    """Store the step's state rows (decode form) and pool + insert every entry that closes.

    pages: the compressor's compressed pages (uint8 records of ``kind`` "kv" / "index" in FP8 format
    ``fmt``, or dense [P, block_size, dim] when ``fmt`` is None); ring [S+1, size, 2·width] fp32;
    rows [T, 2·width] fp32 (``Compressor.state_rows``); positions, seq_ids [T]; slots [S];
    block_table [S, n_blocks]; norm [dim]; rope: ``cfg.rope_compress``; block_size: entries per page.
    ``ape`` [ratio, width] (decode form only): ``rows`` are the raw [wkv; wgate] GEMM outputs (any float
    dtype) and the state rows are formed here as ``Compressor.state_rows`` forms them: rows in fp32, the
    score half plus ape[position % ratio] (on the fast path the kernel does it: no conversion, gather and
    add launches per compressor).
    """
    r = ratio
    if ape is not None:
        rows = state_rows_from(rows, ape, positions, ratio, closing)
    if closing is None:
        size = ring.shape[1]
        pos = positions
        slot = slots[seq_ids]
        ring[slot, pos % size] = rows  # a decode row never overwrites a row still needed
        emits = (pos + 1) % r == 0
        e = ((pos + 1) // r - 1).clamp(min=0)  # the entry this token closes (valid where emits)
        rows_pos = e[:, None] * r + torch.arange(r, device=rows.device)[None, :]  # [T, r]
        cur = ring[slot[:, None], rows_pos % size]  # [T, r, 2·width]
        prev = ring[slot[:, None], (rows_pos - r) % size] if overlap else None
        page = torch.where(emits, block_table[seq_ids, e // block_size], -1)
    else:
        tok, c_start, c_off, seq = closing
        e = (positions[tok] + 1) // r - 1
        back = r if overlap else 0  # the overlap also pools the previous block's rows
        need = e[:, None] * r + torch.arange(-back, r, device=rows.device)[None, :]  # [E, back + r] positions
        step_rows = rows[(c_off[:, None] + need - c_start[:, None]).clamp(0, rows.shape[0] - 1)]
        ring_rows = ring[slots[seq][:, None], need % ring.shape[1]]
        got = torch.where((need >= c_start[:, None])[..., None], step_rows, ring_rows)
        cur, prev = got[:, back:], (got[:, :back] if overlap else None)
        emits = (positions[tok] + 1) % r == 0  # a listed token that closes no block writes nothing
        page = torch.where(emits, block_table[seq, e.clamp(min=0) // block_size], -1)
    entries = pool(cur, prev, e, norm, eps, rope, r)
    insert_entries(pages, page, e % block_size, entries, kind, fmt, block_size)


def state_rows_from(raw: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor, ratio: int, closing) -> torch.Tensor:
    """The state rows [T, 2·width] fp32 from the raw [wkv; wgate] outputs: ``Compressor.state_rows``'s
    arithmetic (the score half plus ape[position % ratio] in fp32, the kv half as it is)."""
    if closing is not None:
        raise ValueError("compressor_pool_insert: ape (raw rows) is taken by the decode form only (closing=None)")
    width = raw.shape[1] // 2
    if tuple(ape.shape) != (ratio, width):
        raise ValueError(f"compressor_pool_insert: ape must be [ratio, width] = {(ratio, width)}, "
                         f"got {tuple(ape.shape)}")
    rows = raw.float()
    rows[:, width:].add_(ape[positions % ratio])
    return rows


def pool(cur: torch.Tensor, prev: torch.Tensor | None, e: torch.Tensor, norm: torch.Tensor, eps: float, rope,
         ratio: int) -> torch.Tensor:
    """Entries e [N, dim] from their block's state rows ``cur`` [N, r, 2·width] (and, for the ratio-4
    overlap, the previous block's ``prev``): the arithmetic of ``Compressor.run``."""
    d = norm.shape[0]
    width = cur.shape[-1] // 2
    kv, score = cur[..., :width], cur[..., width:]
    if prev is not None:
        has_prev = (e > 0)[:, None, None]
        prev_kv = torch.where(has_prev, prev[..., :d], 0.0)
        prev_sc = torch.where(has_prev, prev[..., width: width + d], float("-inf"))
        kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
        score = torch.cat([prev_sc, score[..., d:]], dim=1)
    if score.is_cuda:  # the rows contiguous: the softmax over dim 1 of [N, r, d] ran as a strided
        # kernel with d threads looping over r (35-55 µs a call on the H200, r = 128 for HCA)
        weights = torch.softmax(score.double().transpose(1, 2), dim=-1).transpose(1, 2).float()
    else:
        weights = torch.softmax(score.double(), dim=1).float()
    pooled = (kv * weights).sum(dim=1)
    normed = rms_norm(pooled, norm, eps)
    cos, sin = cos_sin(rope, e * ratio)
    return apply_rope(normed, cos, sin)


# ---- sync-free writers (masked rows go to the spare page past the pool's last page) ----------
def spare_ids(pages: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Page ids with −1 sent to the spare page every cache tensor has past its last real page."""
    return torch.where(page_ids >= 0, page_ids, pages.shape[0] - 1)


def insert_dense(pages, page_ids, offsets, rows) -> None:
    pages[spare_ids(pages, page_ids), offsets] = rows.to(pages.dtype)


def insert_entries(pages, page_ids, offsets, entries, kind: str, fmt, block_size: int) -> None:
    """Compressed entries at (page, offset): ``fp8_ds_mla`` records bf16-rounded first (kind "kv",
    as ``write_kv(..., round_bf16=True)``), indexer key records not rounded (kind "index", as
    ``write_indexer_k``), or dense rows (``fmt`` None)."""
    if fmt is None or pages.dtype != torch.uint8:
        return insert_dense(pages, page_ids, offsets, entries)
    ids = spare_ids(pages, page_ids)
    if kind == "kv":
        data, scale = quantize_kv(entries.float(), fmt, round_bf16=True)
        _paging.write_rows(pages, ids, offsets.long() * DATA_BYTES, data)
        _paging.write_rows(pages, ids, _kv_scale_start(offsets, block_size), scale)
    elif kind == "index":
        codes, scale = quantize_indexer_k(entries.float(), fmt)  # indexer keys are not bf16-rounded
        _paging.write_rows(pages, ids, offsets.long() * INDEXER_VALUE_BYTES, codes)
        _paging.write_rows(pages, ids, _idx_scale_start(offsets, block_size),
                           scale.float().unsqueeze(-1).contiguous().view(torch.uint8))
    else:
        raise ValueError(f"compressor_pool_insert: kind must be 'kv' or 'index', got {kind!r}")
