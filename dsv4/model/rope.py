"""Interleaved (GPT-J) rotary embedding on the trailing ``rope_dim`` channels.

Pairs are (2i, 2i+1) of the rope slice; pair i turns by ``position · inv_freq[i]``. The inverse
rotation (negated angle) removes the rope from the attention output at the query position.
"""

from __future__ import annotations

import torch

from ..config import RopeParams
from .step import per_forward

_INV_FREQ_CACHE: dict[tuple, torch.Tensor] = {}


def inv_freq(params: RopeParams, device) -> torch.Tensor:
    key = (params, str(device))
    t = _INV_FREQ_CACHE.get(key)
    if t is None:
        t = _INV_FREQ_CACHE[key] = params.inv_freq().to(device)
    return t


def cos_sin(params: RopeParams, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, rope_dim/2] in float32 for integer ``positions`` [T]; within a forward
    (``step.shared_tables``) computed once per positions tensor and rope parameters: every layer of a
    type shares its table (7 small kernels a layer fewer on the GPU)."""
    return per_forward(params, positions, lambda p: _cos_sin(params, p))


def _cos_sin(params: RopeParams, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = (positions.to(torch.float32)[:, None] * inv_freq(params, positions.device)[None, :]).double()
    return freqs.cos().float(), freqs.sin().float()  # float64 transcendental: batch-invariant


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
               in_place: bool = False) -> torch.Tensor:
    """Rotate the last ``2*cos.shape[-1]`` channels of ``x`` [T, ..., D]; returns a new tensor.

    ``cos``/``sin`` are [T, R/2] and broadcast over the middle (head) dims. Math in float32.
    ``in_place``: the caller gives ``x`` up, so a kernel may rotate it where it lies (the result is
    the same; this torch code always returns a new tensor).
    """
    rd = cos.shape[-1] * 2
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    rope = x[..., -rd:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rot = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rot.to(x.dtype)], dim=-1)


def unit_norm_rope(ops, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The query's per-head weight-free RMSNorm, then RoPE, with the op set ``ops``' two building blocks
    (a kernel of its own does both in one launch: the GPU path reads q once instead of once per op)."""
    return ops.apply_rope(ops.unit_rms_norm(x, eps), cos, sin)
