"""Exact numeric-format codecs: FP8 (OCP/FNUZ), UE8M0, MXFP4, block-FP8 weights, KV records."""
from .block_fp8 import dequantize_block_fp8, quantize_block_fp8
from .fp8 import (FNUZ, OCP, FP8Format, as_ue8m0_bytes, decode_fp8, dequantize_fp8_pow2,
                  encode_fp8, encode_fp8_bits, fake_quant_fp8_pow2, fp8_lut, get_fp8_format, pow2_scale_exponent, quantize_fp8_pow2,
                  ue8m0_decode, ue8m0_encode)
from .kv_record import (DATA_BYTES, INDEXER_DIM, INDEXER_RECORD_BYTES, INDEXER_SCALE_BYTES,
                        INDEXER_VALUE_BYTES, KV_DIM, N_TILES, NOPE_DIM, PAGE_ALIGN, RECORD_BYTES,
                        ROPE_DIM, SCALE_BYTES, TILE, alloc_indexer_pages, alloc_kv_pages,
                        dequantize_kv, fake_quant_indexer_k, fake_quant_kv, indexer_page_stride,
                        page_bytes, page_stride, quantize_indexer_k, quantize_kv, read_indexer_k,
                        read_kv, read_kv_raw, write_indexer_k, write_kv)
from .mxfp4 import (E2M1_VALUES, dequantize_mxfp4, encode_e2m1, pack_fp4, quantize_mxfp4,
                    unpack_fp4)

__all__ = [
    "FP8Format", "OCP", "FNUZ", "get_fp8_format", "fp8_lut", "decode_fp8", "encode_fp8", "encode_fp8_bits",
    "pow2_scale_exponent", "ue8m0_decode", "ue8m0_encode", "as_ue8m0_bytes",
    "quantize_fp8_pow2", "dequantize_fp8_pow2", "fake_quant_fp8_pow2",
    "E2M1_VALUES", "encode_e2m1", "pack_fp4", "unpack_fp4", "quantize_mxfp4", "dequantize_mxfp4",
    "quantize_block_fp8", "dequantize_block_fp8",
    "KV_DIM", "NOPE_DIM", "ROPE_DIM", "TILE", "N_TILES", "DATA_BYTES", "SCALE_BYTES",
    "RECORD_BYTES", "PAGE_ALIGN", "page_bytes", "page_stride", "alloc_kv_pages", "quantize_kv",
    "dequantize_kv", "fake_quant_kv", "write_kv", "read_kv", "read_kv_raw",
    "INDEXER_DIM", "INDEXER_VALUE_BYTES", "INDEXER_SCALE_BYTES", "INDEXER_RECORD_BYTES",
    "indexer_page_stride", "alloc_indexer_pages", "quantize_indexer_k", "write_indexer_k",
    "read_indexer_k", "fake_quant_indexer_k",
]
