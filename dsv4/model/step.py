"""The paged cache's geometry, in one place (vLLM's for this model).

Sliding-window KV in pages of ``SWA_PAGE`` tokens; compressed entries, indexer keys and the boundary
compressor rows in blocks of ``BLOCK`` tokens (the prefix-cache unit); each request's running
compressor state in rings (``ring_rows``). The cache allocates its tensors from it
(``dsv4.cache.paged``), the step tables and the CUDA graphs lay their tables out by it.
"""

from __future__ import annotations

import torch

from ..config import LayerType, ModelConfig

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
