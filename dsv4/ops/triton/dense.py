"""Batch-invariant dense GEMM and RMSNorm kernels (bf16 / fp16 / fp32 weights).

cuBLAS and torch's reductions choose algorithms (split-K, tile shapes) by the number of rows, so a
token's result changes with the batch it is in. These kernels fix every choice that sets a row's
arithmetic independently of M:

``dense_linear`` (y = x·wᵀ in the weight dtype, fp32 accumulation, as ``dsv4.model.linear.linear``
for a plain tensor weight): one tile configuration per weight dtype for all M (weight tile
BLOCK_N × activations BLOCK_M, swap-AB as in ``fp8_linear``: acc[n, m] = W_tile · x_tileᵀ). K is
cut into S fixed chunks chosen from (N, K) alone (``chunking``); a row's value is always

    y = round( ((0 + P_0) + P_1) + … + P_{S-1} ),   P_c = the dot chain over chunk c from 0,

so the chunking can be run two ways with bitwise the same result:

* fused (many tiles, e.g. prefill): one program per output tile loops over the chunks, keeping
  the chunk's accumulator apart and adding it to the total at the end of the chunk;
* split (few tiles, e.g. decode with small N): one program per (tile, chunk) writes P_c in fp32,
  and the tile's last program adds them in chunk order from 0 and rounds, in the same launch
  (``_common.SPLIT_FIXUP``; off: a second launch, ``_common.sum_in_order``, the same additions).

The mode depends on M (performance), the arithmetic does not. x is rounded to the weight dtype in
the kernel (``linear`` casts x first). fp32 weights use an IEEE fp32 dot (never TF32). The
interpreter does not use tl.dot (its bf16 dot is wrong and its fp32 dot is a BLAS call whose
per-row result depends on the row's position): ``dot_acc`` sums the products k by k there.

``rms_norm`` / ``unit_rms_norm`` (semantics of ``dsv4.model.norms``): one program per row, Σx²
accumulated per lane over fixed BLOCK_D column blocks and then tree-summed (BLOCK_D depends on the
row width only), r = 1/sqrt(Σx²/D + eps) with IEEE sqrt and division.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..invariance import DECODE_MAX_ROWS
from . import _common
from ._common import FIXUP_ROWS, cast, grouped_tile, interpreting, split_counters, split_sum_last, sum_in_order

__all__ = ["dense_linear", "rms_norm", "unit_rms_norm", "chunking", "config_for", "dot_acc", "CONFIGS", "rms_factor",
           "norm_launch"]

# One tile configuration per weight dtype for every M (changing an entry changes the bits of the
# results). bf16/fp16: wgmma tiles, 8 warps (two fp32 accumulators of 128×64 without spills);
# fp32: IEEE FMA dot (no TF32), a smaller tile for the same reason. num_stages only pipelines loads.
CONFIGS = {
    "16bit": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    "fp32": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16, num_warps=4, num_stages=3),
}
# Fused-mode launch tile for 16-bit weights at prefill sizes (M ≥ PREFILL_MIN_ROWS): only the MMA
# tile changes — K chunks (from the base tile) and K steps stay, so a row gets the same bits as in
# a decode launch (checked on the H200, tests/gpu). None: base tile.
PREFILL_16BIT = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4)  # H200 sweep:
# M = 8192, router 50.5 → 44.3 µs, CSA compressor 375 → 327, HCA compressor 197 → 162, indexer
# compressor 99 → 84; weights_proj (64 rows) was faster on the base tile (31.8 vs 39.6): PREFILL_MIN_N
# Split/fused launch tile for 16-bit weights at decode sizes (M ≤ DECODE_MAX_ROWS), chunks and K steps again those
# of the base tile: the narrowest MMA that holds M (BLOCK_M 16/32/64) and 64-row weight tiles, as fp8_linear's
# decode launch (there, H200: 20-35 % faster than the 64 × 128 tile at M = 1 and 8). None: the base tile.
DECODE_16BIT: dict | None = dict(BLOCK_N=64, num_warps=4, num_stages=4)
PREFILL_MIN_ROWS = 1024
PREFILL_MIN_N = 256
COMMON = dict(GROUP_M=8,
              TARGET_PROGRAMS=128,  # chunks are cut so that small-M launches have about this many programs
              MIN_CHUNK=512)        # ... but never fewer than 512 columns per chunk
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def config_for(dtype: torch.dtype, override: dict | None = None) -> dict:
    """The tile configuration for a weight of ``dtype`` (``override`` entries win)."""
    base = CONFIGS["fp32" if dtype == torch.float32 else "16bit"]
    return dict(COMMON, **base, **(override or {}))


def chunking(n: int, k: int, cfg: dict) -> int:
    """Columns per K chunk for an [n, k] weight under tile configuration ``cfg``: a function of the
    weight alone, so every M (and both launch modes) reduces K in the same order."""
    if cfg.get("chunk"):
        return int(cfg["chunk"])
    bk = cfg["BLOCK_K"]
    k_blocks = max(1, math.ceil(k / bk))
    n_tiles = max(1, math.ceil(n / cfg["BLOCK_N"]))
    want = math.ceil(cfg["TARGET_PROGRAMS"] / n_tiles)
    chunks = max(1, min(want, k // cfg["MIN_CHUNK"]))
    return math.ceil(k_blocks / chunks) * bk


@triton.jit
def dot_acc(a, b, acc, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """acc + a·b with fp32 accumulation. The interpreter's tl.dot is numpy's BLAS matmul, whose
    result for a row depends on the row's position in the tile; there the product is summed
    k by k instead (same values, position-independent). Compiled: tl.dot (IEEE fp32 for fp32)."""
    if INTERP:
        acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _chunk_dot(x_ptr, w_ptr, c, CHUNK, K, offs_m, offs_n, m_mask, n_mask,
               stride_xm, stride_xk, stride_wn, stride_wk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               IEEE: tl.constexpr, INTERP: tl.constexpr):
    """P_c = W_tile · x_tileᵀ over chunk c of K, accumulated in fp32 from 0."""
    offs_k = tl.arange(0, BLOCK_K)
    w_dtype = w_ptr.dtype.element_ty
    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, K), BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + kk[None, :] * stride_wk,
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = cast(x, w_dtype, INTERP)  # linear() rounds x to the weight dtype
        part = dot_acc(w, tl.trans(x), part, IEEE, INTERP)
    return part


@triton.jit(do_not_specialize=["M", "stride_yc"])
def _dense_kernel(x_ptr, w_ptr, y_ptr, M, N, K, CHUNK,
                  stride_xm, stride_xk, stride_wn, stride_wk, stride_yc, stride_ym, stride_yn,
                  out_ptr, cnt_ptr, stride_om, stride_on,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  SPLIT: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
                  FIXUP: tl.constexpr = False, N_PARTS: tl.constexpr = 1):
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None] * stride_yn  # M·N may pass 2^31
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:  # P_c of chunk c = program_id(1), in fp32; _common.sum_in_order adds them in order
        part = _chunk_dot(x_ptr, w_ptr, tl.program_id(1), CHUNK, K, offs_m, offs_n, m_mask, n_mask,
                          stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, INTERP)
        tl.store(y_ptrs + tl.program_id(1) * stride_yc, part, mask=mask)
        if FIXUP:  # the tile's last program sums the partials into out (no sum_in_order launch)
            split_sum_last(y_ptr, out_ptr, cnt_ptr, pid, pid_m * BLOCK_M, M, offs_n, n_mask, stride_yc, stride_ym,
                           stride_yn, stride_om, stride_on, N_PARTS, BLOCK_M, BLOCK_N, FIXUP_ROWS, INTERP)
    else:  # ((0 + P_0) + P_1) + …: the same sum in one program
        total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for c in range(0, tl.cdiv(K, CHUNK)):
            total += _chunk_dot(x_ptr, w_ptr, c, CHUNK, K, offs_m, offs_n, m_mask, n_mask,
                                stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, INTERP)
        tl.store(y_ptrs, cast(total, y_ptr.dtype.element_ty, INTERP), mask=mask)


def dense_linear(x: torch.Tensor, w: torch.Tensor, *, config: dict | None = None,
                 mode: str | None = None, chunk_rows: int | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x·wᵀ for x [..., K] and a bf16/fp16/fp32 weight w [N, K]; y has the weight's dtype
    (``out_dtype`` torch.float32: the fp32 accumulator unrounded, e.g. the router's logits).

    ``mode`` ("fused"/"split") forces the launch mode (tests: both give the same bits);
    ``config`` overrides ``config_for(w.dtype)`` entries (changes the bits: use one for every call).
    ``config["prefill"]``: the fused-mode tile at M ≥ PREFILL_MIN_ROWS (BLOCK_M, BLOCK_N, num_warps,
    num_stages; default ``PREFILL_16BIT`` for 16-bit weights), K chunks and steps unchanged;
    ``config["decode"]``: the same at M ≤ DECODE_MAX_ROWS (BLOCK_N, num_warps, num_stages; BLOCK_M from M;
    default ``DECODE_16BIT``).
    ``chunk_rows``: reduce K as for a weight of that many rows — w stacks weights of that height
    (e.g. a compressor's [wkv; wgate]), and each block of rows gets the bits of its own call.
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise TypeError(f"dense_linear needs a 2-D weight tensor, got {type(w).__name__} "
                        f"{tuple(getattr(w, 'shape', ()))}")
    if w.dtype not in _DTYPES:
        raise TypeError(f"weight must be bf16, fp16 or fp32, got {w.dtype}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]} but the weight is {tuple(w.shape)}")
    cfg = config_for(w.dtype, config)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out_dtype = out_dtype or w.dtype
    if out_dtype not in (w.dtype, torch.float32):
        raise TypeError(f"out_dtype must be the weight's dtype ({w.dtype}) or torch.float32, got {out_dtype}")
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(*lead, n, dtype=out_dtype, device=x.device)
    chunk = chunking(chunk_rows or n, k, cfg)
    if chunk % cfg["BLOCK_K"]:
        raise ValueError(f"chunk {chunk} must be a multiple of BLOCK_K={cfg['BLOCK_K']}")
    n_chunks = math.ceil(k / chunk)
    tiles = math.ceil(m / cfg["BLOCK_M"]) * math.ceil(n / cfg["BLOCK_N"])
    if mode is None:
        mode = "split" if n_chunks > 1 and tiles < cfg["TARGET_PROGRAMS"] else "fused"
    if mode not in ("fused", "split"):
        raise ValueError(f"mode must be 'fused' or 'split', got {mode!r}")
    split = mode == "split"
    decode = (config or {}).get("decode", DECODE_16BIT if w.dtype != torch.float32 else None)
    if decode and m <= DECODE_MAX_ROWS:  # launch tile only (chunks and mode fixed above)
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        cfg = dict(cfg, BLOCK_M=bm, **{key: decode[key] for key in ("BLOCK_N", "num_warps", "num_stages")})
        tiles = math.ceil(m / cfg["BLOCK_M"]) * math.ceil(n / cfg["BLOCK_N"])
    prefill = (config or {}).get("prefill", PREFILL_16BIT if w.dtype != torch.float32 else None)
    if prefill and not split and m >= PREFILL_MIN_ROWS and n >= PREFILL_MIN_N:  # launch tile only (chunks fixed)
        cfg = dict(cfg, **{key: prefill[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")})
        tiles = math.ceil(m / cfg["BLOCK_M"]) * math.ceil(n / cfg["BLOCK_N"])
    interp = interpreting()
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    dst = torch.empty((n_chunks, m, n), dtype=torch.float32, device=x.device) if split else y
    ys = dst.stride() if split else (0, *y.stride())
    fixup = split and _common.SPLIT_FIXUP
    cnt = split_counters(x.device, tiles) if fixup else y  # (unread unless fixup)
    _dense_kernel[(tiles, n_chunks if split else 1)](
        x2, w, dst, m, n, k, chunk,
        x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), ys[0], ys[1], ys[2],
        y, cnt, y.stride(0), y.stride(1),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        SPLIT=split, IEEE=w.dtype == torch.float32, INTERP=interp, FIXUP=fixup, N_PARTS=n_chunks if fixup else 1,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split and not fixup:
        sum_in_order(dst, y)
    return y.reshape(*lead, n)


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------

@triton.jit
def rms_factor(xr, D, d_f, eps, BLOCK_D: tl.constexpr):
    """1/sqrt(Σx²/D + eps) of the unit-stride row at ``xr`` as a [1] fp32 tensor: Σx² accumulated per
    lane over BLOCK_D column blocks, then tree-summed. Shared with the fused KV insert
    (``kv_insert.kv_norm_rope_insert``), which must get the same bits: launch it with ``norm_launch``."""
    offs = tl.arange(0, BLOCK_D)
    sq = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        x = tl.load(xr + d0 + offs, mask=d0 + offs < D, other=0.0).to(tl.float32)
        sq += x * x
    zero = tl.zeros((1,), tl.float32)  # div_rn/sqrt_rn need operands of one shape
    ms = tl.div_rn(tl.sum(sq, axis=0) + zero, tl.cast(d_f, tl.float32) + zero)
    return tl.div_rn(zero + 1.0, tl.sqrt_rn(ms + tl.cast(eps, tl.float32)))


def norm_launch(d: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps) of the RMSNorm of a row of ``d``: a function of D only (the reduction
    order of ``rms_factor`` depends on both)."""
    block = min(triton.next_power_of_2(d), 2048)
    return block, 4 if block >= 512 else 1


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, d_f, eps, stride_x, stride_y,
                     HAS_W: tl.constexpr, UNIT: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    xr = x_ptr + row * stride_x
    r = rms_factor(xr, D, d_f, eps, BLOCK_D)
    dt = y_ptr.dtype.element_ty
    if UNIT:  # x * rsqrt(...).to(x.dtype): the factor is rounded, the product is in x's dtype
        r = cast(r, dt, INTERP).to(tl.float32)
    for d0 in range(0, D, BLOCK_D):
        m = d0 + offs < D
        y = tl.load(xr + d0 + offs, mask=m, other=0.0).to(tl.float32) * r
        if HAS_W:
            y = tl.load(w_ptr + d0 + offs, mask=m, other=0.0).to(tl.float32) * y
        tl.store(y_ptr + row * stride_y + d0 + offs, cast(y, dt, INTERP), mask=m)


def _norm(x: torch.Tensor, weight, eps: float, unit: bool) -> torch.Tensor:
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    d = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"norm weight must be [{d}] for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    x2 = x.reshape(-1, d)
    if d and x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows == 0 or d == 0:
        return y.reshape(x.shape)
    w = weight.contiguous() if weight is not None else x2  # dummy pointer when there is no weight
    block, warps = norm_launch(d)
    _rms_norm_kernel[(rows,)](x2, w, y, d, float(d), float(eps), x2.stride(0), y.stride(0),
                              HAS_W=weight is not None, UNIT=unit, BLOCK_D=block, INTERP=interpreting(),
                              num_warps=warps)
    return y.reshape(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``dsv4.model.norms.rms_norm``: fp32 statistics, fp32 weight multiply, cast to x's dtype."""
    return _norm(x, weight, eps, unit=False)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``dsv4.model.norms.unit_rms_norm``: the fp32 factor rounded to x's dtype, product in x's dtype."""
    return _norm(x, None, eps, unit=True)
