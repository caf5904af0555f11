"""Triton mHC: ``hc_pre`` in two launches, ``hc_post`` in one (oracle: ``dsv4.model.mhc``).

hc_pre replaces ~80 tiny launches (float64 gates, a 20-iteration Sinkhorn in torch) with:

1. ``_mix_kernel``, program = (BLOCK_T tokens, one SPLIT-column slice of the flattened streams
   x [T, n·H]): partial mixes fn·xᵀ (fn zero-padded from 2n+n² to NMIX_P rows) and the partial Σx²
   in the spare row NMIX, stored to part [S, T, NMIX_P] fp32. The dot (``_mix_dot``) has fn's rows on
   the MMA's M side and the tokens on its N side; for bf16 streams it is three bf16 tensor-core dots
   against fn's exact three-way bf16 split (``fn_parts``, made once per fn; every product exact, fp32
   accumulation); for fp16 / fp32 streams an IEEE fp32 dot (CUDA-core FMAs). ``dense.dot_acc``:
   tl.dot compiled, a k-by-k sum in the interpreter.
2. ``_gate_kernel``, program = (BLOCK_T tokens, one H_SLICE of the hidden size, or the one after the
   last): the S partials summed in slice order, r = 1/sqrt(Σx²/(n·H) + eps) (IEEE fp32, as torch's
   rsqrt on CPU), mixes = r·(fn·xᵀ); then in **float64** like the oracle, each rounded to fp32: the
   slices' programs make pre = sigmoid + eps and the collapse Σ_i pre_i·R_i of their slice in fp32
   (i in order), rounded to the stream dtype; the last program makes post = 2·sigmoid and
   comb = Sinkhorn(softmax + eps) (20 serial iterations, off the collapse's path). With ``norm`` (the
   sub-layer's RMSNorm weight) each collapse program holds whole rows (NORM_BLOCK_H columns a step) and
   normalises them in place, replacing the RMSNorm launch after it: Σx² of the rounded rows per lane,
   the lanes in a fixed tree (``_sum_lanes``), then x·r·w as ``dense._rms_norm_kernel`` forms it. Every
   Triton hc_pre / mhc_post_pre with a norm takes this form, so a token's bits do not depend on T. The
   collapse with the norm runs as ``_collapse_rows_kernel`` where a program's rows fit its registers
   (``NORM_ROWS``; Flash at one token a program, bf16 streams): the same arithmetic in the same order, with the
   streams and the norm weight loaded before anything waits on the partials and the rounded rows kept in
   registers (the loop form waits on a round trip a step, twice); its post/comb program is then ``_comb_kernel``,
   a launch of its own. With ``SINKHORN_BESIDE``, inside a decode graph's capture
   (``dsv4.ops.streams.point``) the post/comb program is a launch of its own on a side stream
   (``SINKHORN_LANE``) from the same point, launched after the collapse's: only the next hc_post reads
   post and comb, so its Sinkhorn (20 dependent float64 normalisations, the gate launch's longest program)
   leaves the path the sub-layer waits on. Both launches run the same programs (``pid_h0`` offsets the
   second): the same bits; post and comb are returned as ``branches.Pending`` values, which hc_post resolves.

The oracle normalises x before the GEMM ((x·r)·fnᵀ); here r is applied after (r·(fn·xᵀ)), one
rounding apart per product: the mixes differ from the oracle by summation order and that
rounding only (fp32 level). hc_eps enters the float64 math exactly, passed as three fp32 parts
(Triton float arguments are fp32).

Batch invariance: the slice width SPLIT, the K step MIX_BLOCK_K and the order in which steps and
slices are summed are constants (S depends on n·H only), so a token's arithmetic never depends on T
or on its row position. A token is one column of the mixes MMA, reduced by the same k steps whatever
the tile's width or warps, and its Σx² lanes are summed in a fixed tree (``_sum_lanes``, not tl.sum,
whose order follows the register layout): so tokens per program and warps follow T (the H200 sweep
found the same bits for 1 to 32 tokens and 1 to 8 warps). n need not be a power of two (padded to NP
with masked lanes); n = 4 in the release.

hc_post, program = (BLOCK_T tokens, BLOCK_H columns): R'[j] = Σ_i comb[i, j]·R[i] + post[j]·out
with the oracle's roundings in the stream dtype dt: post and comb rounded to dt, post·out rounded
to dt, the sum over i in fp32 (i in order) rounded to dt, and the final add rounded to dt.

mhc_post_pre = hc_post followed by the next hc_pre, in two launches instead of three:
``_post_mix_kernel``, program = (BLOCK_T tokens, one SPLIT-column slice of the flattened new
streams y [T, n·H]), computes y for its slice with ``_post_kernel``'s arithmetic and roundings,
stores it, and in the same MIX_BLOCK_K steps accumulates the slice's partial mixes and Σy² exactly
as ``_mix_kernel`` would after reading y back (same steps, same ``_mix_dot``), into the same
``part``; ``_gate_kernel`` then finishes the pre. Each step lies in one stream j when H and
SPLIT are multiples of MIX_BLOCK_K (j = k0 // H); otherwise, and above POST_MIX_FUSED_MAX_T tokens (where
the two kernels apart were measured faster), the op runs hc_post then hc_pre. Every
result is bitwise that of hc_post + hc_pre, so it is batch-invariant for the same reasons.
"""

from __future__ import annotations

import functools
import math
import struct
import weakref

import torch
import triton
import triton.language as tl

from ...model.branches import Pending, resolve
from .. import streams as lanes
from ..invariance import DECODE_MAX_ROWS
from ._common import cast, interpreting
from .dense import dot_acc

__all__ = ["hc_pre", "hc_post", "mhc_post_pre", "fusable", "CONFIG"]

# SPLIT, MIX_BLOCK_K and MIX_BF16X3 set the reduction order of a token's arithmetic (one value for every T);
# the rest are launch shapes (the same bits at any value). H200 sweeps: ``bench/kernels.py --sweep --only
# mhc_decode`` (CUDA-graph µs of mhc_post_pre; T ≤ 64 fused, above hc_post then hc_pre).
CONFIG = dict(
    SPLIT=256,       # columns of x [T, n·H] per mixes program (S = ceil(n·H / SPLIT) partials); T = 1: 14.6 µs
    # against 27.4 at 128 and 18.7 at 512
    MIX_BLOCK_K=32,  # columns per dot step (also the Σx² lanes: it sets that sum's order)
    MIX_BF16X3=True,  # bf16 streams: the mixes as three exact bf16 tensor-core dots (``_mix_dot``)
    MIX_BLOCK_T=64,  # tokens per mixes program above DECODE_MAX_ROWS tokens (T = 8192 with 2 warps: 474 µs,
    # 489 at 32 tokens and 1 warp, 576 at 16)
    MIX_WARPS_PREFILL=2,  # mixes warps above DECODE_MAX_ROWS tokens (hc_pre's, and mhc_post_pre's when fused)
    MIX_BLOCK_T_DECODE=8,  # tokens per mixes program up to DECODE_MAX_ROWS tokens (T = 1 / 8 / 64 at 4 warps:
    # 14.6 / 14.8 / 24.2 µs; 4 tokens 14.2 / 14.3 / 26.6, 1 token 19.6 / 22.0 / 81.5, 32 tokens 20.3 / 20.5 / 21.2)
    MIX_WARPS=1,     # mixes warps up to DECODE_MAX_ROWS tokens (8 tokens, T = 1 / 8 / 64: 1 warp 13.7 / 13.6 / 16.3
    # µs, 2 warps 13.6 / 13.6 / 18.9, 4 warps 14.6 / 14.8 / 24.2, 8 warps 15.5 / 15.5 / 27.7)
    POST_MIX_FUSED_MAX_T=DECODE_MAX_ROWS,  # mhc_post_pre above this many tokens runs hc_post, then hc_pre (the
    # same bits; None: always fused)
    GATE_BLOCK_T=2,  # tokens per gate/collapse program (every value swept gave the same bits)
    GATE_WARPS=1,    # warps per gate/collapse program; H200, hc_pre CUDA-graph µs at T = 1 / 64 / 8192: 8 tokens
    # at 4 warps 20.6 / 23.2 / 374.2, 2 at 1 warp 18.3 / 18.8 / 298.0, every variant the same bits
    H_SLICE=1024,    # hidden columns per collapse program (256 to 2048: the same µs, the Sinkhorn's program is the
    # launch's longest: the gate launch alone 7.8 µs at T = 1)
    GATE_BLOCK_H=256,  # hidden columns per collapse step
    NORM_BLOCK_H=1024,  # with the sub-layer's RMSNorm (``norm``): columns per collapse step, also the Σx² lanes
    # (it sets that sum's order); a program holds whole rows
    NORM_GATE_BLOCK_T=1,  # tokens per gate/collapse program with the RMSNorm (every value: the same bits)
    NORM_GATE_WARPS=2,    # its warps; H200, ``--sweep --only mhc_norm``, mhc_post_pre with the norm at T = 1 / 64 /
    # 1024: 1 token at 1 warp 14.3 / 17.5 / 69.3 µs, at 2 warps 13.8 / 17.0 / 82.7, 2 tokens at 2 warps 13.3 / 16.2 /
    # 65.4 (at 43 layers slower: 9.05 against 8.92 ms a batch-1 step, one call), 4 at 4 warps 18.0 / 21.4 / 84.5;
    # the former pair (the op, then the RMSNorm launch) 16.2 / 19.2 / 68.6
    NORM_ROWS=True,  # with the norm and bf16 streams, the collapse as ``_collapse_rows_kernel`` (``_rows_form``)
    NORM_ROWS_WARPS=4,  # its warps (ptxas, sm_90a, Flash: 255 registers, no spill at 4; 8 convert the tile through
    # shared memory, 2 spill 416 B)
    NORM_ROWS_MAX_VALUES=16384,  # the largest stream tile (tokens × streams × padded columns) it holds in registers
    POST_BLOCK_T=4,    # tokens per hc_post program (elementwise: any value gives the same bits)
    POST_BLOCK_H=256,  # hidden columns per hc_post program
)
# In a decode graph, the post/comb program as a launch of its own on a side stream. With the rows form (above), on an
# H100, 43 layers, one call (bench/e2e.py --arm, both on against both off): batch 1 9.37 against 9.51 ms a step (the
# defaults again at the end 9.57), batch 8 15.73 against 15.96, the same greedy tokens, and the same logits as the
# loop form with the Sinkhorn in the gate launch (tests/gpu/test_gpu_branches.py). With the loop form it gained nothing
# (H200: 9.13 against 9.14 ms): its collapse program was as long as the Sinkhorn.
SINKHORN_BESIDE = True
SINKHORN_LANE = 3  # its lane (``dsv4.ops.streams``; the attention's branches use 0 to 2, the shared expert 0)


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]  # round to nearest fp32


@functools.lru_cache(maxsize=16)
def _f64_parts(v: float) -> tuple[float, float, float]:
    """Three fp32 values whose exact sum is the double ``v`` (24 + 24 + 24 ≥ 53 bits)."""
    hi = _f32(v)
    mid = _f32(v - hi)
    return hi, mid, _f32(v - hi - mid)


@triton.jit
def _mix_dot(fn_ptr, offs_c, kk, c_mask, k_mask, stride_fn, stride_fp, x, acc,
             BF16X3: tl.constexpr, INTERP: tl.constexpr):
    """acc + f·x for the mixes: f = fn's rows offs_c at columns kk [NMIX_P, BLOCK_K] (the MMA's M side),
    x [BLOCK_K, BLOCK_T] fp32 (the tokens, its N side: a token's column is reduced by the same MMA k steps
    whatever BLOCK_T and the warp count, so those can follow T). BF16X3 (x holds bf16 values): fn_ptr is
    ``fn_parts``' [3, NMIX_P, K] bf16 (hi, mid, lo; part stride stride_fp), fn's exact split, so every
    product part·x is exact in fp32 and the three tensor-core dots (smallest part first) carry the whole
    fp32 product; else fn fp32 and one IEEE fp32 dot (CUDA-core FMAs, k in order in one thread). The
    interpreter sums each dot k by k (``dense.dot_acc``)."""
    fp = fn_ptr + offs_c[:, None] * stride_fn + kk[None, :]
    fm = c_mask[:, None] & k_mask[None, :]
    if BF16X3:
        xb = x.to(tl.bfloat16)
        acc = dot_acc(tl.load(fp + 2 * stride_fp, mask=fm, other=0.0), xb, acc, False, INTERP)
        acc = dot_acc(tl.load(fp + stride_fp, mask=fm, other=0.0), xb, acc, False, INTERP)
        acc = dot_acc(tl.load(fp, mask=fm, other=0.0), xb, acc, False, INTERP)
    else:
        acc = dot_acc(tl.load(fp, mask=fm, other=0.0).to(tl.float32), x, acc, True, INTERP)
    return acc


@triton.jit
def _sum_lanes(v, LANES: tl.constexpr):
    """Σ over axis 0 of v [LANES, BLOCK_T] (LANES a power of two) as a fixed pairwise tree (rows 2i and
    2i + 1 first): tl.sum's order follows the register layout, which follows the tile's shape and warps;
    this order does not, so a token's Σx² is the same at every BLOCK_T."""
    for _ in tl.static_range(LANES.bit_length() - 1):
        a, b = tl.split(tl.permute(tl.reshape(v, (v.shape[0] // 2, 2, v.shape[1])), (0, 2, 1)))
        v = a + b
    return tl.reshape(v, (v.shape[1],))


@triton.jit
def _store_part(part_ptr, acc, sq, pid_s, rows, t_mask, offs_c, stride_ps, stride_pt,
                NMIX: tl.constexpr, BLOCK_K: tl.constexpr):
    """A slice's partial mixes acc [NMIX_P, BLOCK_T] with its Σx² (lanes sq [BLOCK_K, BLOCK_T]) in column
    NMIX, stored to part[pid_s, token, :]."""
    ss = _sum_lanes(sq, BLOCK_K)
    acc = tl.where(offs_c[:, None] == NMIX, ss[None, :], acc)
    tl.store(part_ptr + pid_s * stride_ps + rows[None, :] * stride_pt + offs_c[:, None], acc, mask=t_mask[None, :])


@triton.jit(do_not_specialize=["T"])
def _mix_kernel(x_ptr, fn_ptr, part_ptr, T, K, stride_xt, stride_fn, stride_fp, stride_ps, stride_pt,
                NMIX: tl.constexpr, NMIX_P: tl.constexpr, SPLIT: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BF16X3: tl.constexpr, INTERP: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, NMIX_P)
    offs_k = tl.arange(0, BLOCK_K)
    t_mask = offs_t < T
    c_mask = offs_c < NMIX
    rows = offs_t.to(tl.int64)  # row offsets in int64: T·n·H passes 2^31 near T = 131k
    acc = tl.zeros((NMIX_P, BLOCK_T), dtype=tl.float32)
    sq = tl.zeros((BLOCK_K, BLOCK_T), dtype=tl.float32)
    k_begin = pid_s * SPLIT
    k_end = tl.minimum(k_begin + SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        x = tl.load(x_ptr + rows[None, :] * stride_xt + kk[:, None],
                    mask=k_mask[:, None] & t_mask[None, :], other=0.0).to(tl.float32)
        sq += x * x
        acc = _mix_dot(fn_ptr, offs_c, kk, c_mask, k_mask, stride_fn, stride_fp, x, acc, BF16X3, INTERP)
    _store_part(part_ptr, acc, sq, pid_s, rows, t_mask, offs_c, stride_ps, stride_pt, NMIX, BLOCK_K)


@triton.jit
def _sigmoid64(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _sum_slices(ptrs, mask, stride_ps, S: tl.constexpr):
    """Σ over the S slice partials at ``ptrs`` (slice 0's), in slice order from 0.0; unrolled, so the loads
    of all slices are issued together instead of one L2 round trip per slice (a runtime loop: ~64 in series)."""
    acc = tl.zeros(ptrs.shape, dtype=tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(ptrs + s * stride_ps, mask=mask, other=0.0)
    return acc


@triton.jit
def _gate_scalars(part_ptr, rows, t_mask, k_f, rms_eps, e_hi, e_mid, e_lo, stride_ps, stride_pt,
                  S: tl.constexpr, NMIX: tl.constexpr):
    """(the tokens' partial rows, r = 1/sqrt(Σx²/(n·H) + eps) in fp32, hc_eps as a float64) for the gate programs."""
    row = part_ptr + rows * stride_pt
    ss = _sum_slices(row + NMIX, t_mask, stride_ps, S)
    ms = tl.div_rn(ss, tl.cast(k_f, tl.float32) + tl.zeros_like(ss)) + tl.cast(rms_eps, tl.float32)
    r = tl.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.sqrt_rn(ms))
    eps = (tl.cast(e_hi, tl.float64) + tl.cast(e_mid, tl.float64)) + tl.cast(e_lo, tl.float64)
    return row, r, eps


@triton.jit
def _pre_gates(row, r, eps, t_mask, base_ptr, scale_ptr, stride_ps, S: tl.constexpr, N: tl.constexpr,
               NP: tl.constexpr):
    """pre = sigmoid(r·mixes·scale0 + base) + eps [BLOCK_T, NP] in float64, rounded to fp32 (padded streams 0)."""
    offs_i = tl.arange(0, NP)
    i_ok = offs_i < N
    pre_m = _sum_slices(row[:, None] + offs_i[None, :], t_mask[:, None] & i_ok[None, :], stride_ps, S)
    sc0 = tl.load(scale_ptr).to(tl.float64)
    b_pre = tl.load(base_ptr + offs_i, mask=i_ok, other=0.0).to(tl.float64)
    return (_sigmoid64((pre_m * r[:, None]).to(tl.float64) * sc0 + b_pre[None, :]) + eps).to(tl.float32)


@triton.jit
def _post_comb(row, r, eps, rows, t_mask, base_ptr, scale_ptr, post_ptr, comb_ptr, iters, stride_ps, stride_pot,
               stride_cbt, S: tl.constexpr, N: tl.constexpr, NP: tl.constexpr):
    """post = 2·sigmoid and comb = Sinkhorn(softmax + eps) of the tokens' summed partials, in float64 (as the
    oracle), stored as fp32."""
    offs_i = tl.arange(0, NP)
    i_ok = offs_i < N
    m2 = t_mask[:, None] & i_ok[None, :]
    ij_ok = i_ok[:, None] & i_ok[None, :]  # [NP(i), NP(j)]
    m3 = t_mask[:, None, None] & ij_ok[None, :, :]
    cidx = offs_i[:, None] * N + offs_i[None, :]
    post_m = _sum_slices(row[:, None] + N + offs_i[None, :], m2, stride_ps, S)
    comb_m = _sum_slices(row[:, None, None] + 2 * N + cidx[None, :, :], m3, stride_ps, S)
    sc1 = tl.load(scale_ptr + 1).to(tl.float64)
    sc2 = tl.load(scale_ptr + 2).to(tl.float64)
    b_post = tl.load(base_ptr + N + offs_i, mask=i_ok, other=0.0).to(tl.float64)
    b_comb = tl.load(base_ptr + 2 * N + cidx, mask=ij_ok, other=0.0).to(tl.float64)
    post = (2.0 * _sigmoid64((post_m * r[:, None]).to(tl.float64) * sc1 + b_post[None, :])).to(tl.float32)
    z = (comb_m * r[:, None, None]).to(tl.float64) * sc2 + b_comb[None, :, :]
    z = tl.where(ij_ok[None, :, :], z, -1e300)
    zmax = tl.max(z, axis=2)
    e = tl.where(ij_ok[None, :, :], tl.exp(z - zmax[:, :, None]), 0.0)
    den = tl.where(i_ok[None, :], tl.sum(e, axis=2), 1.0)  # padded rows: no 0/0
    comb = e / den[:, :, None] + eps  # softmax over j, + eps
    comb = tl.where(ij_ok[None, :, :], comb, 0.0)
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)  # Sinkhorn: columns first
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)  # rows
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)  # columns
        if NP != N:
            comb = tl.where(ij_ok[None, :, :], comb, 0.0)
    tl.store(post_ptr + rows[:, None] * stride_pot + offs_i[None, :], post, mask=m2)
    tl.store(comb_ptr + rows[:, None, None] * stride_cbt + cidx[None, :, :], comb.to(tl.float32), mask=m3)


@triton.jit(do_not_specialize=["T"])
def _comb_kernel(part_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, T, k_f, iters, rms_eps, e_hi, e_mid, e_lo,
                 stride_ps, stride_pt, stride_pot, stride_cbt, S: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                 NMIX: tl.constexpr, BLOCK_T: tl.constexpr):
    """``_gate_kernel``'s post/comb program alone (beside ``_collapse_rows_kernel``): the same code, so the same
    bits, without the collapse's registers."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    rows = offs_t.to(tl.int64)
    row, r, eps = _gate_scalars(part_ptr, rows, t_mask, k_f, rms_eps, e_hi, e_mid, e_lo, stride_ps, stride_pt, S,
                                NMIX)
    _post_comb(row, r, eps, rows, t_mask, base_ptr, scale_ptr, post_ptr, comb_ptr, iters, stride_ps, stride_pot,
               stride_cbt, S, N, NP)


@triton.jit(do_not_specialize=["T", "pid_h0"])
def _gate_kernel(part_ptr, s_ptr, base_ptr, scale_ptr, col_ptr, post_ptr, comb_ptr, norm_ptr,
                 T, H, k_f, iters, rms_eps, e_hi, e_mid, e_lo, pid_h0,
                 stride_ps, stride_pt, stride_st, stride_sn, stride_ct, stride_pot, stride_cbt,
                 S: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, NMIX: tl.constexpr,
                 BLOCK_T: tl.constexpr, H_SLICE: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr,
                 NORM: tl.constexpr = False):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1) + pid_h0  # (a launch of the collapse programs alone, or of the Sinkhorn's alone)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    rows = offs_t.to(tl.int64)
    offs_i = tl.arange(0, NP)

    # 1. mixes: the S slice partials summed in slice order (fp32)
    row, r, eps = _gate_scalars(part_ptr, rows, t_mask, k_f, rms_eps, e_hi, e_mid, e_lo, stride_ps, stride_pt, S,
                                NMIX)

    # 2. gates and Sinkhorn in float64 (as the oracle), rounded to fp32. The program after the last H slice
    # makes post and comb (the Sinkhorn's 20 serial iterations), the slices' programs only pre: the comb is
    # not on the collapse's path, so the two run side by side instead of one after the other
    if pid_h == tl.cdiv(H, H_SLICE):
        _post_comb(row, r, eps, rows, t_mask, base_ptr, scale_ptr, post_ptr, comb_ptr, iters, stride_ps, stride_pot,
                   stride_cbt, S, N, NP)
    else:
        # 3. collapse Σ_i pre_i·R_i (fp32, i in order) over this program's slice of H
        pre = _pre_gates(row, r, eps, t_mask, base_ptr, scale_ptr, stride_ps, S, N, NP)
        h_begin = pid_h * H_SLICE
        h_end = tl.minimum(h_begin + H_SLICE, H)
        out_dtype = col_ptr.dtype.element_ty
        sq = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for h0 in range(h_begin, h_end, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            mh = t_mask[:, None] & (hh < H)[None, :]
            acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
            for i in tl.static_range(N):
                p_i = tl.sum(tl.where(offs_i[None, :] == i, pre, 0.0), axis=1)
                x = tl.load(s_ptr + rows[:, None] * stride_st + i * stride_sn + hh[None, :], mask=mh, other=0.0)
                acc += p_i[:, None] * x.to(tl.float32)
            xo = cast(acc, out_dtype, INTERP)
            tl.store(col_ptr + rows[:, None] * stride_ct + hh[None, :], xo, mask=mh)
            if NORM:
                xf = xo.to(tl.float32)
                sq += xf * xf
        if NORM:
            # 4. the sub-layer's RMSNorm of the collapsed row (this program holds whole rows: H_SLICE ≥ H), in
            # place: Σx² per lane over the BLOCK_H steps, then a fixed tree over the lanes (``_sum_lanes``: the
            # order does not follow BLOCK_T or the warps); then x·r·w as ``dense._rms_norm_kernel`` forms it
            ss = _sum_lanes(tl.trans(sq), BLOCK_H)
            ms = tl.div_rn(ss, tl.zeros_like(ss) + tl.cast(H, tl.float32))
            rn = tl.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.sqrt_rn(ms + tl.cast(rms_eps, tl.float32)))
            tl.debug_barrier()  # the rows read back below were stored by other threads of this program
            for h0 in range(h_begin, h_end, BLOCK_H):
                hh = h0 + tl.arange(0, BLOCK_H)
                mh = t_mask[:, None] & (hh < H)[None, :]
                cp = col_ptr + rows[:, None] * stride_ct + hh[None, :]
                y = tl.load(cp, mask=mh, other=0.0).to(tl.float32) * rn[:, None]
                y = tl.load(norm_ptr + hh, mask=hh < H, other=0.0).to(tl.float32)[None, :] * y
                tl.store(cp, cast(y, out_dtype, INTERP), mask=mh)


@triton.jit(do_not_specialize=["T"])
def _collapse_rows_kernel(part_ptr, s_ptr, base_ptr, scale_ptr, col_ptr, norm_ptr, T, H, k_f, rms_eps,
                          e_hi, e_mid, e_lo, stride_ps, stride_pt, stride_st, stride_sn, stride_ct,
                          S: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, NMIX: tl.constexpr,
                          BLOCK_T: tl.constexpr, STEPS: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr):
    """``_gate_kernel``'s collapse program with the sub-layer's RMSNorm, for whole rows at once: the same
    values in the same order (so the same bits), but every load that does not wait on the partials (the
    streams, the norm weight) is issued first, and the rounded rows stay in registers for the norm. The loop
    form waits on one L2 round trip a step for the streams, and on another a step for the rows it stored and
    the norm weight (in HBM during a step) after the Σx² tree. A row is [STEPS, BLOCK_H]: step s holds
    columns s·BLOCK_H + l, so the lanes l of the Σx² tree are the loop form's."""
    pid_t = tl.program_id(0)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    rows = offs_t.to(tl.int64)
    offs_i = tl.arange(0, NP)
    i_ok = offs_i < N
    offs_s = tl.arange(0, STEPS)
    hh = offs_s[:, None] * BLOCK_H + tl.arange(0, BLOCK_H)[None, :]  # [STEPS, BLOCK_H]
    h_ok = hh < H
    # 1. the loads that need nothing: the streams [BLOCK_T, NP, STEPS, BLOCK_H] and the norm weight
    xs = tl.load(s_ptr + rows[:, None, None, None] * stride_st + offs_i[None, :, None, None] * stride_sn
                 + hh[None, None, :, :],
                 mask=t_mask[:, None, None, None] & i_ok[None, :, None, None] & h_ok[None, None, :, :], other=0.0)
    wn = tl.load(norm_ptr + hh, mask=h_ok, other=0.0).to(tl.float32)
    # 2. pre = sigmoid(...) + eps from the partials, as the gate kernel forms it
    row, r, eps = _gate_scalars(part_ptr, rows, t_mask, k_f, rms_eps, e_hi, e_mid, e_lo, stride_ps, stride_pt, S,
                                NMIX)
    pre = _pre_gates(row, r, eps, t_mask, base_ptr, scale_ptr, stride_ps, S, N, NP)
    # 3. the collapse Σ_i pre_i·R_i (fp32, i in order; stream i picked out exactly: the others add -0.0)
    acc = tl.zeros((BLOCK_T, STEPS, BLOCK_H), dtype=tl.float32)
    for i in tl.static_range(N):
        p_i = tl.sum(tl.where(offs_i[None, :] == i, pre, 0.0), axis=1)
        x = tl.sum(tl.where((offs_i == i)[None, :, None, None], xs.to(tl.float32), -0.0), axis=1)
        acc += p_i[:, None, None] * x
    out_dtype = col_ptr.dtype.element_ty
    xf = cast(acc, out_dtype, INTERP).to(tl.float32)
    # 4. the RMSNorm: Σx² per lane over the steps in order (the loop form's sum), the lanes in the fixed tree
    sq = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for st in tl.static_range(STEPS):
        x = tl.sum(tl.where((offs_s == st)[None, :, None], xf, -0.0), axis=1)
        sq += x * x
    ss2 = _sum_lanes(tl.trans(sq), BLOCK_H)
    ms2 = tl.div_rn(ss2, tl.zeros_like(ss2) + tl.cast(H, tl.float32))
    rn = tl.div_rn(tl.full(ms2.shape, 1.0, tl.float32), tl.sqrt_rn(ms2 + tl.cast(rms_eps, tl.float32)))
    y = xf * rn[:, None, None]
    y = wn[None, :, :] * y
    tl.store(col_ptr + rows[:, None, None] * stride_ct + hh[None, :, :], cast(y, out_dtype, INTERP),
             mask=t_mask[:, None, None] & h_ok[None, :, :])


def _row_steps(H: int, block_h: int) -> int:
    """Steps of ``block_h`` columns a row of H takes in ``_collapse_rows_kernel`` (a power of two, masked past H)."""
    return triton.next_power_of_2(math.ceil(H / block_h))


def _rows_form(n: int, steps: int, dtype: torch.dtype, cfg: dict) -> bool:
    """Whether the collapse with the norm runs ``_collapse_rows_kernel`` (whole rows in registers): when
    config NORM_ROWS asks for it, the streams are bf16 and a program's stream tile fits NORM_ROWS_MAX_VALUES values
    (Flash: 4 × 4096 at one token a program). A function of the shapes, dtype and config only, never of T, so a
    token's bits do not depend on its batch either way. fp32 streams keep the loop form: compiled (H100), the rows
    form's fp32 collapse differed from it in the last bit (n = 4, H = 256, 5 tokens; their PTX issues the same
    roundings, fma for the collapse: not explained yet). With bf16 streams the tests (interpreter, H100) and a
    43-layer step's greedy tokens found the same bits; a last-bit fp32 difference would flip a bf16 rounding rarely,
    so that is a tested fact, not a proof."""
    values = cfg["NORM_GATE_BLOCK_T"] * triton.next_power_of_2(n) * steps * cfg["NORM_BLOCK_H"]
    return bool(cfg["NORM_ROWS"]) and dtype == torch.bfloat16 and values <= cfg["NORM_ROWS_MAX_VALUES"]


def _bf16x3(dtype: torch.dtype, cfg: dict) -> bool:
    """The mixes on tensor cores (``_mix_dot``): bf16 streams only (their values are exact in bf16;
    fp16 / fp32 streams keep the fp32 FMA dot), unless config ``MIX_BF16X3`` is False."""
    return bool(cfg["MIX_BF16X3"]) and dtype == torch.bfloat16


_FN_PARTS: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}  # id(fn) -> (fn, its version, its parts)


def fn_parts(fn: torch.Tensor) -> torch.Tensor:
    """fn [NMIX, K] fp32 as three bf16 parts [3, NMIX_P, K] (hi, mid, lo; rows past NMIX zero) whose exact sum
    is fn: round to bf16, subtract, twice (8 + 8 + 8 bits cover fp32's 24; bf16 has fp32's exponent range).
    NMIX_P leaves the Σx² column free (``_part``)."""
    f = fn.float()
    nmix, k = f.shape
    parts = torch.zeros((3, triton.next_power_of_2(nmix + 1), k), dtype=torch.bfloat16, device=f.device)
    parts[0, :nmix] = f.to(torch.bfloat16)
    r = f - parts[0, :nmix].float()
    parts[1, :nmix] = r.to(torch.bfloat16)
    parts[2, :nmix] = (r - parts[1, :nmix].float()).to(torch.bfloat16)
    return parts


def _fn_operand(fn: torch.Tensor, dtype: torch.dtype, cfg: dict) -> torch.Tensor:
    """What the mixes dot reads of fn: its bf16 parts (``fn_parts``, made once per fn tensor and kept while
    it lives: the weights are constant; remade if it is written in place) for the tensor-core dots, else
    fn in fp32 (with a leading unit axis: one layout for the kernels' strides)."""
    if not _bf16x3(dtype, cfg):
        return fn.float().contiguous().unsqueeze(0)
    hit = _FN_PARTS.get(id(fn))
    if hit is None or hit[0]() is not fn or hit[1] != fn._version:
        if hit is None or hit[0]() is not fn:
            weakref.finalize(fn, _FN_PARTS.pop, id(fn), None)  # (a weak key: a tensor's == is elementwise)
        hit = _FN_PARTS[id(fn)] = (weakref.ref(fn), fn._version, fn_parts(fn))
    return hit[2]


def _check_streams(streams: torch.Tensor, name: str = "streams") -> torch.Tensor:
    if streams.dim() != 3:
        raise ValueError(f"{name} must be [T, n, H], got shape {tuple(streams.shape)}")
    if streams.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name} must be bf16, fp16 or fp32, got {streams.dtype}")
    if streams.stride(2) != 1 or streams.stride(1) != streams.shape[2]:
        streams = streams.contiguous()  # the mixes kernel reads a token's n·H values as one row
    return streams


def _check_pre_weights(n: int, H: int, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, shape):
    nmix, k = 2 * n + n * n, n * H
    if tuple(fn.shape) != (nmix, k):
        raise ValueError(f"fn must be [2n+n², n·H] = {(nmix, k)} for streams {tuple(shape)}, "
                         f"got {tuple(fn.shape)}")
    if base.numel() != nmix or scale.numel() != 3:
        raise ValueError(f"base must have {nmix} values and scale 3, got {base.numel()} and {scale.numel()}")


def _mix_block_t(T: int, cfg: dict) -> int:
    """Tokens per mixes program: fewer at decode sizes, where most of a wide tile would be masked rows."""
    return cfg["MIX_BLOCK_T_DECODE"] if T <= DECODE_MAX_ROWS else cfg["MIX_BLOCK_T"]


def _part(T: int, n: int, H: int, cfg: dict, dev):
    """(part [S, T, NMIX_P] fp32 for the mixes partials, NMIX_P, S)."""
    nmix_p = triton.next_power_of_2(2 * n + n * n + 1)  # + the Σx² column
    S = math.ceil(n * H / cfg["SPLIT"])
    return torch.empty((S, T, nmix_p), dtype=torch.float32, device=dev), nmix_p, S


def _check_norm(norm: torch.Tensor | None, H: int) -> torch.Tensor | None:
    if norm is None:
        return None
    if tuple(norm.shape) != (H,) or not norm.is_floating_point():
        raise ValueError(f"norm (the sub-layer's RMSNorm weight) must be a float [{H}], got {tuple(norm.shape)} "
                         f"{norm.dtype}")
    return norm.contiguous()


def _gates(part: torch.Tensor, streams: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           iters: int, hc_eps: float, rms_eps: float, cfg: dict, norm: torch.Tensor | None = None):
    """``_gate_kernel`` over the summed partials: (collapsed, post, comb) of ``streams``; with ``norm`` the
    collapsed rows come back RMS-normalised (weight ``norm``, eps ``rms_eps``) by the programs that form them,
    each of which then holds whole rows (NORM_BLOCK_H columns a step; its own tokens and warps)."""
    T, n, H = streams.shape
    dev = streams.device
    collapsed = torch.empty((T, H), dtype=streams.dtype, device=dev)
    post = torch.empty((T, n), dtype=torch.float32, device=dev)
    comb = torch.empty((T, n, n), dtype=torch.float32, device=dev)
    base32 = base.float().reshape(-1).contiguous()
    scale32 = scale.float().reshape(-1).contiguous()
    e_hi, e_mid, e_lo = _f64_parts(float(hc_eps))
    if norm is None:
        block_t, h_slice, block_h, warps = cfg["GATE_BLOCK_T"], cfg["H_SLICE"], cfg["GATE_BLOCK_H"], cfg["GATE_WARPS"]
    else:
        block_t, block_h, warps = cfg["NORM_GATE_BLOCK_T"], cfg["NORM_BLOCK_H"], cfg["NORM_GATE_WARPS"]
        h_slice = math.ceil(H / block_h) * block_h
    slices = math.ceil(H / h_slice)
    steps = _row_steps(H, block_h)
    rows = norm is not None and _rows_form(n, steps, streams.dtype, cfg)
    common = dict(S=part.shape[0], N=n, NP=triton.next_power_of_2(n), NMIX=2 * n + n * n, BLOCK_T=block_t)

    def gate_programs(first: int, count: int):
        """``_gate_kernel``'s programs [first, first + count) of axis 1: the collapse slices, then the post/comb
        program (index ``slices``)."""
        _gate_kernel[(math.ceil(T / block_t), count)](
            part, streams, base32, scale32, collapsed, post, comb, norm if norm is not None else base32,
            T, H, float(n * H), int(iters), float(rms_eps), e_hi, e_mid, e_lo, first,
            part.stride(0), part.stride(1), streams.stride(0), streams.stride(1), collapsed.stride(0),
            post.stride(0), comb.stride(0), **common,
            H_SLICE=h_slice, BLOCK_H=block_h, INTERP=interpreting(), NORM=norm is not None, num_warps=warps)

    def collapse():
        """The collapse alone: the rows form, or the gate kernel's slices."""
        if not rows:
            return gate_programs(0, slices)
        _collapse_rows_kernel[(math.ceil(T / block_t),)](
            part, streams, base32, scale32, collapsed, norm, T, H, float(n * H), float(rms_eps), e_hi, e_mid, e_lo,
            part.stride(0), part.stride(1), streams.stride(0), streams.stride(1), collapsed.stride(0), **common,
            STEPS=steps, BLOCK_H=block_h, INTERP=interpreting(), num_warps=cfg["NORM_ROWS_WARPS"])

    def post_comb(*_keep):
        """The post/comb program alone: ``_comb_kernel`` beside the rows form (without the collapse's code), or
        the gate kernel's last program."""
        if not rows:
            return gate_programs(slices, 1)
        _comb_kernel[(math.ceil(T / block_t),)](
            part, base32, scale32, post, comb, T, float(n * H), int(iters), float(rms_eps), e_hi, e_mid, e_lo,
            part.stride(0), part.stride(1), post.stride(0), comb.stride(0), **common, num_warps=warps)

    start = lanes.point() if SINKHORN_BESIDE else None
    if start is None:  # not in a decode graph's capture: one launch (two with the rows form)
        if rows:
            collapse()
            post_comb()
        else:
            gate_programs(0, slices + 1)
        return collapsed, post, comb
    # post and comb are read by the next hc_post only: their program (the 20 serial Sinkhorn iterations,
    # the launch's longest) runs on a side stream from the same point, launched after the collapse so that
    # the collapse's programs reach the SMs first
    collapse()
    side = lanes.fork(post_comb, post, comb, part, base32, scale32, lane=SINKHORN_LANE, after=start)
    return collapsed, Pending(post, side.result), Pending(comb, side.result)


def _empty_pre(T: int, n: int, H: int, dtype, dev):
    return (torch.empty((T, H), dtype=dtype, device=dev), torch.empty((T, n), dtype=torch.float32, device=dev),
            torch.empty((T, n, n), dtype=torch.float32, device=dev))


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           iters: int, hc_eps: float, rms_eps: float, norm: torch.Tensor | None = None, *,
           config: dict | None = None):
    """Same contract as ``dsv4.model.mhc.hc_pre``: streams [T, n, H] → (collapsed [T, H] in the
    stream dtype, RMS-normalised with weight ``norm`` when given, post [T, n] fp32, comb [T, n, n] fp32)."""
    streams = _check_streams(streams)
    T, n, H = streams.shape
    nmix, k = 2 * n + n * n, n * H
    _check_pre_weights(n, H, fn, base, scale, streams.shape)
    norm = _check_norm(norm, H)
    cfg = dict(CONFIG, **(config or {}))
    if T == 0:
        return _empty_pre(T, n, H, streams.dtype, streams.device)
    fw = _fn_operand(fn, streams.dtype, cfg)
    part, nmix_p, S = _part(T, n, H, cfg, streams.device)
    block_t = _mix_block_t(T, cfg)
    _mix_kernel[(math.ceil(T / block_t), S)](
        streams, fw, part, T, k, streams.stride(0), fw.stride(-2), fw.stride(0), part.stride(0), part.stride(1),
        NMIX=nmix, NMIX_P=nmix_p, SPLIT=cfg["SPLIT"], BLOCK_T=block_t, BLOCK_K=cfg["MIX_BLOCK_K"],
        BF16X3=_bf16x3(streams.dtype, cfg), INTERP=interpreting(),
        num_warps=cfg["MIX_WARPS"] if T <= DECODE_MAX_ROWS else cfg["MIX_WARPS_PREFILL"])
    return _gates(part, streams, base, scale, iters, hc_eps, rms_eps, cfg, norm)


@triton.jit(do_not_specialize=["T"])
def _post_kernel(s_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, T, H,
                 stride_st, stride_sn, stride_ot, stride_pt, stride_ct, stride_ci, stride_yt, stride_yn,
                 N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                 INTERP: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, NP)
    tm = offs_t < T
    rows = offs_t.to(tl.int64)
    hm = hh < H
    tj = tm[:, None] & (offs_j < N)[None, :]
    th = tm[:, None] & hm[None, :]
    dt = y_ptr.dtype.element_ty
    p = cast(tl.load(post_ptr + rows[:, None] * stride_pt + offs_j[None, :], mask=tj, other=0.0), dt, INTERP)
    o = tl.load(o_ptr + rows[:, None] * stride_ot + hh[None, :], mask=th, other=0.0)
    spread = cast(p.to(tl.float32)[:, :, None] * o.to(tl.float32)[:, None, :], dt, INTERP)  # post·out in dt
    acc = tl.zeros((BLOCK_T, NP, BLOCK_H), dtype=tl.float32)
    for i in tl.static_range(N):  # Σ_i comb[i, j]·R[i] in fp32, i in order
        c = cast(tl.load(comb_ptr + rows[:, None] * stride_ct + i * stride_ci + offs_j[None, :], mask=tj,
                         other=0.0), dt, INTERP)
        r = tl.load(s_ptr + rows[:, None] * stride_st + i * stride_sn + hh[None, :], mask=th, other=0.0)
        acc += c.to(tl.float32)[:, :, None] * r.to(tl.float32)[:, None, :]
    y = cast(spread.to(tl.float32) + cast(acc, dt, INTERP).to(tl.float32), dt, INTERP)
    tl.store(y_ptr + rows[:, None, None] * stride_yt + offs_j[None, :, None] * stride_yn + hh[None, None, :], y,
             mask=tj[:, :, None] & th[:, None, :])


def _check_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
    post, comb = resolve(post), resolve(comb)  # a decode graph's pre hands them over from a side stream
    if streams.dim() != 3:
        raise ValueError(f"streams must be [T, n, H], got shape {tuple(streams.shape)}")
    T, n, H = streams.shape
    if tuple(out.shape) != (T, H):
        raise ValueError(f"out must be [T, H] = {(T, H)}, got {tuple(out.shape)}")
    if out.dtype != streams.dtype:
        raise TypeError(f"out dtype {out.dtype} differs from the stream dtype {streams.dtype}")
    if tuple(post.shape) != (T, n) or tuple(comb.shape) != (T, n, n):
        raise ValueError(f"post must be {(T, n)} and comb {(T, n, n)}, got {tuple(post.shape)} "
                         f"and {tuple(comb.shape)}")
    if streams.stride(2) != 1:
        streams = streams.contiguous()
    if out.stride(1) != 1:
        out = out.contiguous()
    post = post if post.stride(1) == 1 else post.contiguous()
    comb = comb if comb.stride(2) == 1 else comb.contiguous()
    return streams, out, post, comb


def hc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            *, config: dict | None = None) -> torch.Tensor:
    """Same contract as ``dsv4.model.mhc.hc_post``: R'[j] = Σ_i comb[i, j]·R[i] + post[j]·out,
    in the stream dtype (streams [T, n, H], out [T, H], post [T, n], comb [T, n, n])."""
    streams, out, post, comb = _check_post(streams, out, post, comb)
    T, n, H = streams.shape
    cfg = dict(CONFIG, **(config or {}))
    y = torch.empty((T, n, H), dtype=streams.dtype, device=streams.device)
    if T == 0 or H == 0:
        return y
    bt, bh = cfg["POST_BLOCK_T"], cfg["POST_BLOCK_H"]
    _post_kernel[(math.ceil(T / bt), math.ceil(H / bh))](
        streams, out, post, comb, y, T, H,
        streams.stride(0), streams.stride(1), out.stride(0), post.stride(0), comb.stride(0), comb.stride(1),
        y.stride(0), y.stride(1),
        N=n, NP=triton.next_power_of_2(n), BLOCK_T=bt, BLOCK_H=bh, INTERP=interpreting(), num_warps=4)
    return y


@triton.jit(do_not_specialize=["T"])
def _post_mix_kernel(s_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, fn_ptr, part_ptr, T, H, K,
                     stride_st, stride_sn, stride_ot, stride_pot, stride_ct, stride_ci, stride_yt,
                     stride_fn, stride_fp, stride_ps, stride_pt,
                     N: tl.constexpr, NMIX: tl.constexpr, NMIX_P: tl.constexpr, SPLIT: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BF16X3: tl.constexpr, INTERP: tl.constexpr):
    """hc_post for one SPLIT slice of y [T, n·H] (``_post_kernel``'s arithmetic), then that slice's
    partial mixes and Σy² (``_mix_kernel``'s arithmetic, on the values it would read back). Tiles are
    [BLOCK_K, BLOCK_T] (k down, tokens across), as the mixes dot takes them."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, NMIX_P)
    offs_k = tl.arange(0, BLOCK_K)
    t_mask = offs_t < T
    c_mask = offs_c < NMIX
    rows = offs_t.to(tl.int64)
    dt = y_ptr.dtype.element_ty
    acc = tl.zeros((NMIX_P, BLOCK_T), dtype=tl.float32)
    sq = tl.zeros((BLOCK_K, BLOCK_T), dtype=tl.float32)
    k_begin = pid_s * SPLIT
    k_end = tl.minimum(k_begin + SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        m = k_mask[:, None] & t_mask[None, :]
        j = k0 // H  # the whole step lies in stream j (H and SPLIT are multiples of BLOCK_K)
        hh = (k0 - j * H) + offs_k
        # post: y[:, j, hh] = post_j·out + Σ_i comb[i, j]·R[i], rounded as in _post_kernel
        p = cast(tl.load(post_ptr + rows * stride_pot + j, mask=t_mask, other=0.0), dt, INTERP)
        o = tl.load(o_ptr + rows[None, :] * stride_ot + hh[:, None], mask=m, other=0.0)
        spread = cast(p.to(tl.float32)[None, :] * o.to(tl.float32), dt, INTERP)  # post·out in dt
        pacc = tl.zeros((BLOCK_K, BLOCK_T), dtype=tl.float32)
        for i in tl.static_range(N):  # Σ_i comb[i, j]·R[i] in fp32, i in order
            c = cast(tl.load(comb_ptr + rows * stride_ct + i * stride_ci + j, mask=t_mask, other=0.0), dt, INTERP)
            r = tl.load(s_ptr + rows[None, :] * stride_st + i * stride_sn + hh[:, None], mask=m, other=0.0)
            pacc += c.to(tl.float32)[None, :] * r.to(tl.float32)
        y = cast(spread.to(tl.float32) + cast(pacc, dt, INTERP).to(tl.float32), dt, INTERP)
        tl.store(y_ptr + rows[None, :] * stride_yt + kk[:, None], y, mask=m)
        # mixes: as _mix_kernel on the stored y
        x = y.to(tl.float32)
        sq += x * x
        acc = _mix_dot(fn_ptr, offs_c, kk, c_mask, k_mask, stride_fn, stride_fp, x, acc, BF16X3, INTERP)
    _store_part(part_ptr, acc, sq, pid_s, rows, t_mask, offs_c, stride_ps, stride_pt, NMIX, BLOCK_K)


def fusable(H: int, config: dict | None = None) -> bool:
    """Whether ``mhc_post_pre`` runs fused for hidden size H (else it runs hc_post, then hc_pre)."""
    cfg = dict(CONFIG, **(config or {}))
    return H > 0 and H % cfg["MIX_BLOCK_K"] == 0 and cfg["SPLIT"] % cfg["MIX_BLOCK_K"] == 0


def mhc_post_pre(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
                 rms_eps: float, norm: torch.Tensor | None = None, *, config: dict | None = None):
    """``hc_post(streams, out, post, comb)`` then ``hc_pre`` of the result with (fn, base, scale, norm):
    → (new streams [T, n, H], collapsed [T, H], post [T, n], comb [T, n, n]), bitwise those of the
    two ops (same contract as ``dsv4.model.mhc.hc_post_pre``)."""
    streams, out, post, comb = _check_post(streams, out, post, comb)
    T, n, H = streams.shape
    _check_pre_weights(n, H, fn, base, scale, streams.shape)
    norm = _check_norm(norm, H)
    cfg = dict(CONFIG, **(config or {}))
    fused_max = cfg["POST_MIX_FUSED_MAX_T"]
    if not fusable(H, cfg) or (fused_max is not None and T > fused_max):
        y = hc_post(streams, out, post, comb, config=config)
        return (y, *hc_pre(y, fn, base, scale, iters, hc_eps, rms_eps, norm, config=config))
    dev = streams.device
    y = torch.empty((T, n, H), dtype=streams.dtype, device=dev)
    if T == 0:
        return (y, *_empty_pre(T, n, H, streams.dtype, dev))
    fw = _fn_operand(fn, streams.dtype, cfg)
    part, nmix_p, S = _part(T, n, H, cfg, dev)
    block_t = _mix_block_t(T, cfg)
    _post_mix_kernel[(math.ceil(T / block_t), S)](
        streams, out, post, comb, y, fw, part, T, H, n * H,
        streams.stride(0), streams.stride(1), out.stride(0), post.stride(0), comb.stride(0), comb.stride(1),
        y.stride(0), fw.stride(-2), fw.stride(0), part.stride(0), part.stride(1),
        N=n, NMIX=2 * n + n * n, NMIX_P=nmix_p, SPLIT=cfg["SPLIT"], BLOCK_T=block_t,
        BLOCK_K=cfg["MIX_BLOCK_K"], BF16X3=_bf16x3(streams.dtype, cfg), INTERP=interpreting(),
        num_warps=cfg["MIX_WARPS"] if T <= DECODE_MAX_ROWS else cfg["MIX_WARPS_PREFILL"])
    return (y, *_gates(part, y, base, scale, iters, hc_eps, rms_eps, cfg, norm))
