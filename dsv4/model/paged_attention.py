"""The attention's sequence-dependent part for every token of a step at once, over the paged cache.

The reference attention (``Attention._attend``) runs it per request through a sequence cache —
exact, but a Python loop per request and host synchronisations in the codecs. ``attend`` does the
same work for the whole step, with the attention's op set:

- every token's window KV is normalized, roped and inserted at its (page, offset) by one op
  (``kv_norm_rope_insert``, from the raw wkv projection; with validation hooks installed the
  attention hands over the finished KV and ``kv_insert`` stores it);
- the compressors run once for all tokens of the step. Decode tokens' state rows go straight into
  the per-request rings (a CUDA graph's input); in a step with prefill chunks each chunk's rows are
  held by its cache view until the step ends (the ring keeps only the newest rows, and the prefix
  cache snapshots block boundaries from them). The entries of blocks that close are pooled from
  those rows and the ring and inserted for all requests together by one op
  (``compressor_pool_insert``: ring store, pooling, RMSNorm, RoPE, insert — the same op and
  arithmetic for decode and chunk steps, so an entry never depends on the chunking); invalid writes
  are skipped or go to a spare page, so there is no data-dependent branch and no host sync. A
  speculative verify graph (fixed chunks of k + 1 tokens) pools with a table listing every token
  and then stores all its rows into the rings (``model.step.ring_rows`` sizes them so that a
  rejected draft's row never overwrites one still read);
- the Lightning Indexer's queries are roped (and FP8 fake-quantized like the keys) by one op
  (``indexer_q_rope_quant``) and scored against their own request's paged indexer keys
  (``indexer``), and the sparse attention reads the window and the selected compressed entries from
  the pages in-kernel (``sparse_attention``).

``tables`` is the step's plain data (``dsv4.cache.tables.StepTables``: positions, request rows,
page and block tables, the cache tensors they index), built once per step on the host, so the ops
see only tensors and a token's result never depends on the other tokens of the step.
"""

from __future__ import annotations

import torch

from ..config import LayerType
from .rope import cos_sin
from .step import SWA_PAGE


def attend(attn, tables, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, kv: torch.Tensor | None,
           kv_raw: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, block: int = 0) -> torch.Tensor:
    """Everything ``Attention._attend`` does per chunk, for all tokens of the step at once.

    ``kv``: the window KV (normed and roped), or None: then ``kv_raw`` (the wkv projection) and the
    main rope's ``cos``/``sin`` go to ``kv_norm_rope_insert``, which computes and stores it in one op.
    ``block`` > 0: the tokens are DSpark draft blocks of that length (``Attention._attend_block``):
    their KV is stored at their positions like window KV — past the request's computed tokens, where
    the drafter's next context write overwrites it before any read — and each query reads the
    ``sliding_window`` positions before its block and all of the block: the window of the block's
    last position, ``block`` positions wider."""
    ops, cfg, layer = attn.ops, attn.cfg, attn.layer
    kvc = tables.kvc
    fmt = kvc.numerics.fmt if kvc.numerics.quantized else None
    insert_window_kv(attn, tables, kv, kv_raw, cos, sin)
    comp_pages, per = None, 1
    comp_idx = torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
    positions, window = tables.positions, cfg.sliding_window
    if block:
        if attn.compressor is not None:
            raise ValueError(f"layer {layer}: a DSpark draft block needs a window-only layer")
        row = torch.arange(q.shape[0], device=q.device) % block
        positions, window = positions + (block - 1 - row), window + block
    if attn.compressor is not None:
        _compress(attn.compressor, tables, x)
        if attn.type == LayerType.CSA:
            _compress(attn.idx_compressor, tables, x)
        n_max = tables.max_end // attn.ratio
        comp_pages, per = kvc.comp[(layer, "kv")], kvc.per_block((layer, "kv"))
        if n_max > 0:
            visible = (tables.positions + 1) // attn.ratio
            if attn.type == LayerType.CSA:
                comp_idx = _indexer(attn, tables, x, qr, visible, n_max)
            else:
                ar = torch.arange(n_max, device=q.device)
                comp_idx = torch.where(ar[None, :] < visible[:, None], ar[None, :], -1)
    return ops.sparse_attention(q, positions, tables.seq_ids, kvc.swa[layer], tables.swa_table, comp_pages,
                                tables.block_table, per, comp_idx, attn.sink, cfg.head_dim ** -0.5, window, fmt)


def insert_window_kv(attn, tables, kv: torch.Tensor | None, kv_raw: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
    """Store every token's window KV at its (page, offset) (page −1: skipped): from ``kv_raw`` by the
    fused ``kv_norm_rope_insert``, or, with validation hooks, the finished ``kv`` the hook saw."""
    ops, kvc, layer = attn.ops, tables.kvc, attn.layer
    fmt = kvc.numerics.fmt if kvc.numerics.quantized else None
    if kv is None:
        ops.kv_norm_rope_insert(kvc.swa[layer], tables.swa_page, tables.swa_off, kv_raw, attn.kv_norm,
                                attn.cfg.rms_norm_eps, cos, sin, fmt, SWA_PAGE)
        return
    if fmt is not None:
        ops.kv_insert(kvc.swa[layer], tables.swa_page, tables.swa_off, kv.float(), fmt, SWA_PAGE, False)
    else:
        pages = kvc.swa[layer]
        page = torch.where(tables.swa_page >= 0, tables.swa_page, pages.shape[0] - 1)  # masked: the spare page
        pages[page, tables.swa_off] = kv.to(pages.dtype)
    attn._check("k_window", kv)


def _compress(comp, tables, x: torch.Tensor) -> None:
    """What ``Compressor.run`` does per chunk, for every token of the step at once: a decode-only step
    stores its rows straight into the state rings and pools the closing entries from them
    (``compressor_pool_insert``'s decode form); a step with prefill chunks holds each chunk's state
    rows in its view until the step ends and pools every entry closing in the step from the step's
    rows (positions ≥ its chunk's start) and the ring (earlier positions), by the same op (its chunk
    form)."""
    rows = comp.state_rows(x, tables.positions)  # [T, 2·width] fp32
    if tables.decode_only:
        return _pool_insert(comp, tables, rows, None)
    if tables.static_closing is not None:  # a verify graph: pool, then every row into its ring
        _pool_insert(comp, tables, rows, tables.static_closing)
        ring = tables.kvc.ring[(comp.layer, comp.kind)]
        ring[tables.slots[tables.seq_ids], tables.positions % ring.shape[1]] = rows
        return None
    for c in tables.chunks:
        c.cache.hold_state(comp.layer, comp.kind, c.start, rows[c.offset: c.offset + c.length])
    closing = tables.closing(comp.ratio)
    if closing is not None:
        _pool_insert(comp, tables, rows, closing)


def _pool_insert(comp, tables, rows: torch.Tensor, closing) -> None:
    kvc = tables.kvc
    key = (comp.layer, comp.kind)
    numerics = kvc.numerics
    comp.ops.compressor_pool_insert(
        kvc.comp[key], kvc.ring[key], rows, tables.positions, tables.seq_ids, tables.slots, tables.block_table,
        closing, comp.norm, comp.cfg.rms_norm_eps, comp.cfg.rope_compress, comp.ratio, comp.overlap, comp.kind,
        numerics.fmt if numerics.quantized else None, kvc.per_block(key))


def _indexer(attn, tables, x, qr, visible, n_max: int) -> torch.Tensor:
    """Top-k compressed entries of every query, ascending, −1 last ([T, min(k, n_max)])."""
    ops, cfg, kvc = attn.ops, attn.cfg, tables.kvc
    t = x.shape[0]
    q = ops.linear(qr, attn.idx_wq_b, attn.act_quant).view(t, cfg.index_n_heads, cfg.index_head_dim)
    cos, sin = cos_sin(cfg.rope_compress, tables.positions)
    fmt = kvc.numerics.fmt if kvc.numerics.quantized else None
    q = ops.indexer_q_rope_quant(q, cos, sin, fmt)  # fp32; FP8 fake-quantized like the keys
    w = ops.linear(x, attn.idx_weights).float() * (cfg.index_n_heads ** -0.5) * (cfg.index_head_dim ** -0.5)
    key = (attn.layer, "index")
    n_cols = -(-n_max // 64) * 64  # fixed-width columns (a score never depends on the others)
    k = min(cfg.index_topk, n_max)
    return ops.indexer(q, w, tables.seq_ids, visible, kvc.comp[key], tables.block_table, kvc.per_block(key), n_cols,
                       k, fmt, ascending=True)
