"""Triton KV insert: quantize rows into `fp8_ds_mla` records (or copy into dense pages) in place.

One program per token. Padding tokens (page id < 0, offset < 0, or offset ≥ the page's token count)
are skipped by store masks inside the kernel: no boolean indexing, no host sync, so the insert can
be captured in a CUDA graph. (``dsv4.formats.write_kv`` raises on an offset past the page; here such
a token is simply not written.)

Record bytes are those of ``dsv4.formats.write_kv``, bit for bit, computed with integer arithmetic so
they are the same compiled and in the interpreter:

* optional fp32 → bf16 → fp32 rounding (round-to-nearest-even on the bits: the compressor path);
* per 64-dim NoPE tile: amax floored at 1e-4 (and capped at FLT_MAX), e = ceil(log2(amax / quant_max))
  from the exponent/mantissa fields (``pow2_scale_exponent``), byte = clamp(e + 127, 0, 254);
* codes = e4m3(x · 2^-(byte-127)) — the exact inverse scale ``inv_pow2_from_byte`` — clamped to
  ±fmt.max (448 OCP, 240 FNUZ), rounded to nearest even (subnormals included), -0 → 0x80 (OCP) or 0x00
  (FNUZ), NaN → 0x7F|sign (OCP) or 0x80 (FNUZ), as ``encode_fp8_bits``;
* rope dims 448..511 as bf16 (RNE) little-endian; scale row = 7 exponent bytes + one zero byte.

(NaN inputs are not bit-matched in the scale byte: the compiled max ignores NaN, torch's amax keeps it.)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...formats.fp8 import get_fp8_format
from ...formats.kv_record import DATA_BYTES, KV_DIM, NOPE_DIM, RECORD_BYTES, ROPE_DIM, SCALE_BYTES, TILE
from ._common import cast, interpreting, ue8m0_to_f32

__all__ = ["kv_insert", "kv_insert_dense", "store_kv_record", "scale_byte", "encode_e4m3", "rne_bf16"]

FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def rne_bf16(x):
    """fp32 rounded to the nearest bf16 (ties to even), kept as fp32; NaN kept as is."""
    bits = x.to(tl.int32, bitcast=True)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, r)


@triton.jit
def encode_e4m3(y, FMT_MAX: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr):
    """fp32 -> e4m3 byte (int32 0..255), saturating, RNE: bit-exact with ``encode_fp8_bits``.

    The magnitude is rounded on the integer mantissa: eff = max(exponent, 1-BIAS) puts values below
    the smallest normal on the subnormal grid, and the code is (eff + BIAS - 1)·8 + r, where a
    rounding carry (r = 16) or a subnormal reaching 8 lands on the next exponent by itself.
    """
    bits = y.to(tl.int32, bitcast=True)
    neg = bits < 0
    nan = y != y
    a = tl.where(nan, 0.0, tl.minimum(tl.abs(y), FMT_MAX))
    ab = a.to(tl.int32, bitcast=True)
    ex = ((ab >> 23) & 0xFF) - 127
    eff = tl.maximum(ex, 1 - BIAS)
    drop = tl.minimum(20 + eff - ex, 25)
    mant = (ab & 0x7FFFFF) | 0x800000
    half = (drop * 0 + 1) << (drop - 1)
    r = (mant + (half - 1) + ((mant >> drop) & 1)) >> drop
    mag = (eff + BIAS - 1) * 8 + r
    sign = tl.where(neg, 128, 0)
    if FNUZ:
        sign = tl.where(mag == 0, 0, sign)
        code = tl.where(nan, 0x80, mag | sign)
    else:
        code = tl.where(nan, 0x7F | sign, mag | sign)
    return code


@triton.jit
def _slot(page_ids_ptr, offsets_ptr, t, BLOCK_SIZE):
    """Token t's (page, offset) and whether it is a real slot (page −1 or an offset outside the
    page is skipped); page and offset are 0 where it is not, so addresses stay in bounds."""
    page = tl.load(page_ids_ptr + t).to(tl.int64)
    off = tl.load(offsets_ptr + t).to(tl.int64)
    ok = (page >= 0) & (off >= 0) & (off < BLOCK_SIZE)
    return tl.where(ok, page, 0), tl.where(ok, off, 0), ok


@triton.jit
def scale_byte(amax, Q_MANT: tl.constexpr, Q_EXP: tl.constexpr):
    """UE8M0 byte of a block's power-of-two scale: amax floored at 1e-4 (and capped at FLT_MAX),
    e = ceil(log2(amax / quant_max)) from the exponent/mantissa fields, byte = clamp(e + 127, 0, 254)."""
    amax = tl.minimum(tl.maximum(amax, 1e-4), FLT_MAX)
    ab = amax.to(tl.int32, bitcast=True)
    e = ((ab >> 23) & 0xFF) - 126 - Q_EXP + ((ab & 0x7FFFFF) > Q_MANT).to(tl.int32)  # ceil(log2(amax/qmax))
    return tl.minimum(tl.maximum(e + 127, 0), 254)


@triton.jit
def store_kv_record(base, off, ok, x, BLOCK_SIZE, Q_MANT: tl.constexpr, Q_EXP: tl.constexpr,
                    FMT_MAX: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Write the 584-byte record of one token at slot ``off`` of the page at ``base`` (nothing where
    ``ok`` is False). ``x``: its 512 fp32 values as [8, 64] (rows 0..6 the NoPE tiles, row 7 rope)."""
    tile = tl.arange(0, 8)
    col = tl.arange(0, 64)
    nope = (tile < 7)[:, None] & (col < 64)[None, :]
    rope = (tile == 7)[:, None] & (col < 64)[None, :]
    d = tile[:, None] * 64 + col[None, :]
    xn = tl.where(nope, x, 0.0)
    if ROUND_BF16:
        xn = rne_bf16(xn)
    eb = scale_byte(tl.max(tl.abs(xn), axis=1), Q_MANT, Q_EXP)
    inv = ue8m0_to_f32(254 - eb)  # 2^-(eb-127) exactly (eb = 254 -> the subnormal 2^-127)
    codes = encode_e4m3(xn * inv[:, None], FMT_MAX, BIAS, FNUZ)
    # masks are where(ok, m, False): the interpreter rejects `scalar & vector` as a store mask
    tl.store(base + off * 576 + d, codes.to(tl.uint8), mask=tl.where(ok, nope, False))
    tl.store(base + BLOCK_SIZE * 576 + off * 8 + tile, tl.where(tile < 7, eb, 0).to(tl.uint8),
             mask=tl.where(ok, tile < 8, False))
    # rope: 64 bf16 values, little-endian byte pairs
    h = rne_bf16(x).to(tl.int32, bitcast=True) >> 16
    rbase = base + off * 576 + 448 + 2 * col[None, :] + 0 * tile[:, None]  # [8, 64]: only row 7 is stored
    tl.store(rbase, (h & 0xFF).to(tl.uint8), mask=tl.where(ok, rope, False))
    tl.store(rbase + 1, ((h >> 8) & 0xFF).to(tl.uint8), mask=tl.where(ok, rope, False))


@triton.jit
def _kv_insert_kernel(pages_ptr, page_ids_ptr, offsets_ptr, x_ptr, stride_page, stride_xt, stride_xd,
                      BLOCK_SIZE, Q_MANT: tl.constexpr, Q_EXP: tl.constexpr, FMT_MAX: tl.constexpr,
                      BIAS: tl.constexpr, FNUZ: tl.constexpr, ROUND_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    page, off, ok = _slot(page_ids_ptr, offsets_ptr, t, BLOCK_SIZE)
    d = tl.arange(0, 8)[:, None] * 64 + tl.arange(0, 64)[None, :]
    x = tl.load(x_ptr + t * stride_xt + d * stride_xd).to(tl.float32)
    store_kv_record(pages_ptr + page * stride_page, off, ok, x, BLOCK_SIZE, Q_MANT, Q_EXP, FMT_MAX, BIAS, FNUZ,
                    ROUND_BF16)


@triton.jit
def _dense_insert_kernel(pages_ptr, page_ids_ptr, offsets_ptr, x_ptr, D, BLOCK_SIZE,
                         stride_p, stride_b, stride_d, stride_xt, stride_xd,
                         BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    page, off, ok = _slot(page_ids_ptr, offsets_ptr, t, BLOCK_SIZE)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    x = tl.load(x_ptr + t * stride_xt + d * stride_xd, mask=dm, other=0.0)
    ptr = pages_ptr + page * stride_p + off * stride_b + d * stride_d
    tl.store(ptr, cast(x, pages_ptr.dtype.element_ty, INTERP), mask=tl.where(ok, dm, False))


def _check_slots(page_ids: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor, width: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{what}: x must be [T, {width}], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{what}: x must be a float tensor, got {x.dtype}")
    for name, t in (("page_ids", page_ids), ("offsets", offsets)):
        if t.dim() != 1 or t.shape[0] != x.shape[0]:
            raise ValueError(f"{what}: {name} must be [T={x.shape[0]}], got {tuple(t.shape)}")
        if t.is_floating_point() or t.dtype == torch.bool:
            raise TypeError(f"{what}: {name} must be an integer tensor, got {t.dtype}")


def kv_insert_dense(pages: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> None:
    """pages[page_ids[t], offsets[t]] = x[t].to(pages.dtype) for the 'auto' cache [P, B, D]; negatives skipped."""
    if pages.dim() != 3 or not pages.is_floating_point():
        raise ValueError(f"kv_insert_dense: pages must be a float [P, B, D] tensor, got {pages.dtype} "
                         f"{tuple(pages.shape)}")
    _check_slots(page_ids, offsets, x, pages.shape[2], "kv_insert_dense")
    if x.shape[0] == 0:
        return
    D = pages.shape[2]
    page_ids, offsets = page_ids.contiguous(), offsets.contiguous()  # read with unit stride
    _dense_insert_kernel[(x.shape[0],)](
        pages, page_ids, offsets, x, D, pages.shape[1], *pages.stride(), *x.stride(),
        BLOCK_D=triton.next_power_of_2(D), INTERP=interpreting(), num_warps=4)


def _quant_consts(fmt):
    """(Q_MANT, Q_EXP, max, bias, fnuz) of an FP8 format: quant_max = (1 + Q_MANT/2^23)/2 · 2^Q_EXP."""
    mant, ex = math.frexp(fmt.quant_max)
    return int(round((mant * 2 - 1) * (1 << 23))), ex, float(fmt.max), 8 if fmt.name == "fnuz" else 7, \
        fmt.name == "fnuz"


def kv_insert(pages: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor, fmt=None,
              block_size: int | None = None, round_bf16: bool = False) -> None:
    """Write x [T, 512] at (page_ids[t], offsets[t]) as ``dsv4.formats.write_kv`` does; page id < 0 skipped.

    uint8 pages [P, ≥ block_size·584] (row stride from the tensor) get 584-byte records in format
    ``fmt``; float pages [P, B, D] (the 'auto' cache) get ``x`` cast to their dtype (``fmt``,
    ``block_size`` and ``round_bf16`` are then ignored).
    """
    if pages.dtype != torch.uint8:
        return kv_insert_dense(pages, page_ids, offsets, x)
    if fmt is None:
        raise ValueError("kv_insert: uint8 (fp8_ds_mla) pages need an FP8 format, got fmt=None")
    fmt = get_fp8_format(fmt)
    if pages.dim() != 2 or pages.stride(1) != 1:
        raise ValueError(f"kv_insert: pages must be a 2-D uint8 tensor with unit inner stride, got shape "
                         f"{tuple(pages.shape)} stride {pages.stride()}")
    if block_size is None:
        block_size = pages.shape[1] // RECORD_BYTES
    if block_size <= 0 or pages.shape[1] < block_size * RECORD_BYTES:
        raise ValueError(f"kv_insert: page row has {pages.shape[1]} bytes, block_size {block_size} needs "
                         f"{block_size * RECORD_BYTES}")
    _check_slots(page_ids, offsets, x, KV_DIM, "kv_insert")
    if x.shape[0] == 0:
        return
    assert DATA_BYTES == 576 and SCALE_BYTES == 8 and NOPE_DIM == 448 and ROPE_DIM == 64 and TILE == 64
    q_mant, q_exp, fmax, bias, fnuz = _quant_consts(fmt)
    page_ids, offsets = page_ids.contiguous(), offsets.contiguous()  # read with unit stride
    _kv_insert_kernel[(x.shape[0],)](
        pages, page_ids, offsets, x, pages.stride(0), x.stride(0), x.stride(1), block_size,
        Q_MANT=q_mant, Q_EXP=q_exp, FMT_MAX=fmax, BIAS=bias, FNUZ=fnuz, ROUND_BF16=bool(round_bf16),
        num_warps=4)

