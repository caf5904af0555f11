"""RMSNorm variants. Statistics always in float32; the result is cast back to the input dtype."""

from __future__ import annotations

import torch

from .kernels import kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    fast = kernel("rms_norm")
    if fast is not None:
        return fast(x, weight, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weight-free RMSNorm (per-head q normalisation, mHC input normalisation)."""
    fast = kernel("unit_rms_norm")
    if fast is not None:
        return fast(x, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
