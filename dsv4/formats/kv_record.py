"""The `fp8_ds_mla` KV record (584 B/token) and its block-packed page layout.

Record: 576-B data row (448 FP8 NoPE codes + 64 BF16 RoPE values) and an 8-B
scale row (7 UE8M0 bytes, one per 64-dim tile, + 1 zero byte). A page of B tokens
holds all B data rows first, then all B scale rows, padded to a multiple of 576.
"""
import torch

from . import _paging
from .fp8 import dequantize_fp8_pow2, get_fp8_format, quantize_fp8_pow2
from .indexer_record import (  # noqa: F401
    INDEXER_DIM,
    INDEXER_RECORD_BYTES,
    INDEXER_SCALE_BYTES,
    INDEXER_VALUE_BYTES,
    alloc_indexer_pages,
    fake_quant_indexer_k,
    indexer_page_stride,
    quantize_indexer_k,
    read_indexer_k,
    write_indexer_k,
)

KV_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
TILE = 64
N_TILES = 7
DATA_BYTES = 576
SCALE_BYTES = 8
RECORD_BYTES = 584
PAGE_ALIGN = 576

__all__ = [
    "KV_DIM", "NOPE_DIM", "ROPE_DIM", "TILE", "N_TILES", "DATA_BYTES", "SCALE_BYTES",
    "RECORD_BYTES", "PAGE_ALIGN", "page_bytes", "page_stride", "alloc_kv_pages", "quantize_kv",
    "dequantize_kv", "fake_quant_kv", "write_kv", "read_kv", "read_kv_raw",
    "INDEXER_DIM", "INDEXER_VALUE_BYTES", "INDEXER_SCALE_BYTES", "INDEXER_RECORD_BYTES",
    "indexer_page_stride", "alloc_indexer_pages", "quantize_indexer_k", "write_indexer_k",
    "read_indexer_k", "fake_quant_indexer_k",
]


def page_bytes(block_size: int) -> int:
    return block_size * RECORD_BYTES


def page_stride(block_size: int) -> int:
    """Natural block stride: page size rounded up to a multiple of 576 (64 -> 37440)."""
    return _paging.round_up(page_bytes(block_size), PAGE_ALIGN)


def alloc_kv_pages(num_blocks: int, block_size: int, device="cpu", stride=None) -> torch.Tensor:
    """Zeroed [num_blocks, block_size*584] uint8 view; stride(0) = stride or page_stride."""
    return _paging.alloc_pages(num_blocks, page_bytes(block_size),
                               stride or page_stride(block_size), device)


def quantize_kv(x: torch.Tensor, fmt, round_bf16: bool = False):
    """[..., 512] -> (data uint8 [..., 576], scale uint8 [..., 8]).

    round_bf16 mirrors the compressor path (fp32 -> bf16 -> fp32 before quantizing);
    the RoPE part is stored as bf16 either way.
    """
    fmt = get_fp8_format(fmt)
    if x.shape[-1] != KV_DIM:
        raise ValueError(f"expected last dim {KV_DIM}, got {x.shape[-1]}")
    codes, eb = quantize_fp8_pow2(x[..., :NOPE_DIM], TILE, fmt, round_bf16)
    rope = x[..., NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
    data = torch.cat((codes, rope), dim=-1)
    scale = torch.cat((eb, torch.zeros_like(eb[..., :1])), dim=-1)
    return data, scale


def dequantize_kv(data_u8: torch.Tensor, scale_u8: torch.Tensor, fmt) -> torch.Tensor:
    """(data [..., 576], scale [..., 8]) -> float32 [..., 512]."""
    nope = dequantize_fp8_pow2(data_u8[..., :NOPE_DIM], scale_u8[..., :N_TILES], TILE, fmt)
    rope = data_u8[..., NOPE_DIM:DATA_BYTES].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope, rope), dim=-1)


def fake_quant_kv(x: torch.Tensor, fmt, round_bf16: bool = False) -> torch.Tensor:
    """float32 values a reader of the cache sees for `x`."""
    return dequantize_kv(*quantize_kv(x, fmt, round_bf16), fmt)


def _data_start(offsets):
    return offsets.long() * DATA_BYTES


def _scale_start(offsets, block_size):
    return block_size * DATA_BYTES + offsets.long() * SCALE_BYTES


def write_kv(pages, block_ids, offsets, x, fmt, block_size: int, round_bf16: bool = False) -> None:
    """Quantize x [T, 512] and store token t at (block_ids[t], offsets[t]); negative slots skipped.

    Data row at byte offsets*576, scale row at block_size*576 + offsets*8 of the page.
    """
    _paging.check_pages(pages, page_bytes(block_size))
    block_ids, offsets, x = _paging.select_valid(block_ids, offsets, x, block_size)
    data, scale = quantize_kv(x, fmt, round_bf16)
    _paging.write_rows(pages, block_ids, _data_start(offsets), data)
    _paging.write_rows(pages, block_ids, _scale_start(offsets, block_size), scale)


def read_kv_raw(pages, block_ids, offsets, fmt=None, block_size=None):
    """(data uint8 [T, 576], scale uint8 [T, 8]) at the slots; padding slots read as zeros.

    fmt is accepted for symmetry with read_kv and ignored (raw bytes do not depend on it);
    read_kv_raw(pages, block_ids, offsets, block_size) also works.
    """
    if block_size is None and isinstance(fmt, int):
        fmt, block_size = None, fmt
    if block_size is None:
        raise TypeError("read_kv_raw needs block_size")
    _paging.check_pages(pages, page_bytes(block_size))
    valid = _paging.valid_slots(block_ids, offsets)
    data = _paging.read_rows(pages, block_ids, _data_start(offsets), DATA_BYTES, valid)
    scale = _paging.read_rows(pages, block_ids, _scale_start(offsets, block_size), SCALE_BYTES, valid)
    return data, scale


def read_kv(pages, block_ids, offsets, fmt, block_size: int) -> torch.Tensor:
    """float32 [T, 512] for the slots, using write_kv's address formula."""
    return dequantize_kv(*read_kv_raw(pages, block_ids, offsets, None, block_size), fmt)
