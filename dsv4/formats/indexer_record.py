"""Lightning-indexer K cache, FP8 variant: 128 FP8 codes + one fp32 power-of-two scale.

Page of B entries: all 128-B value rows first, then all 4-B scales (fp32, little
endian), padded to a multiple of 576 (B=64 -> 8640).
"""
import torch

from . import _paging
from .fp8 import decode_fp8, get_fp8_format, quantize_fp8_pow2
from .ue8m0 import ue8m0_decode

INDEXER_DIM = 128
INDEXER_VALUE_BYTES = 128
INDEXER_SCALE_BYTES = 4
INDEXER_RECORD_BYTES = 132
_ALIGN = 576


def indexer_page_stride(block_size: int) -> int:
    return _paging.round_up(block_size * INDEXER_RECORD_BYTES, _ALIGN)


def alloc_indexer_pages(num_blocks: int, block_size: int, device="cpu", stride=None) -> torch.Tensor:
    """Zeroed [num_blocks, block_size*132] uint8 view; stride(0) = stride or indexer_page_stride."""
    return _paging.alloc_pages(num_blocks, block_size * INDEXER_RECORD_BYTES,
                               stride or indexer_page_stride(block_size), device)


def quantize_indexer_k(x: torch.Tensor, fmt, round_bf16: bool = False):
    """[..., 128] -> (codes uint8 [..., 128], scale float32 [...]); scale = 2^e from fmt.quant_max."""
    if x.shape[-1] != INDEXER_DIM:
        raise ValueError(f"expected last dim {INDEXER_DIM}, got {x.shape[-1]}")
    codes, eb = quantize_fp8_pow2(x, INDEXER_DIM, get_fp8_format(fmt), round_bf16)
    return codes, ue8m0_decode(eb).squeeze(-1)


def _dequant(codes, scale, fmt):
    return decode_fp8(codes, fmt) * scale.unsqueeze(-1)


def fake_quant_indexer_k(x: torch.Tensor, fmt, round_bf16: bool = False) -> torch.Tensor:
    codes, scale = quantize_indexer_k(x, fmt, round_bf16)
    return _dequant(codes, scale, fmt)


def _value_start(offsets):
    return offsets.long() * INDEXER_VALUE_BYTES


def _scale_start(offsets, block_size):
    return block_size * INDEXER_VALUE_BYTES + offsets.long() * INDEXER_SCALE_BYTES


def write_indexer_k(pages, block_ids, offsets, x, fmt, block_size: int, round_bf16: bool = False) -> None:
    """Quantize x [T, 128] and store entry t at (block_ids[t], offsets[t]); negative slots skipped."""
    _paging.check_pages(pages, block_size * INDEXER_RECORD_BYTES)
    block_ids, offsets, x = _paging.select_valid(block_ids, offsets, x, block_size)
    codes, scale = quantize_indexer_k(x, fmt, round_bf16)
    scale_bytes = scale.float().unsqueeze(-1).contiguous().view(torch.uint8)
    _paging.write_rows(pages, block_ids, _value_start(offsets), codes)
    _paging.write_rows(pages, block_ids, _scale_start(offsets, block_size), scale_bytes)


def read_indexer_k(pages, block_ids, offsets, fmt, block_size: int):
    """(values float32 [T, 128], codes uint8 [T, 128], scale float32 [T]); padding reads as zeros."""
    _paging.check_pages(pages, block_size * INDEXER_RECORD_BYTES)
    valid = _paging.valid_slots(block_ids, offsets)
    codes = _paging.read_rows(pages, block_ids, _value_start(offsets), INDEXER_VALUE_BYTES, valid)
    raw = _paging.read_rows(pages, block_ids, _scale_start(offsets, block_size),
                            INDEXER_SCALE_BYTES, valid)
    scale = raw.contiguous().view(torch.float32).squeeze(-1)
    return _dequant(codes, scale, get_fp8_format(fmt)), codes, scale
