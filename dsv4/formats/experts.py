"""Routed experts stacked per layer in their checkpoint encoding (no dequantization).

* FP4 (MXFP4): w13 uint8 [E, 2I, H/2] (W1 rows then W3 rows; low nibble = even element),
  s13 uint8 [E, 2I, H/32]; w2 uint8 [E, H, I/2], s2 uint8 [E, H, I/32] (UE8M0 bytes). The scales
  are stored groups-major (a transposed view of [E, H/32, 2I] storage, row stride 1): the grouped
  Triton kernels read one K step's scale bytes for a block of adjacent rows, which are then
  adjacent in memory instead of one 32-byte sector per row (H200: 11-12 % faster MoE at T = 1..1024).
  The values and logical shape are the checkpoint's; every op
  indexes them through strides.
* FP8 (Base checkpoint): w13 float8_e4m3fn [E, 2I, H], s13 [E, 2·ceil(I/128), ceil(H/128)]
  (W1's block rows then W3's; float32 or UE8M0 bytes); w2 [E, H, I], s2 [E, ceil(H/128), ceil(I/128)].
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["stack_experts", "stack_experts_from_checkpoint", "expert_dtype_of", "as_bytes"]

_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """int8 packed FP4 and float8_e8m0fnu scales as raw uint8 bytes; everything else unchanged."""
    if t.dtype == torch.int8 or (_E8M0 is not None and t.dtype == _E8M0):
        return t.view(torch.uint8)
    return t


def expert_dtype_of(w13: torch.Tensor, w2: torch.Tensor | None = None) -> str:
    """"fp4" for packed bytes (uint8/int8), "fp8" for float8 weights."""
    if w13.dtype in (torch.uint8, torch.int8):
        return "fp4"
    if w13.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        return "fp8"
    raise TypeError(f"expert weights must be packed FP4 bytes (uint8/int8) or float8, got {w13.dtype}")



def _stack(n: int, fetch: Callable[[int], tuple], device):
    """Allocate from expert 0's tensors, then copy each expert's six tensors in (one expert live at a time)."""
    if n <= 0:
        raise ValueError("need at least one expert")
    first = [as_bytes(t) for t in fetch(0)]
    a1, b1, a3, b3, a2, b2 = first
    if a1.shape != a3.shape or b1.shape != b3.shape:
        raise ValueError(f"w1 {tuple(a1.shape)}/{tuple(b1.shape)} and w3 {tuple(a3.shape)}/{tuple(b3.shape)} "
                         "shapes differ")
    device = torch.device(device) if device is not None else a1.device
    i, nb = a1.shape[0], b1.shape[0]
    w13 = torch.empty((n, 2 * i, *a1.shape[1:]), dtype=a1.dtype, device=device)
    w2s = torch.empty((n, *a2.shape), dtype=a2.dtype, device=device)
    if a1.dtype == torch.uint8:  # MXFP4: scales groups-major (module doc)
        s13 = torch.empty((n, b1.shape[1], 2 * nb), dtype=b1.dtype, device=device).transpose(1, 2)
        s2s = torch.empty((n, b2.shape[1], b2.shape[0]), dtype=b2.dtype, device=device).transpose(1, 2)
    else:
        s13 = torch.empty((n, 2 * nb, *b1.shape[1:]), dtype=b1.dtype, device=device)
        s2s = torch.empty((n, *b2.shape), dtype=b2.dtype, device=device)
    for e in range(n):
        t1, c1, t3, c3, t2, c2 = first if e == 0 else [as_bytes(t) for t in fetch(e)]
        w13[e, :i].copy_(t1)
        w13[e, i:].copy_(t3)
        s13[e, :nb].copy_(c1)
        s13[e, nb:].copy_(c3)
        w2s[e].copy_(t2)
        s2s[e].copy_(c2)
    return w13, s13, w2s, s2s


def stack_experts(w1: Sequence[torch.Tensor], s1: Sequence[torch.Tensor], w3: Sequence[torch.Tensor],
                  s3: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], s2: Sequence[torch.Tensor],
                  device=None):
    """Per-expert checkpoint tensors -> (w13, s13, w2, s2), stacked as described in the module doc.

    FP4 experts: ``w*`` int8/uint8 [out, in/2], ``s*`` float8_e8m0fnu/uint8 [out, in/32].
    FP8 experts: ``w*`` float8_e4m3fn [out, in], ``s*`` float32 or UE8M0 [ceil(out/128), ceil(in/128)].
    The bytes are copied as they are (int8 → uint8 view, e8m0 → uint8 view), expert by expert,
    into preallocated tensors on ``device``: nothing is dequantized.
    """
    n = len(w1)
    if not (len(s1) == len(w3) == len(s3) == len(w2) == len(s2) == n):
        raise ValueError("stack_experts needs the same number of w1/s1/w3/s3/w2/s2 tensors")
    return _stack(n, lambda e: (w1[e], s1[e], w3[e], s3[e], w2[e], s2[e]), device)


def stack_experts_from_checkpoint(get: Callable[[str], torch.Tensor], prefix: str, n_experts: int,
                                  device=None, first: int = 0):
    """``stack_experts`` reading ``get(f"{prefix}.experts.{e}.w1.weight")`` etc. one expert at a
    time (e.g. ``get = Checkpoint.get``, ``prefix = "layers.3.ffn"``). ``first``: the stack holds
    experts first..first+n_experts-1 (expert parallelism: one rank's experts)."""
    def fetch(e):
        p = f"{prefix}.experts.{e + first}"
        return tuple(get(f"{p}.{w}.{k}") for w in ("w1", "w3", "w2") for k in ("weight", "scale"))

    return _stack(n_experts, fetch, device)
