"""The attention's sequence-dependent part for every token of a step at once, over the paged cache.

The reference attention (``Attention._attend``) runs it per request through a sequence cache —
exact, but a Python loop per request and host synchronisations in the codecs. ``PagedAttention``
(the backend of a ``PagedStep``) does the same work for the whole step, with the attention's op set:

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

The step's tables (``dsv4.model.step.PagedStep``: positions, request rows, page and block tables,
the cache tensors they index) are built once per step on the host, so the ops see only tensors and
a token's result never depends on the other tokens of the step.
"""

from __future__ import annotations

import torch

from ..config import LayerType
from .rope import cos_sin
from .step import SWA_PAGE

INDEXER_LANE = 2  # the indexer's head weights and scoring (lanes 0 and 1: the compressors)


class PagedAttention:
    """The backend of a ``PagedStep`` (``attention.AttentionBackend``): everything
    ``Attention._attend`` does per chunk, for all tokens of the step at once."""

    def attend(self, attn, step, x, cos, sin) -> torch.Tensor:
        """The window KV goes from ``kv_raw`` (the wkv projection) and the main rope's ``cos``/``sin``
        to ``kv_norm_rope_insert``, which computes and stores it in one op (with validation hooks,
        ``kv_insert`` stores the finished KV the hook saw). ``step.block`` > 0: the tokens are
        DSpark draft blocks of that length (``Attention._attend_block``): their KV is stored at
        their positions like window KV — past the request's computed tokens, where the drafter's
        next context write overwrites it before any read — and each query reads the
        ``sliding_window`` positions before its block and all of the block: the window of the
        block's last position, ``block`` positions wider.

        Concurrent branches (``ops.fork``, ``dsv4.model.branches``) beside the query projections:
        lane 0 the compressor and then the window KV insert, lane 1 the indexer's compressor, lane 2 its
        head weights and then its scoring (its query GEMM after the query latent, its logits after lane
        1's entries); the sparse attention joins them. The compressors start from before the latent's GEMM
        but are issued after it (``fork_point``): a graph launches the path the attention waits on
        first, instead of behind their GEMMs' programs."""
        ops, cfg, layer = attn.ops, attn.cfg, attn.layer
        kvc = step.kvc
        fmt = kvc.numerics.fmt if kvc.numerics.quantized else None
        comp_pages, per = None, 1
        comp_idx = torch.empty(x.shape[0], 0, dtype=torch.long, device=x.device)
        positions, window, block = step.positions, cfg.sliding_window, step.block
        if block:
            if attn.compressor is not None:
                raise ValueError(f"layer {layer}: a DSpark draft block needs a window-only layer")
            row = torch.arange(x.shape[0], device=x.device) % block
            positions, window = positions + (block - 1 - row), window + block
        n_max = 0 if attn.compressor is None else step.max_end // attn.ratio
        csa = attn.type == LayerType.CSA
        branches = []  # every one joined before the sparse attention
        start = ops.fork_point()
        qr, kv_raw = attn.latent(x)
        if attn.compressor is not None:  # they read x only: beside the projections
            branches.append(ops.fork(_compress, attn.compressor, step, x, lane=0, after=start))
            if csa:
                branches.append(ops.fork(_compress, attn.idx_compressor, step, x, lane=1, after=start))
        selected = None
        if csa and n_max > 0:
            # the heads' weights x·weights_projᵀ (× Hi^-0.5 × D^-0.5 in fp32 where the indexer op reads them, as
            # the oracle's), first on the scoring's lane: done before the query latent it then waits for
            weights = ops.fork(ops.linear, x, attn.idx_weights, lane=INDEXER_LANE, after=start)
            visible = step.visible(attn.ratio)  # the forward's tables, made here on the main path: shared
            cos_sin(cfg.rope_compress, step.positions)
            selected = ops.fork(_indexer, attn, step, qr, weights, branches[-1], visible, n_max, lane=INDEXER_LANE)
            branches += [weights, selected]
        kv = None if attn.hooks is None else attn.window_kv(kv_raw, cos, sin)
        branches.append(ops.fork(insert_window_kv, attn, step, kv, kv_raw, cos, sin, lane=0))
        q = attn.queries(qr, cos, sin)
        for b in branches:
            b.result()
        if attn.compressor is not None:
            comp_pages, per = kvc.comp[(layer, "kv")], kvc.per_block((layer, "kv"))
            if n_max > 0:
                comp_idx = selected.result() if csa else step.all_visible(attn.ratio, n_max)
        return ops.sparse_attention(q, positions, step.seq_ids, kvc.swa[layer], step.swa_table, comp_pages,
                                    step.block_table, per, comp_idx, attn.sink, cfg.head_dim ** -0.5, window, fmt)

    def store_kv(self, attn, step, kv_raw, cos, sin) -> None:
        insert_window_kv(attn, step, None, kv_raw, cos, sin)


def insert_window_kv(attn, step, kv: torch.Tensor | None, kv_raw: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
    """Store every token's window KV at its (page, offset) (page −1: skipped): from ``kv_raw`` by the
    fused ``kv_norm_rope_insert``, or, with validation hooks, the finished ``kv`` the hook saw."""
    ops, kvc, layer = attn.ops, step.kvc, attn.layer
    fmt = kvc.numerics.fmt if kvc.numerics.quantized else None
    if kv is None:
        ops.kv_norm_rope_insert(kvc.swa[layer], step.swa_page, step.swa_off, kv_raw, attn.kv_norm,
                                attn.cfg.rms_norm_eps, cos, sin, fmt, SWA_PAGE)
        return
    if fmt is not None:
        ops.kv_insert(kvc.swa[layer], step.swa_page, step.swa_off, kv.float(), fmt, SWA_PAGE, False)
    else:
        pages = kvc.swa[layer]
        page = torch.where(step.swa_page >= 0, step.swa_page, pages.shape[0] - 1)  # masked: the spare page
        pages[page, step.swa_off] = kv.to(pages.dtype)
    attn._check("k_window", kv)


def _compress(comp, step, x: torch.Tensor) -> None:
    """What ``Compressor.run`` does per chunk, for every token of the step at once: a decode-only step
    stores its rows straight into the state rings and pools the closing entries from them
    (``compressor_pool_insert``'s decode form); a step with prefill chunks holds each chunk's state
    rows in its view until the step ends and pools every entry closing in the step from the step's
    rows (positions ≥ its chunk's start) and the ring (earlier positions), by the same op (its chunk
    form). A decode-only step of a stacked [wkv; wgate] hands the op the GEMM's raw rows and ``ape``: the op
    forms the state rows in its ring store (the same values)."""
    if step.decode_only and comp.w_state is not None:
        return _pool_insert(comp, step, comp.raw_rows(x), None, ape=comp.ape)
    rows = comp.state_rows(x, step.phase(comp.ratio))  # [T, 2·width] fp32
    if step.decode_only:
        return _pool_insert(comp, step, rows, None)
    if step.static_closing is not None:  # a verify graph: pool, then every row into its ring
        _pool_insert(comp, step, rows, step.static_closing)
        ring = step.kvc.ring[(comp.layer, comp.kind)]
        ring[step.slots[step.seq_ids], step.positions % ring.shape[1]] = rows
        return None
    for c in step.chunks:
        c.cache.hold_state(comp.layer, comp.kind, c.start, rows[c.offset: c.offset + c.length])
    closing = step.closing(comp.ratio)
    if closing is not None:
        _pool_insert(comp, step, rows, closing)


def _pool_insert(comp, step, rows: torch.Tensor, closing, ape: torch.Tensor | None = None) -> None:
    kvc = step.kvc
    key = (comp.layer, comp.kind)
    numerics = kvc.numerics
    comp.ops.compressor_pool_insert(
        kvc.comp[key], kvc.ring[key], rows, step.positions, step.seq_ids, step.slots, step.block_table,
        closing, comp.norm, comp.cfg.rms_norm_eps, comp.cfg.rope_compress, comp.ratio, comp.overlap, comp.kind,
        numerics.fmt if numerics.quantized else None, kvc.per_block(key), ape=ape)


def _indexer(attn, step, qr, weights, entries, visible, n_max: int) -> torch.Tensor:
    """Top-k compressed entries of every query, ascending, −1 last ([T, min(k, n_max)]); ``weights``: the heads'
    weights (a branch of this lane), ``entries``: the indexer compressor's branch (lane 1), waited for where the
    scoring reads the entries it inserts."""
    ops, cfg, kvc = attn.ops, attn.cfg, step.kvc
    t = qr.shape[0]
    q = ops.linear(qr, attn.idx_wq_b, attn.act_quant).view(t, cfg.index_n_heads, cfg.index_head_dim)
    cos, sin = cos_sin(cfg.rope_compress, step.positions)
    fmt = kvc.numerics.fmt if kvc.numerics.quantized else None
    q = ops.indexer_q_rope_quant(q, cos, sin, fmt)  # fp32; FP8 fake-quantized like the keys
    w = weights.on_lane()
    entries.wait()
    key = (attn.layer, "index")
    n_cols = -(-n_max // 64) * 64  # fixed-width columns (a score never depends on the others)
    k = min(cfg.index_topk, n_max)
    return ops.indexer(q, w, step.seq_ids, visible, kvc.comp[key], step.block_table, kvc.per_block(key), n_cols,
                       k, fmt, ascending=True,
                       weight_scales=(cfg.index_n_heads ** -0.5, cfg.index_head_dim ** -0.5))
