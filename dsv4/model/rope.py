"""Interleaved (GPT-J) rotary embedding on the trailing ``rope_dim`` channels.

Pairs are (2i, 2i+1) of the rope slice; pair i turns by ``position · inv_freq[i]``. The inverse
rotation (negated angle) removes the rope from the attention output at the query position.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..config import RopeParams

_INV_FREQ_CACHE: dict[tuple, torch.Tensor] = {}


def inv_freq(params: RopeParams, device) -> torch.Tensor:
    key = (params, str(device))
    t = _INV_FREQ_CACHE.get(key)
    if t is None:
        t = _INV_FREQ_CACHE[key] = params.inv_freq().to(device)
    return t


_FORWARD_TABLES: dict | None = None  # (params, id, version of positions) → (positions, cos, sin)


@contextmanager
def shared_tables():
    """Within the ``with`` body (one forward), ``cos_sin`` of the same positions tensor and rope
    parameters is computed once: every layer of a type shares its table (7 small kernels a layer
    fewer on the GPU). The entry keeps the positions tensor alive and checks its version, so a
    tensor modified in place, or a new one at a reused address, is never served a stale table."""
    global _FORWARD_TABLES
    before, _FORWARD_TABLES = _FORWARD_TABLES, {}
    try:
        yield
    finally:
        _FORWARD_TABLES = before


def cos_sin(params: RopeParams, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, rope_dim/2] in float32 for integer ``positions`` [T]."""
    memo = _FORWARD_TABLES
    if memo is not None:
        key = (params, id(positions), positions._version)
        hit = memo.get(key)
        if hit is not None and hit[0] is positions:
            return hit[1], hit[2]
    freqs = (positions.to(torch.float32)[:, None] * inv_freq(params, positions.device)[None, :]).double()
    cos, sin = freqs.cos().float(), freqs.sin().float()  # float64 transcendental: batch-invariant
    if memo is not None:
        memo[key] = (positions, cos, sin)
    return cos, sin


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
