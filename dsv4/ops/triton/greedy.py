"""Triton greedy pick: each logits row's first argmax and whether the row is all finite, in two launches.

``torch.argmax`` + ``torch.isfinite(..).all()`` on [n, V] logits is one single-block reduction per row
and a second pass (50 µs at n = 1, V = 129,280 on the H200, CUDA-graph timing, against 3 µs here:
``bench/kernels.py --only pick``). Here the vocabulary is split into fixed chunks of CHUNK ids:

1. one program per (row, chunk): the chunk's maximum, the first id holding it (a lane keeps its first
   strictly larger value; the lanes' candidates are then reduced to the smallest id among those equal
   to the maximum) and whether every value is finite;
2. one program per row: the chunks in id order reduced the same way.

So the pick is the lowest id among equal maxima, as ``torch.argmax`` (and the sampler's
``_first_argmax``) gives, and it does not depend on the other rows. A row with NaN or ±inf gets flag 0
and an unspecified (but in-range) id: its caller samples it on the host, which reports it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["greedy_pick"]

CHUNK = 4096  # vocabulary ids per first-stage program (32 programs a row at V = 129,280)
BLOCK = 1024  # ids per step inside a chunk


@triton.jit
def _first_max(v, i, BIG: tl.constexpr):
    """(max of v, smallest i among the lanes holding it)."""
    mx = tl.max(v, 0)
    return mx, tl.min(tl.where(v == mx, i, BIG), 0)


@triton.jit
def _chunk_kernel(x_ptr, val_ptr, idx_ptr, fin_ptr, V, stride_x, S,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    row = x_ptr + r.to(tl.int64) * stride_x
    start = c * CHUNK
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = start + offs * 0  # in range even when nothing beats -inf (an all-NaN chunk)
    fin = tl.full((BLOCK,), 1, tl.int32)
    for k0 in tl.static_range(0, CHUNK, BLOCK):
        i = start + k0 + offs
        m = i < V
        v = tl.load(row + i, mask=m, other=float("-inf")).to(tl.float32)
        fin = fin & (~m | (tl.abs(v) < float("inf"))).to(tl.int32)  # NaN and ±inf: 0
        upd = v > best  # ids grow along a lane: ties keep the first
        best = tl.where(upd, v, best)
        best_i = tl.where(upd, i, best_i)
    mx, first = _first_max(best, best_i, 2147483647)
    tl.store(val_ptr + r * S + c, mx)
    tl.store(idx_ptr + r * S + c, first)
    tl.store(fin_ptr + r * S + c, tl.min(fin, 0))


@triton.jit(do_not_specialize=["n"])
def _row_kernel(val_ptr, idx_ptr, fin_ptr, out_ptr, S, n, SP: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, SP)
    m = c < S
    v = tl.load(val_ptr + r * S + c, mask=m, other=float("-inf"))
    i = tl.load(idx_ptr + r * S + c, mask=m, other=2147483647)
    f = tl.load(fin_ptr + r * S + c, mask=m, other=1)
    _, first = _first_max(v, i, 2147483647)
    tl.store(out_ptr + r, first.to(tl.int64))
    tl.store(out_ptr + n + r, tl.min(f, 0).to(tl.int64))


def greedy_pick(x: torch.Tensor) -> torch.Tensor:
    """int64 [2, n]: row r's first-argmax id and whether row r of ``x`` [n, V] is all finite (the
    same values as ``dsv4.ops.torch_ops.greedy_pick`` for finite rows; see the module docstring)."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"greedy_pick: logits must be a float [n, V] tensor, got {x.dtype} {tuple(x.shape)}")
    n, V = x.shape
    if V == 0:
        raise ValueError("greedy_pick: logits have no columns")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((2, n), dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    S = triton.cdiv(V, CHUNK)
    val = torch.empty((n, S), dtype=torch.float32, device=x.device)
    idx = torch.empty((n, S), dtype=torch.int32, device=x.device)
    fin = torch.empty((n, S), dtype=torch.int32, device=x.device)
    _chunk_kernel[(n, S)](x, val, idx, fin, V, x.stride(0), S, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    _row_kernel[(n,)](val, idx, fin, out, S, n, SP=max(16, triton.next_power_of_2(S)), num_warps=1)
    return out
