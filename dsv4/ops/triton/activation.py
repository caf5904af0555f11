"""Triton ``swiglu_act``: the clamped SwiGLU activation of ``dsv4.model.moe.swiglu`` in one launch.

The torch expression (``dsv4.model.moe.swiglu_act``) is ~9 elementwise kernels per layer (two casts,
two clamps, two casts to float64, silu, product, cast back); on a decode step those launches cost more
than the math. This kernel computes the same bits, one program per (row, column block), each input read
with its own row stride (gate and up are the column halves of the shared expert's one [w1; w3] GEMM on the
fast path: no copies):

* gate, up read in their dtype and widened to fp32 (exact; bf16 from its bits); gate clamped above and up to ±limit in
  fp32 with comparisons, so NaN passes through as torch's clamp lets it (``tl.minimum`` may drop NaN);
* silu in float64 as torch's kernel writes it, ``g / (1 + exp(-g))`` (IEEE division), times up in
  float64;
* the float64 product rounded to fp32, then to the output dtype — torch converts double to bf16/fp16
  through float (two roundings), so a direct fp64 → bf16 conversion could differ by one ulp.

The float64 exp is the platform's (Sleef in torch on CPU, numpy in the interpreter, libdevice compiled
on CUDA, the same library torch's CUDA kernel calls): where two of them differ it is by an ulp of a
float64, which the rounding to fp32 absorbs except within 2^-29 of a rounding boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["swiglu_act", "round_to", "widen", "bf16_bits"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 1024


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in DTYPE. bf16 from the bits (the interpreter's own fp32 →
    bf16 conversion truncates and flushes subnormals; ``_common.cast`` fixes the first only)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def widen(v, BF16_BITS: tl.constexpr):
    """Loaded values as fp32, exactly. BF16_BITS: ``v`` holds bf16 bit patterns (int16; the wrapper
    passes bf16 tensors viewed as int16, as ``bf16_bits`` does) — the interpreter's bf16 → fp32
    conversion flushes subnormals."""
    if BF16_BITS:
        return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


def bf16_bits(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor to pass, is bf16 bits): a bf16 tensor as its int16 view, for ``widen``."""
    return (t.view(torch.int16), True) if t.dtype == torch.bfloat16 else (t, False)


@triton.jit
def _swiglu_act_kernel(g_ptr, u_ptr, h_ptr, C, stride_g, stride_u, stride_h, limit, BLOCK: tl.constexpr,
                       G_BITS: tl.constexpr, U_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < C
    g = widen(tl.load(g_ptr + row * stride_g + offs, mask=m, other=0), G_BITS)
    u = widen(tl.load(u_ptr + row * stride_u + offs, mask=m, other=0), U_BITS)
    g = tl.where(g > limit, limit, g)  # clamp(max=limit); NaN fails the test and stays NaN
    u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    gd = g.to(tl.float64)
    h = (gd / (1.0 + tl.exp(-gd))) * u.to(tl.float64)
    tl.store(h_ptr + row * stride_h + offs, round_to(h.to(tl.float32), h_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, C] with unit column stride: a view where one exists (the column halves of a stacked
    GEMM's output keep their row stride), else a copy."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def swiglu_act(gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
    """silu(min(gate, limit)) · clamp(up, ±limit) in float64, rounded to ``dtype``: bitwise the torch
    backend (``dsv4.model.moe.swiglu_act``). gate, up: same shape, bf16 / fp16 / fp32, rows read with
    their own stride (e.g. the two column halves of the shared expert's [w1; w3] GEMM, no copies); h is
    contiguous."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu_act: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    for name, t in (("gate", gate), ("up", up)):
        if t.dtype not in _DTYPES:
            raise TypeError(f"swiglu_act: {name} must be bf16, fp16 or fp32, got {t.dtype}")
    if dtype not in _DTYPES:
        raise TypeError(f"swiglu_act: output dtype must be bf16, fp16 or fp32, got {dtype}")
    if up.device != gate.device:
        raise ValueError(f"swiglu_act: up is on {up.device}, gate on {gate.device}")
    h = torch.empty(gate.shape, dtype=dtype, device=gate.device)
    if h.numel():
        g2, u2, h2 = _rows(gate), _rows(up), h.view(-1, h.shape[-1]) if h.dim() else h.view(1, 1)
        (g, g_bits), (u, u_bits) = bf16_bits(g2), bf16_bits(u2)
        c = h2.shape[1]
        block = min(BLOCK, triton.next_power_of_2(c))
        _swiglu_act_kernel[(h2.shape[0], triton.cdiv(c, block))](
            g, u, h2, c, g.stride(0), u.stride(0), h2.stride(0), float(limit), BLOCK=block, G_BITS=g_bits,
            U_BITS=u_bits, num_warps=4 if block >= 512 else 1,
            enable_fp_fusion=False)  # no contraction: torch's roundings
    return h
