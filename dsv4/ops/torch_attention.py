"""Reference (torch) backends of the paged attention ops, built from the oracle's own pieces.

* ``kv_insert``: ``dsv4.formats.write_kv`` on uint8 (``fp8_ds_mla``) pages, index assignment on
  dense ('auto') pages. Padding tokens (page id or offset < 0) are dropped with boolean indexing,
  which syncs with the host: fine for the reference, not capturable (the Triton op is).
* ``kv_norm_rope_insert``: the window KV's RMSNorm, RoPE and insert — exactly the oracle's
  ``apply_rope(rms_norm(kv_raw, w, eps), cos, sin)`` then ``kv_insert``, so the pages get the bytes the
  unfused path writes (the Triton op does the three in one launch).
* ``paged_sparse_attention``: every query's keys (its listed compressed entries, then its window
  positions max(0, p-w+1)..p) are read through ``read_kv`` / dense indexing into one table and the
  oracle's ``dsv4.model.attention.sparse_attention`` is called on it, so the keys, their order and
  the arithmetic are exactly those of ``Attention._attend``.
"""

from __future__ import annotations

import torch

from ..formats import RECORD_BYTES, get_fp8_format, read_kv, write_kv
from ..model.attention import left_align, sparse_attention
from ..model.norms import rms_norm
from ..model.opset import eager_only
from ..model.rope import apply_rope

__all__ = ["kv_insert", "kv_norm_rope_insert", "paged_sparse_attention", "gather_attention_keys", "swa_block_size"]

QUERY_BLOCK = 64  # queries gathered at a time (each gets its own copy of its keys)


@eager_only
def kv_insert(pages: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor, fmt=None,
              block_size: int | None = None, round_bf16: bool = False) -> None:
    """Store x [T, D] at (page_ids[t], offsets[t]); tokens with a negative page id or offset are skipped.

    uint8 pages: 584-byte records via ``write_kv`` (``block_size`` defaults to row bytes // 584);
    float pages [P, B, D]: ``x`` cast to the pages' dtype (fmt/block_size/round_bf16 unused).
    """
    if pages.dtype == torch.uint8:
        if fmt is None:
            raise ValueError("kv_insert: uint8 (fp8_ds_mla) pages need an FP8 format, got fmt=None")
        write_kv(pages, page_ids, offsets, x.float(), get_fp8_format(fmt),
                 block_size or pages.shape[1] // RECORD_BYTES, round_bf16)
        return
    if pages.dim() != 3 or x.dim() != 2 or x.shape[1] != pages.shape[2]:
        raise ValueError(f"kv_insert: dense pages [P, B, D] and x [T, D] expected, got pages "
                         f"{tuple(pages.shape)} and x {tuple(x.shape)}")
    keep = (page_ids >= 0) & (offsets >= 0)
    if bool((keep & (offsets >= pages.shape[1])).any()):
        raise IndexError(f"kv_insert: slot offset out of range for {pages.shape[1]} tokens per page")
    pages[page_ids[keep].long(), offsets[keep].long()] = x[keep].to(pages.dtype)


@eager_only
def kv_norm_rope_insert(pages: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor, kv_raw: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, fmt=None,
                        block_size: int | None = None) -> None:
    """Store ``apply_rope(rms_norm(kv_raw, norm_weight, eps), cos, sin)`` at (page_ids[t], offsets[t])
    with ``kv_insert`` (negative slots skipped). kv_raw [T, 512]: the wkv projection in the compute
    dtype; cos/sin [T, 32] fp32 (``dsv4.model.rope.cos_sin``). ``rms_norm`` is the oracle's (the
    kernel standing in for it inside a fast forward, if any)."""
    kv_insert(pages, page_ids, offsets, apply_rope(rms_norm(kv_raw, norm_weight, eps), cos, sin), fmt, block_size)


def swa_block_size(pages: torch.Tensor) -> int:
    """Tokens per window page: B of dense [P, B, D] pages, row bytes // 584 for uint8 pages."""
    return pages.shape[1] if pages.dtype != torch.uint8 else pages.shape[1] // RECORD_BYTES


def _read(pages, page, off, fmt, block_size):
    """float keys [n, 512] at (page, off); slots with page < 0 read as zeros."""
    if pages.dtype == torch.uint8:
        return read_kv(pages, page, off, get_fp8_format(fmt), block_size)
    ok = page >= 0
    rows = pages[torch.where(ok, page, 0).long(), off.long()]
    return torch.where(ok[:, None], rows, torch.zeros_like(rows))


def _read_unique(pages, page, off, valid, fmt, block_size):
    """(keys [u, 512], row [n]): each distinct slot read once (a prefill's queries share most of their
    window: one copy of a key per query otherwise), and each slot's row in them (−1 where not ``valid``;
    a valid slot on page −1 reads as zeros, as ``_read`` reads it)."""
    slot = torch.where(page >= 0, page.long() * block_size + off.long(), -1)
    uniq, row = torch.unique(slot, return_inverse=True)
    keys = _read(pages, torch.where(uniq >= 0, uniq // block_size, -1), uniq.clamp(min=0) % block_size, fmt,
                 block_size)
    return keys, torch.where(valid, row, -1)


def gather_attention_keys(positions, seq_ids, swa_pages, swa_table, comp_pages, block_table, entries_per_block,
                          comp_idx, window: int, fmt):
    """(table [n, 512], idx [T, L]) with L = Lc + window: query t's keys are the table rows idx[t] lists,
    left-aligned — its valid compressed entries in list order, then its window positions ascending (−1
    padding), as ``Attention._attend`` orders them. Each distinct slot is one row of the table (at least
    one row).

    Raises if a window position of a query lies on a freed page (−1), as the paged view does.
    """
    T, Lc = comp_idx.shape
    dev = positions.device
    pos = positions.long()
    sid = seq_ids.long()
    sb = swa_block_size(swa_pages)
    wpos = pos[:, None] - (window - 1) + torch.arange(window, device=dev)[None, :]  # [T, w]
    wvalid = wpos >= 0
    wp = wpos.clamp(min=0)
    wpage = torch.where(wvalid, swa_table.long()[sid[:, None], wp // sb], -1)
    if bool((wvalid & (wpage < 0)).any()):
        bad = (wvalid & (wpage < 0)).nonzero()[0].tolist()
        raise RuntimeError(f"paged_sparse_attention: query {bad[0]} (position {int(pos[bad[0]])}) reads window "
                           f"position {int(wpos[bad[0], bad[1]])}, whose page was freed (−1)")
    wkeys, rows = _read_unique(swa_pages, wpage.flatten(), (wp % sb).flatten(), wvalid.flatten(), fmt, sb)
    rows = rows.view(T, window)
    if Lc:
        e = comp_idx.long()
        cvalid = e >= 0
        ec = e.clamp(min=0)
        cpage = torch.where(cvalid, block_table.long()[sid[:, None], ec // entries_per_block], -1)
        ckeys, crows = _read_unique(comp_pages, cpage.flatten(), (ec % entries_per_block).flatten(),
                                    cvalid.flatten(), fmt, entries_per_block)
        rows = torch.cat([crows.view(T, Lc), torch.where(rows >= 0, rows + ckeys.shape[0], -1)], dim=1)
        table = torch.cat([ckeys.to(wkeys.dtype), wkeys])
    else:
        table = wkeys
    return table, left_align(rows)


@eager_only
def paged_sparse_attention(q, positions, seq_ids, swa_pages, swa_table, comp_pages, block_table,
                           entries_per_block, comp_idx, sink, scale, window, fmt) -> torch.Tensor:
    """out [T, H, 512] in q's dtype: the oracle's sparse attention over each query's paged keys.

    q [T, H, 512]; positions [T]; seq_ids [T] (row of swa_table / block_table); swa_pages: the layer's
    window pages (uint8 records, 64 tokens a page, or dense [P, 64, 512]); comp_pages: compressed
    entries, entry e in page block_table[s, e // entries_per_block] at offset e % entries_per_block
    (None when comp_idx has no columns); comp_idx [T, Lc] entry ids, −1 padding; sink [H] fp32;
    fmt: the FP8 format of uint8 pages (None for dense pages).
    """
    out = torch.empty_like(q)
    for s in range(0, q.shape[0], QUERY_BLOCK):  # bounded memory; a query's result does not depend on its block
        sl = slice(s, s + QUERY_BLOCK)
        table, idx = gather_attention_keys(positions[sl], seq_ids[sl], swa_pages, swa_table, comp_pages,
                                           block_table, entries_per_block, comp_idx[sl], int(window), fmt)
        out[sl] = sparse_attention(q[sl], table, idx, sink, float(scale))
    return out
