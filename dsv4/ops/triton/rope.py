"""Triton RoPE: ``apply_rope`` in one launch, and the query's unit RMSNorm + RoPE fused.

Why: the torch ``apply_rope`` is ~10 kernels (slice to fp32, four products, sub/add, stack, cast,
cat) and its ``cat`` rewrites the whole tensor — at an 8K prefill the query's and the output's
rotations moved ~12 ms of copies a step. Here one program per (row, head block) reads each value
once; ``apply_rope`` loads the rope channels' (even, odd) pairs as one contiguous run and splits them
in registers (two stride-2 loads and stores made the in-place inverse rotation of an 8K prefill's
output 10x slower on the H200: 0.41 vs 0.04 ms a layer).

Bits: the same as the torch code. ``apply_rope``'s products and sums are fp32 operations rounded
one by one (torch runs them as separate kernels), so the kernels are compiled without FMA
contraction; the inverse rotation negates sin, which is exact. ``unit_norm_rope`` is the Triton
``unit_rms_norm`` (``dense.py``: the same ``rms_factor`` statistic and launch shape, factor rounded
to x's dtype, product in x's dtype) followed by ``apply_rope`` of the rounded values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast, interpreting
from .dense import norm_launch, rms_factor

__all__ = ["apply_rope", "unit_norm_rope"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rotate(ye, yo, c, s, DT: tl.constexpr, INTERP: tl.constexpr):
    """apply_rope's pair rotation in fp32 (each product rounded on its own), rounded to DT."""
    re = cast(ye * c - yo * s, DT, INTERP)
    ro = cast(yo * c + ye * s, DT, INTERP)
    return re, ro


@triton.jit
def _rope_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, H, D, RD,
                 stride_xt, stride_xh, stride_yt, stride_yh, stride_ct, stride_st,
                 INVERSE: tl.constexpr, COPY: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_R: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    dt = y_ptr.dtype.element_ty
    xrow = x_ptr + t * stride_xt + h.to(tl.int64)[:, None] * stride_xh
    yrow = y_ptr + t * stride_yt + h.to(tl.int64)[:, None] * stride_yh
    if COPY:  # the channels before the rope slice, unchanged
        for d0 in range(0, D - RD, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            m = hm[:, None] & (d < D - RD)[None, :]
            tl.store(yrow + d[None, :], tl.load(xrow + d[None, :], mask=m), mask=m)
    i = tl.arange(0, BLOCK_R)
    im = i < RD // 2
    c = tl.load(cos_ptr + t * stride_ct + i, mask=im, other=0.0)
    s = tl.load(sin_ptr + t * stride_st + i, mask=im, other=0.0)
    if INVERSE:
        s = s * -1.0  # not -s: some Triton versions lower a float's unary minus as 0 - s (sin 0 -> +0, not -0)
    # the (even, odd) pairs as one contiguous run, split in registers: two stride-2 loads and stores
    # made the in-place inverse rotation of an 8K prefill's output 10x slower (H200: 0.41 vs 0.04 ms)
    j = tl.arange(0, 2 * BLOCK_R)
    m = hm[:, None] & (j < RD)[None, :]
    pairs = tl.load(xrow + (D - RD) + j[None, :], mask=m, other=0.0).to(tl.float32)
    xe, xo = tl.split(tl.reshape(pairs, (BLOCK_H, BLOCK_R, 2)))
    re, ro = _rotate(xe, xo, c[None, :], s[None, :], dt, INTERP)
    tl.store(yrow + (D - RD) + j[None, :], tl.reshape(tl.join(re, ro), (BLOCK_H, 2 * BLOCK_R)), mask=m)


@triton.jit
def _unit_norm_rope_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, H, D, d_f, eps, RD,
                           stride_xt, stride_xh, stride_yt, stride_yh, stride_ct, stride_st,
                           BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    xr = x_ptr + t * stride_xt + h * stride_xh
    yr = y_ptr + t * stride_yt + h * stride_yh
    dt = y_ptr.dtype.element_ty
    r = rms_factor(xr, D, d_f, eps, BLOCK_D)  # [1]: unit_rms_norm's statistic, bit for bit
    r = cast(r, dt, INTERP).to(tl.float32)  # x * rsqrt(...).to(x.dtype): the factor is rounded
    offs = tl.arange(0, BLOCK_D)
    nope = offs < D - RD
    x = tl.load(xr + offs, mask=nope, other=0.0).to(tl.float32)
    tl.store(yr + offs, cast(x * r, dt, INTERP), mask=nope)
    i = tl.arange(0, BLOCK_R)
    im = i < RD // 2
    ev = D - RD + 2 * i
    ye = cast(tl.load(xr + ev, mask=im, other=0.0).to(tl.float32) * r, dt, INTERP).to(tl.float32)
    yo = cast(tl.load(xr + ev + 1, mask=im, other=0.0).to(tl.float32) * r, dt, INTERP).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + i, mask=im, other=0.0)
    s = tl.load(sin_ptr + t * stride_st + i, mask=im, other=0.0)
    re, ro = _rotate(ye, yo, c, s, dt, INTERP)
    tl.store(yr + ev, re, mask=im)
    tl.store(yr + ev + 1, ro, mask=im)


def _rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, what: str) -> torch.Tensor:
    """x as [T, H, D] with unit-stride channels, after checking the tables against it."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"{what}: x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{what}: x must be [T, ..., D], got {tuple(x.shape)}")
    t, d = x.shape[0], x.shape[-1]
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.dim() != 2 or tab.shape[0] != t or 2 * tab.shape[1] > d:
            raise ValueError(f"{what}: {name} must be [T={t}, R/2] with R ≤ D={d}, got {tuple(tab.shape)}")
        if tab.dtype != torch.float32:
            raise TypeError(f"{what}: {name} must be float32 (dsv4.model.rope.cos_sin), got {tab.dtype}")
        if tab.device != x.device:
            raise ValueError(f"{what}: {name} is on {tab.device}, x on {x.device}")
    x3 = x.reshape(t, -1, d)
    if d and x3.stride(2) != 1:
        x3 = x3.contiguous()
    return x3


def _table(tab: torch.Tensor) -> torch.Tensor:
    return tab if tab.stride(1) == 1 else tab.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
               in_place: bool = False) -> torch.Tensor:
    """``dsv4.model.rope.apply_rope``, bit for bit. ``in_place``: the caller gives ``x`` up, so only
    its rope channels are rewritten (x is returned) — no copy of the other channels."""
    x3 = _rows(x, cos, sin, "apply_rope")
    t, h, d = x3.shape
    rd = 2 * cos.shape[1]
    in_place = in_place and x3.data_ptr() == x.data_ptr() and x.is_contiguous()
    y3 = x3 if in_place else torch.empty_like(x3)
    if t == 0 or h == 0 or d == 0:
        return x if in_place else y3.reshape(x.shape)
    block_h = min(16, triton.next_power_of_2(h))
    block_r = max(1, triton.next_power_of_2(rd // 2))
    cos, sin = _table(cos), _table(sin)
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x3, y3, cos, sin, h, d, rd, x3.stride(0), x3.stride(1), y3.stride(0), y3.stride(1),
        cos.stride(0), sin.stride(0), INVERSE=bool(inverse), COPY=not in_place, BLOCK_H=block_h,
        BLOCK_D=max(16, min(512, triton.next_power_of_2(max(d - rd, 1)))), BLOCK_R=block_r,
        INTERP=interpreting(), num_warps=4,
        enable_fp_fusion=False)  # apply_rope rounds each product: no a·b - c·d contracted into an FMA
    return x if in_place else y3.reshape(x.shape)


def unit_norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """``apply_rope(unit_rms_norm(x, eps), cos, sin)`` with the Triton ``unit_rms_norm``, bit for bit,
    in one launch (one program per (token, head) row of x [T, ..., D])."""
    x3 = _rows(x, cos, sin, "unit_norm_rope")
    t, h, d = x3.shape
    rd = 2 * cos.shape[1]
    block, warps = norm_launch(d)
    if d > block:  # rows longer than one norm block: the unfused kernels
        from .dense import unit_rms_norm

        return apply_rope(unit_rms_norm(x, eps), cos, sin)
    y3 = torch.empty_like(x3)
    if t == 0 or h == 0 or d == 0:
        return y3.reshape(x.shape)
    cos, sin = _table(cos), _table(sin)
    _unit_norm_rope_kernel[(t, h)](
        x3, y3, cos, sin, h, d, float(d), float(eps), rd, x3.stride(0), x3.stride(1), y3.stride(0), y3.stride(1),
        cos.stride(0), sin.stride(0), BLOCK_D=block, BLOCK_R=max(1, triton.next_power_of_2(rd // 2)),
        INTERP=interpreting(), num_warps=warps, enable_fp_fusion=False)
    return y3.reshape(x.shape)
