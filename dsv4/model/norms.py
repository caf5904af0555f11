"""RMSNorm variants. Statistics always in float32; the result is cast back to the input dtype."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weight-free RMSNorm (per-head q normalisation, mHC input normalisation)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
