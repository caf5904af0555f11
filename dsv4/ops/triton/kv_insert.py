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

``kv_norm_rope_insert`` fuses the window KV's RMSNorm and RoPE in front of the same stores: from the
raw wkv projection it writes the bytes of Triton ``rms_norm`` → ``apply_rope`` → ``kv_insert``, bit for
bit — the norm's statistic is ``dense.rms_factor`` with ``dense.norm_launch``'s launch (the same
reduction as ``_rms_norm_kernel``), each value is rounded to the compute dtype where the unfused path
stores a tensor, and the kernel is compiled without FMA contraction so that the rope's products are
rounded on their own, as torch's elementwise ops round them. (The torch ``rms_norm`` sums Σx² in
another order: in fp32 its last bits can differ.)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...formats.fp8 import get_fp8_format
from ...formats.kv_record import DATA_BYTES, KV_DIM, NOPE_DIM, RECORD_BYTES, ROPE_DIM, SCALE_BYTES, TILE
from ._common import cast, interpreting, ue8m0_to_f32
from .dense import norm_launch, rms_factor

__all__ = ["kv_insert", "kv_insert_dense", "kv_norm_rope_insert", "store_kv_record", "scale_byte", "encode_e4m3",
           "rne_bf16"]

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
def _store_nope(base, off, x, tile, d, nope, ok, BLOCK_SIZE, Q_MANT: tl.constexpr, Q_EXP: tl.constexpr,
                FMT_MAX: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr):
    """Quantize the NoPE values x [8, 64] (7 tiles of 64 at columns d, row 7 masked off by ``nope``)
    into the record at ``off`` of the page at ``base``: e4m3 codes and the 8-byte scale row."""
    eb = scale_byte(tl.max(tl.abs(x), axis=1), Q_MANT, Q_EXP)
    inv = ue8m0_to_f32(254 - eb)  # 2^-(eb-127) exactly (eb = 254 -> the subnormal 2^-127)
    codes = encode_e4m3(x * inv[:, None], FMT_MAX, BIAS, FNUZ)
    # masks are where(ok, m, False): the interpreter rejects `scalar & vector` as a store mask
    tl.store(base + off * 576 + d, codes.to(tl.uint8), mask=tl.where(ok, nope, False))
    tl.store(base + BLOCK_SIZE * 576 + off * 8 + tile, tl.where(tile < 7, eb, 0).to(tl.uint8),
             mask=tl.where(ok, tile < 8, False))


@triton.jit
def _store_bf16_bytes(ptr, v, mask):
    """v (fp32) rounded to bf16 (RNE), stored little-endian at ptr, ptr + 1."""
    h = rne_bf16(v).to(tl.int32, bitcast=True) >> 16
    tl.store(ptr, (h & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + 1, ((h >> 8) & 0xFF).to(tl.uint8), mask=mask)


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
    _store_nope(base, off, xn, tile, d, nope, ok, BLOCK_SIZE, Q_MANT, Q_EXP, FMT_MAX, BIAS, FNUZ)
    rbase = base + off * 576 + 448 + 2 * col[None, :] + 0 * tile[:, None]  # [8, 64]: only row 7 is stored
    _store_bf16_bytes(rbase, x, tl.where(ok, rope, False))


@triton.jit(do_not_specialize=["page_ids_ptr", "offsets_ptr"])
def _kv_insert_kernel(pages_ptr, page_ids_ptr, offsets_ptr, x_ptr, stride_page, stride_xt, stride_xd,
                      BLOCK_SIZE, Q_MANT: tl.constexpr, Q_EXP: tl.constexpr, FMT_MAX: tl.constexpr,
                      BIAS: tl.constexpr, FNUZ: tl.constexpr, ROUND_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    page, off, ok = _slot(page_ids_ptr, offsets_ptr, t, BLOCK_SIZE)
    d = tl.arange(0, 8)[:, None] * 64 + tl.arange(0, 64)[None, :]  # the 512 values as [8, 64]
    x = tl.load(x_ptr + t * stride_xt + d * stride_xd).to(tl.float32)
    store_kv_record(pages_ptr + page * stride_page, off, ok, x, BLOCK_SIZE, Q_MANT, Q_EXP, FMT_MAX, BIAS, FNUZ,
                    ROUND_BF16)


@triton.jit
def _normed(xrow, w_ptr, d, mask, r, KV_DT: tl.constexpr, INTERP: tl.constexpr):
    """The RMSNorm output at columns d, as ``_rms_norm_kernel`` writes it (w · (x · r) rounded to the
    compute dtype KV_DT), held as fp32."""
    x = tl.load(xrow + d, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32) * (x * r)
    return cast(y, KV_DT, INTERP).to(tl.float32)


@triton.jit(do_not_specialize=["page_ids_ptr", "offsets_ptr"])
def _kv_norm_rope_insert_kernel(pages_ptr, page_ids_ptr, offsets_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr,
                                D, d_f, eps, stride_xt, stride_ct, stride_cd, stride_st, stride_sd,
                                BLOCK_SIZE, stride_p, stride_b, stride_d,
                                BLOCK_D: tl.constexpr, DENSE: tl.constexpr, Q_MANT: tl.constexpr,
                                Q_EXP: tl.constexpr, FMT_MAX: tl.constexpr, BIAS: tl.constexpr,
                                FNUZ: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    page, off, ok = _slot(page_ids_ptr, offsets_ptr, t, BLOCK_SIZE)
    xrow = x_ptr + t * stride_xt
    kv_dt = x_ptr.dtype.element_ty
    r = rms_factor(xrow, D, d_f, eps, BLOCK_D)  # [1]: rms_norm's statistic, bit for bit

    # NoPE: 7 tiles of 64 as rows of an [8, 64] block (row 7 masked off)
    tile = tl.arange(0, 8)
    col = tl.arange(0, 64)
    nope = (tile < 7)[:, None] & (col < 64)[None, :]
    d = tile[:, None] * 64 + col[None, :]
    y = _normed(xrow, w_ptr, d, nope, r[:, None], kv_dt, INTERP)

    # rope pairs (448 + 2i, 449 + 2i): apply_rope's fp32 math (products rounded on their own: the
    # kernel is compiled without FMA contraction), rounded to the compute dtype
    i = tl.arange(0, 32)
    ev = 448 + 2 * i
    even = _normed(xrow, w_ptr, ev, i < 32, r, kv_dt, INTERP)
    odd = _normed(xrow, w_ptr, ev + 1, i < 32, r, kv_dt, INTERP)
    c = tl.load(cos_ptr + t * stride_ct + i * stride_cd)
    s = tl.load(sin_ptr + t * stride_st + i * stride_sd)
    re = cast(even * c - odd * s, kv_dt, INTERP).to(tl.float32)
    ro = cast(odd * c + even * s, kv_dt, INTERP).to(tl.float32)

    rmask = tl.where(ok, i < 32, False)
    if DENSE:  # 'auto' pages [P, B, D]: the values cast to the pages' dtype
        pdt = pages_ptr.dtype.element_ty
        dst = pages_ptr + page * stride_p + off * stride_b
        tl.store(dst + d * stride_d, cast(y, pdt, INTERP), mask=tl.where(ok, nope, False))
        tl.store(dst + ev * stride_d, cast(re, pdt, INTERP), mask=rmask)
        tl.store(dst + (ev + 1) * stride_d, cast(ro, pdt, INTERP), mask=rmask)
    else:  # fp8_ds_mla records
        base = pages_ptr + page * stride_p
        _store_nope(base, off, y, tile, d, nope, ok, BLOCK_SIZE, Q_MANT, Q_EXP, FMT_MAX, BIAS, FNUZ)
        rope = base + off * 576 + 448 + 4 * i  # bf16 pair i: bytes 448 + 4i .. 448 + 4i + 3
        _store_bf16_bytes(rope, re, rmask)
        _store_bf16_bytes(rope + 2, ro, rmask)


@triton.jit(do_not_specialize=["page_ids_ptr", "offsets_ptr"])
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


def _record_pages(pages: torch.Tensor, fmt, block_size: int | None, what: str):
    """(FP8 format, records per page) of uint8 ``fp8_ds_mla`` pages [P, ≥ block_size·584]; errors
    name the op (``what``) and what is wrong."""
    if fmt is None:
        raise ValueError(f"{what}: uint8 (fp8_ds_mla) pages need an FP8 format, got fmt=None")
    fmt = get_fp8_format(fmt)
    if pages.dim() != 2 or pages.stride(1) != 1:
        raise ValueError(f"{what}: pages must be a 2-D uint8 tensor with unit inner stride, got shape "
                         f"{tuple(pages.shape)} stride {pages.stride()}")
    if block_size is None:
        block_size = pages.shape[1] // RECORD_BYTES
    if block_size <= 0 or pages.shape[1] < block_size * RECORD_BYTES:
        raise ValueError(f"{what}: page row has {pages.shape[1]} bytes, block_size {block_size} needs "
                         f"{block_size * RECORD_BYTES}")
    return fmt, block_size


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
    fmt, block_size = _record_pages(pages, fmt, block_size, "kv_insert")
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



_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_norm_rope(pages, page_ids, offsets, kv_raw, norm_weight, cos, sin) -> None:
    what = "kv_norm_rope_insert"
    if not isinstance(kv_raw, torch.Tensor) or kv_raw.dim() != 2 or kv_raw.shape[1] != KV_DIM:
        raise ValueError(f"{what}: kv_raw must be [T, {KV_DIM}], got {tuple(getattr(kv_raw, 'shape', ()))}")
    if kv_raw.dtype not in _KV_DTYPES:
        raise TypeError(f"{what}: kv_raw must be bf16, fp16 or fp32 (the compute dtype), got {kv_raw.dtype}")
    _check_slots(page_ids, offsets, kv_raw, KV_DIM, what)
    if not isinstance(norm_weight, torch.Tensor) or tuple(norm_weight.shape) != (KV_DIM,):
        raise ValueError(f"{what}: norm_weight must be [{KV_DIM}], got {tuple(getattr(norm_weight, 'shape', ()))}")
    if not norm_weight.is_floating_point():
        raise TypeError(f"{what}: norm_weight must be a float tensor, got {norm_weight.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (kv_raw.shape[0], ROPE_DIM // 2):
            raise ValueError(f"{what}: {name} must be [T={kv_raw.shape[0]}, {ROPE_DIM // 2}], got "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if t.dtype != torch.float32:
            raise TypeError(f"{what}: {name} must be float32 (dsv4.model.rope.cos_sin), got {t.dtype}")
    for name, t in (("pages", pages), ("page_ids", page_ids), ("offsets", offsets), ("norm_weight", norm_weight),
                    ("cos", cos), ("sin", sin)):
        if t.device != kv_raw.device:
            raise ValueError(f"{what}: {name} is on {t.device}, kv_raw on {kv_raw.device}")


def kv_norm_rope_insert(pages: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor, kv_raw: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, fmt=None,
                        block_size: int | None = None) -> None:
    """RMSNorm + RoPE + KV insert in one launch: writes what
    ``kv_insert(pages, page_ids, offsets, apply_rope(rms_norm(kv_raw, norm_weight, eps), cos, sin), fmt, block_size)``
    writes with the Triton ``rms_norm`` (``dense.py``), bit for bit; page id < 0 (or an offset outside
    the page) skipped.

    kv_raw [T, 512]: the wkv projection in the compute dtype (bf16, fp16 or fp32); norm_weight [512];
    cos/sin [T, 32] fp32 (``dsv4.model.rope.cos_sin``: the rope turns the interleaved pairs of the last
    64 dims). uint8 pages [P, ≥ block_size·584] get 584-byte ``fp8_ds_mla`` records in format ``fmt``;
    float pages [P, B, 512] (the 'auto' cache) the normed and roped values cast to their dtype (``fmt``
    and ``block_size`` are then ignored). Nothing is returned: callers that need the KV itself (the
    validation hooks) compute it unfused.
    """
    _check_norm_rope(pages, page_ids, offsets, kv_raw, norm_weight, cos, sin)
    dense = pages.dtype != torch.uint8
    if dense:
        if pages.dim() != 3 or not pages.is_floating_point() or pages.shape[2] != KV_DIM:
            raise ValueError(f"kv_norm_rope_insert: float pages must be [P, B, {KV_DIM}], got {pages.dtype} "
                             f"{tuple(pages.shape)}")
        block_size = pages.shape[1]
        q_mant, q_exp, fmax, bias, fnuz = 0, 0, 0.0, 0, False
        strides = pages.stride()
    else:
        fmt, block_size = _record_pages(pages, fmt, block_size, "kv_norm_rope_insert")
        q_mant, q_exp, fmax, bias, fnuz = _quant_consts(fmt)
        strides = (pages.stride(0), 0, 1)
    if kv_raw.shape[0] == 0:
        return
    if kv_raw.stride(1) != 1:
        kv_raw = kv_raw.contiguous()  # rms_norm reads unit-stride rows (as _norm does)
    block, warps = norm_launch(KV_DIM)
    page_ids, offsets = page_ids.contiguous(), offsets.contiguous()
    _kv_norm_rope_insert_kernel[(kv_raw.shape[0],)](
        pages, page_ids, offsets, kv_raw, norm_weight.contiguous(), cos, sin, KV_DIM, float(KV_DIM), float(eps),
        kv_raw.stride(0), *cos.stride(), *sin.stride(), block_size, *strides,
        BLOCK_D=block, DENSE=dense, Q_MANT=q_mant, Q_EXP=q_exp, FMT_MAX=fmax, BIAS=bias, FNUZ=fnuz,
        INTERP=interpreting(), num_warps=warps,
        enable_fp_fusion=False)  # apply_rope rounds each product: no a·b - c·d contracted into an FMA
