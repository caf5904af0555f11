"""The ``indexer`` op in plain torch, built from the oracle's pieces (the reference backend).

Same signatures as ``dsv4.ops.triton.indexer``. Keys are read through the cache codec
(``read_indexer_k`` for FP8 pages, plain indexing for dense pages) and scored exactly as
``Attention.indexer_topk`` does: an fp32 ``linear`` of all heads' q against the keys zero-padded to
a multiple of 64 columns, ReLU, times the head weights, summed over heads; then a stable top-k.
On CPU this reproduces the oracle bitwise. It loops over the sequences of the batch (host sync):
a reference, not a fast path.
"""

from __future__ import annotations

import torch

from ..formats import fake_quant_fp8_pow2, get_fp8_format, read_indexer_k
from ..model.linear import linear, stable_topk
from ..model.opset import eager_only
from ..model.rope import apply_rope

__all__ = ["indexer_logits", "indexer_topk", "paged_indexer_topk", "indexer_q_rope_quant"]


@eager_only
def indexer_q_rope_quant(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fmt=None) -> torch.Tensor:
    """The indexer query as the scorer reads it (float32 [T, H, D]): RoPE on the trailing dims
    (``apply_rope``, rounded to q's dtype); with an FP8 cache (``fmt`` not None) also rounded to bf16
    and fake-quantized per (token, head) with a power-of-two scale, as the keys are stored.

    q [T, H, D] in the compute dtype, cos/sin [T, R/2] fp32. The torch backend of
    ``indexer_q_rope_quant``: the paged batch's former inline code (~40 small kernels a CSA layer)."""
    q = apply_rope(q, cos, sin).float()
    if fmt is not None:
        q = fake_quant_fp8_pow2(q.to(torch.bfloat16).float(), q.shape[-1], fmt)
    return q

COL_PAD = 64  # the oracle's fixed-width key columns


def _keys(idx_pages, table_row, n_keys: int, width: int, entries_per_block: int, fmt) -> torch.Tensor:
    """fp32 [width, 128]: entries 0..n_keys-1 of one sequence, zeros after (and for unmapped blocks)."""
    dev = table_row.device
    e = torch.arange(width, device=dev)
    b = e // entries_per_block
    inside = (e < n_keys) & (b < table_row.shape[0])
    blk = torch.where(inside, table_row[b.clamp(max=max(table_row.shape[0] - 1, 0))].long(), -1)
    off = e % entries_per_block
    if fmt is not None:
        return read_indexer_k(idx_pages, blk, off, fmt, entries_per_block)[0]
    ok = blk >= 0
    rows = idx_pages[blk.clamp(min=0), off].float()
    return torch.where(ok[:, None], rows, torch.zeros_like(rows))


def scaled_weights(weights: torch.Tensor, scales: tuple[float, ...] = ()) -> torch.Tensor:
    """The head weights in fp32 times each of ``scales`` in order, one fp32 rounding each (the model's
    ``w.float() * Hi^-0.5 * D^-0.5``): the ops take the factors so that a backend can apply them where it
    reads the weights instead of in launches of their own."""
    w = weights.float()
    for s in scales:
        w = w * s
    return w


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, seq_ids: torch.Tensor, n_visible: torch.Tensor,
                   idx_pages: torch.Tensor, block_table: torch.Tensor, entries_per_block: int, n_cols: int,
                   fmt, *, weight_scales: tuple[float, ...] = (), **_) -> torch.Tensor:
    """fp32 [T, n_cols] indexer logits, −inf at columns ≥ n_visible[t]; the head weights are
    ``scaled_weights(weights, weight_scales)``."""
    t, h, d = q.shape
    weights = scaled_weights(weights, weight_scales)
    if fmt is not None:
        fmt = get_fp8_format(fmt)
    out = torch.full((t, n_cols), float("-inf"), dtype=torch.float32, device=q.device)
    if t == 0 or n_cols == 0:
        return out
    width = -(-n_cols // COL_PAD) * COL_PAD
    cols = torch.arange(n_cols, device=q.device)
    for s in torch.unique(seq_ids).tolist():  # tokens of one sequence share its keys
        rows = (seq_ids == s).nonzero().squeeze(1)
        nv = n_visible[rows].long()
        n_keys = min(int(nv.max()), n_cols)
        k = _keys(idx_pages, block_table[s], n_keys, width, entries_per_block, fmt)
        scores = linear(q[rows].float().reshape(-1, d), k)[:, :n_cols].view(len(rows), h, n_cols)
        logits = (scores.relu() * weights[rows].float()[:, :, None]).sum(dim=1)
        out[rows] = logits.masked_fill(cols[None, :] >= nv[:, None], float("-inf"))
    return out


def indexer_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [T, k]: ``stable_topk`` (descending, ties to the lowest column), −1 for −inf picks
    and for the columns past n_cols when k > n_cols."""
    t, n = logits.shape
    kk = min(k, n)
    idx = stable_topk(logits, kk)
    idx = torch.where(torch.gather(logits, 1, idx) == float("-inf"), torch.full_like(idx, -1), idx)
    if kk < k:
        idx = torch.cat([idx, idx.new_full((t, k - kk), -1)], dim=1)
    return idx


def ascending_picks(sel: torch.Tensor, n_cols: int) -> torch.Tensor:
    """``indexer_topk``'s picks in ascending column order, −1 last."""
    order = torch.sort(torch.where(sel >= 0, sel, n_cols), dim=1).values
    return torch.where(order >= n_cols, -1, order)


@eager_only
def paged_indexer_topk(q, weights, seq_ids, n_visible, idx_pages, block_table, entries_per_block: int,
                       n_cols: int, k: int, fmt, *, ascending: bool = False, weight_scales: tuple[float, ...] = (),
                       **_) -> torch.Tensor:
    """The ``indexer`` op: top-k visible compressed entries per query, [T, k] int64, −1 padded;
    ``ascending``: the same set in ascending column order, −1 last; the head weights: ``scaled_weights``."""
    sel = indexer_topk(indexer_logits(q, weights, seq_ids, n_visible, idx_pages, block_table,
                                      entries_per_block, n_cols, fmt, weight_scales=weight_scales), k)
    return ascending_picks(sel, n_cols) if ascending else sel
