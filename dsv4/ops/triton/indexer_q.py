"""Triton ``indexer_q_rope_quant``: the Lightning Indexer's query RoPE and FP8 fake-quant in one launch.

The torch backend (``dsv4.ops.torch_indexer.indexer_q_rope_quant``: ``apply_rope``, then
``fake_quant_fp8_pow2`` of the bf16-rounded result) is ~40 small kernels per CSA layer. One program
per (token, head) row computes the same bits:

* RoPE as ``apply_rope``: the trailing 2·R/2 dims in interleaved pairs (2i, 2i+1) relative to the rope
  start, even' = e·c − o·s, odd' = o·c + e·s in fp32 with every product rounded on its own (compiled
  without FMA contraction), rounded to q's dtype; the other dims pass unchanged;
* with ``fmt``: the row rounded to bf16 (nearest even), then the per-row power-of-two FP8 round trip of
  ``fake_quant_fp8_pow2`` with the exact helpers of the KV insert: amax floored at 1e-4 and capped at
  FLT_MAX, byte = clamp(ceil(log2(amax / quant_max)) + 127, 0, 254) from the float fields
  (``scale_byte``), codes = e4m3(x · 2^-(byte-127)) saturating at ±fmt.max, RNE, subnormals, signed
  zeros and NaN as ``encode_fp8_bits`` (``encode_e4m3``), decoded as the LUT does (``fp8_to_f32``) and
  multiplied by 2^(byte-127) in fp32. A row holding NaN gets the scale torch derives from a NaN amax
  (``frexp(NaN)``, taken once from torch on the CPU): the compiled max would skip the NaN.

bf16 q is read through its bits (``activation.widen``) and rounded on the bits (``rne_bf16``): the
interpreter's own bf16 conversions flush subnormals.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...formats.fp8 import get_fp8_format, pow2_scale_exponent
from ...formats.ue8m0 import ue8m0_encode
from ._common import fp8_to_f32, ue8m0_to_f32
from .activation import bf16_bits, widen
from .kv_insert import _quant_consts, encode_e4m3, rne_bf16, scale_byte

__all__ = ["indexer_q_rope_quant"]

_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@functools.lru_cache(maxsize=None)
def _nan_byte(name: str) -> int:
    """The scale byte torch's codec gives a block whose amax is NaN (on the CPU)."""
    fmt = get_fp8_format(name)
    return int(ue8m0_encode(pow2_scale_exponent(torch.tensor([float("nan")]), fmt.quant_max))[0])


@triton.jit
def _rounded(x, DT: tl.constexpr):
    """fp32 ``x`` rounded to DT (nearest even), held as fp32."""
    if DT == tl.bfloat16:
        return rne_bf16(x)
    elif DT == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _indexer_q_kernel(q_ptr, cos_ptr, sin_ptr, out_ptr, H, D, ROPE0, stride_qt, stride_qh, stride_qd,
                      stride_ct, stride_cd, stride_st, stride_sd, NAN_BYTE,
                      BLOCK_D: tl.constexpr, Q_DT: tl.constexpr, Q_BITS: tl.constexpr, QUANT: tl.constexpr,
                      Q_MANT: tl.constexpr, Q_EXP: tl.constexpr, FMT_MAX: tl.constexpr, BIAS: tl.constexpr,
                      FNUZ: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = pid // H
    h = pid % H
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    row = q_ptr + t * stride_qt + h * stride_qh
    x = widen(tl.load(row + d * stride_qd, mask=dm, other=0), Q_BITS)

    # RoPE: pair partner j ^ 1 of rope dim j (relative to the rope start), cos/sin of pair j // 2
    rope = dm & (d >= ROPE0)
    j = tl.where(rope, d - ROPE0, 0)
    other = widen(tl.load(row + (ROPE0 + (j ^ 1)) * stride_qd, mask=rope, other=0), Q_BITS)
    c = tl.load(cos_ptr + t * stride_ct + (j // 2) * stride_cd, mask=rope, other=0.0)
    s = tl.load(sin_ptr + t * stride_st + (j // 2) * stride_sd, mask=rope, other=0.0)
    r = tl.where((j & 1) == 0, x * c - other * s, x * c + other * s)
    x = tl.where(rope, _rounded(r, Q_DT), x)  # rot.to(q.dtype)

    if QUANT:
        if Q_DT != tl.bfloat16:
            x = rne_bf16(x)  # q.to(torch.bfloat16).float()
        nan = (x != x) & dm
        has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
        eb = scale_byte(tl.max(tl.where(nan | ~dm, 0.0, tl.abs(x)), axis=0), Q_MANT, Q_EXP)
        eb = tl.where(has_nan, NAN_BYTE, eb)
        codes = encode_e4m3(x * ue8m0_to_f32(254 - eb), FMT_MAX, BIAS, FNUZ)  # x · 2^-e: the codec's product
        x = fp8_to_f32(codes, False, FNUZ) * ue8m0_to_f32(eb)
    tl.store(out_ptr + pid * D + d, x, mask=dm)


def indexer_q_rope_quant(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fmt=None) -> torch.Tensor:
    """float32 [T, H, D]: bitwise ``dsv4.ops.torch_indexer.indexer_q_rope_quant`` (RoPE on the trailing
    2·cos.shape[-1] dims; with ``fmt``, the per-(token, head) power-of-two FP8 round trip)."""
    if q.dim() != 3 or q.dtype not in _DTYPES:
        raise ValueError(f"indexer_q_rope_quant: q must be a bf16/fp16/fp32 [T, H, D] tensor, got {q.dtype} "
                         f"{tuple(q.shape)}")
    t, n_heads, dim = q.shape
    half = cos.shape[-1] if cos.dim() == 2 else -1
    for name, x in (("cos", cos), ("sin", sin)):
        if x.dim() != 2 or x.shape[0] != t or x.shape[1] != half or 2 * half > dim:
            raise ValueError(f"indexer_q_rope_quant: {name} must be [T={t}, R/2] with R ≤ {dim}, got {tuple(x.shape)}")
        if x.dtype != torch.float32:
            raise TypeError(f"indexer_q_rope_quant: {name} must be float32 (dsv4.model.rope.cos_sin), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"indexer_q_rope_quant: {name} is on {x.device}, q on {q.device}")
    out = torch.empty(t, n_heads, dim, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    quant = fmt is not None
    if quant:
        fmt = get_fp8_format(fmt)
        q_mant, q_exp, fmax, bias, fnuz = _quant_consts(fmt)
        nan_byte = _nan_byte(fmt.name)
    else:
        q_mant, q_exp, fmax, bias, fnuz, nan_byte = 0, 0, 0.0, 0, False, 0
    qq, q_bits = bf16_bits(q)
    _indexer_q_kernel[(t * n_heads,)](
        qq, cos, sin, out, n_heads, dim, dim - 2 * half, *q.stride(), *cos.stride(), *sin.stride(), nan_byte,
        BLOCK_D=triton.next_power_of_2(dim), Q_DT=_DTYPES[q.dtype], Q_BITS=q_bits, QUANT=quant, Q_MANT=q_mant,
        Q_EXP=q_exp, FMT_MAX=fmax, BIAS=bias, FNUZ=fnuz, num_warps=1 if dim <= 256 else 4,
        enable_fp_fusion=False)  # apply_rope rounds each product: no a·b - c·d contracted into an FMA
    return out
