"""Triton mHC: ``hc_pre`` in two launches, ``hc_post`` in one (oracle: ``dsv4.model.mhc``).

hc_pre replaces ~80 tiny launches (float64 gates, a 20-iteration Sinkhorn in torch) with:

1. ``_mix_kernel``, program = (BLOCK_T tokens, one SPLIT-column slice of the flattened streams
   x [T, n·H]): partial mixes x·fnᵀ (fn zero-padded from 2n+n² to NMIX_P rows) and the partial Σx²
   in the spare column NMIX, stored to part [S, T, NMIX_P] fp32. The dot (``_mix_dot``): for bf16
   streams three bf16 tensor-core dots against an exact three-way bf16 split of fn (every product
   exact, fp32 accumulation; H200, 8K prompt: the fused post + mixes 1,223 → 881 µs a launch); for
   fp16 / fp32 streams an IEEE fp32 dot (CUDA-core FMAs). ``dense.dot_acc``: tl.dot compiled, a
   k-by-k sum in the interpreter.
2. ``_gate_kernel``, program = (BLOCK_T tokens, one H_SLICE of the hidden size): the S partials
   summed in slice order, r = 1/sqrt(Σx²/(n·H) + eps) (IEEE fp32, as torch's rsqrt on CPU),
   mixes = r·(x·fnᵀ); then in **float64** like the oracle: pre = sigmoid + eps, post = 2·sigmoid,
   comb = Sinkhorn(softmax + eps), each rounded to fp32; then the collapse Σ_i pre_i·R_i in fp32
   (i in order), rounded to the stream dtype. Every H slice recomputes the (cheap) gates of its
   tokens; slice 0 stores post and comb.

The oracle normalises x before the GEMM ((x·r)·fnᵀ); here r is applied after (r·(x·fnᵀ)), one
rounding apart per product: the mixes differ from the oracle by summation order and that
rounding only (fp32 level). hc_eps enters the float64 math exactly, passed as three fp32 parts
(Triton float arguments are fp32).

Batch invariance: the tile sizes, the slice width SPLIT and the order in which slices are summed
are constants (S depends on n·H only), so a token's arithmetic never depends on T or on its row
position. The warp count may differ with T (decode 4, prefill 1): at MIX_BLOCK_T = 32 every count up
to 4 runs the same mma.sync tiles in the same k order (the H200 sweep found the same bits for 1, 2
and 4 warps; 8 warps or another MIX_BLOCK_T change them). n need not be a power of two (padded to NP
with masked lanes); n = 4 in the release.

hc_post, program = (BLOCK_T tokens, BLOCK_H columns): R'[j] = Σ_i comb[i, j]·R[i] + post[j]·out
with the oracle's roundings in the stream dtype dt: post and comb rounded to dt, post·out rounded
to dt, the sum over i in fp32 (i in order) rounded to dt, and the final add rounded to dt.

mhc_post_pre = hc_post followed by the next hc_pre, in two launches instead of three:
``_post_mix_kernel``, program = (MIX_BLOCK_T tokens, one SPLIT-column slice of the flattened new
streams y [T, n·H]), computes y for its slice with ``_post_kernel``'s arithmetic and roundings,
stores it, and in the same MIX_BLOCK_K steps accumulates the slice's partial mixes and Σy² exactly
as ``_mix_kernel`` would after reading y back (same tile, same steps, same ``dot_acc``), into the
same ``part``; ``_gate_kernel`` then finishes the pre. Each step lies in one stream j when H and
SPLIT are multiples of MIX_BLOCK_K (j = k0 // H); otherwise, and above POST_MIX_FUSED_MAX_T tokens (where
the two kernels apart were measured faster), the op runs hc_post then hc_pre. Every
result is bitwise that of hc_post + hc_pre, so it is batch-invariant for the same reasons.
"""

from __future__ import annotations

import functools
import math
import struct

import torch
import triton
import triton.language as tl

from ..invariance import DECODE_MAX_ROWS
from ._common import cast, interpreting
from .dense import dot_acc

__all__ = ["hc_pre", "hc_post", "mhc_post_pre", "fusable", "CONFIG"]

# Fixed for every T: these set the reduction order of a token's arithmetic.
CONFIG = dict(
    # mixes tiles from an H200 sweep: 64 programs of 8 steps
    # instead of 32 of 32 halve the latency-bound decode launch (T = 1: 26 vs 55 µs; T = 64: 29 vs
    # 57 µs) for +3 % at T = 8192 (1.51 vs 1.47 ms)
    SPLIT=256,       # columns of x [T, n·H] per mixes program (S = ceil(n·H / SPLIT) partials)
    MIX_BLOCK_T=32,  # tokens per mixes program
    MIX_BLOCK_K=32,  # columns per dot step (also the Σx² lanes: it sets that sum's order)
    MIX_WARPS=4,     # warps per mixes program (any count: the same bits, see the module docstring)
    MIX_WARPS_PREFILL=1,  # hc_pre's mixes warps above DECODE_MAX_ROWS tokens (the same bits up to 4; H200,
    # hc_post + hc_pre at T = 8192: 754 µs at 4 warps, 587 at 2, 533 at 1)
    MIX_BF16X3=True,  # bf16 streams: the mixes as three exact bf16 tensor-core dots (``_mix_dot``)
    POST_MIX_WARPS_PREFILL=1,  # mhc_post_pre's mixes warps above DECODE_MAX_ROWS tokens (H200 sweep, same
    # bits; tensor-core mixes: T = 8192 in 881 µs at 1 warp, 895 at 2, 1,028 at 4, against 1,223 for the FMA
    # mixes at 1 warp; at T ≤ 64, MIX_WARPS = 4: 25.1 / 28.4 µs at T = 1 / 64)
    POST_MIX_FUSED_MAX_T=DECODE_MAX_ROWS,  # mhc_post_pre above this many tokens runs hc_post, then hc_pre (the
    # same bits; None: always fused). H200, CUDA-graph µs, fused / apart with 1 prefill warp:
    # T = 8192: 882 / 533, T = 1024: 107 / 78; at T = 1 and 64 apart was also faster (23 / 26 against 25 / 29)
    GATE_BLOCK_T=2,  # tokens per gate/collapse program (every value swept gave the same bits, H200 sweep below)
    GATE_WARPS=1,    # warps per gate/collapse program; H200, hc_pre CUDA-graph µs at T = 1 / 64 / 8192: 8 tokens
    # at 4 warps 20.6 / 23.2 / 374.2, 2 at 1 warp 18.3 / 18.8 / 298.0, every variant the same bits
    H_SLICE=1024,    # hidden columns per gate/collapse program
    GATE_BLOCK_H=256,  # hidden columns per collapse step
    POST_BLOCK_T=4,    # tokens per hc_post program (elementwise: any value gives the same bits)
    POST_BLOCK_H=256,  # hidden columns per hc_post program
)


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]  # round to nearest fp32


@functools.lru_cache(maxsize=16)
def _f64_parts(v: float) -> tuple[float, float, float]:
    """Three fp32 values whose exact sum is the double ``v`` (24 + 24 + 24 ≥ 53 bits)."""
    hi = _f32(v)
    mid = _f32(v - hi)
    return hi, mid, _f32(v - hi - mid)


@triton.jit
def _mix_dot(x, f, acc, BF16X3: tl.constexpr, INTERP: tl.constexpr):
    """acc + x·f for the mixes, f [BLOCK_K, NMIX_P] fp32. BF16X3 (x holds bf16 values): f is split
    exactly into three bf16 parts (f = hi + mid + lo: round to bf16, subtract, twice; 8 + 8 + 8 bits
    cover fp32's 24), so every product x·part is exact in fp32 and the three tensor-core dots
    (smallest part first) carry the whole fp32 product; else one IEEE fp32 dot (CUDA-core FMAs,
    k in order in one thread). The interpreter sums each dot k by k (``dense.dot_acc``)."""
    if BF16X3:
        hi = f.to(tl.bfloat16)
        r = f - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        xb = x.to(tl.bfloat16)
        acc = dot_acc(xb, lo, acc, False, INTERP)
        acc = dot_acc(xb, mid, acc, False, INTERP)
        acc = dot_acc(xb, hi, acc, False, INTERP)
    else:
        acc = dot_acc(x, f, acc, True, INTERP)
    return acc


@triton.jit(do_not_specialize=["T"])
def _mix_kernel(x_ptr, fn_ptr, part_ptr, T, K, stride_xt, stride_fn, stride_ps, stride_pt,
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
    acc = tl.zeros((BLOCK_T, NMIX_P), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    k_begin = pid_s * SPLIT
    k_end = tl.minimum(k_begin + SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + kk[None, :],
                    mask=t_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        f = tl.load(fn_ptr + offs_c[None, :] * stride_fn + kk[:, None],
                    mask=c_mask[None, :] & k_mask[:, None], other=0.0).to(tl.float32)
        sq += x * x
        acc = _mix_dot(x, f, acc, BF16X3, INTERP)
    ss = tl.sum(sq, axis=1)
    acc = tl.where(offs_c[None, :] == NMIX, ss[:, None], acc)
    tl.store(part_ptr + pid_s * stride_ps + rows[:, None] * stride_pt + offs_c[None, :], acc,
             mask=t_mask[:, None])


@triton.jit
def _sigmoid64(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit(do_not_specialize=["T"])
def _gate_kernel(part_ptr, s_ptr, base_ptr, scale_ptr, col_ptr, post_ptr, comb_ptr,
                 T, H, k_f, iters, rms_eps, e_hi, e_mid, e_lo,
                 stride_ps, stride_pt, stride_st, stride_sn, stride_ct, stride_pot, stride_cbt,
                 S: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, NMIX: tl.constexpr,
                 BLOCK_T: tl.constexpr, H_SLICE: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    rows = offs_t.to(tl.int64)
    offs_i = tl.arange(0, NP)
    i_ok = offs_i < N
    m2 = t_mask[:, None] & i_ok[None, :]
    ij_ok = i_ok[:, None] & i_ok[None, :]  # [NP(i), NP(j)]
    m3 = t_mask[:, None, None] & ij_ok[None, :, :]

    # 1. mixes: the S slice partials summed in slice order (fp32); unrolled, so the loads of all
    # slices are issued together instead of one L2 round trip per slice (a runtime loop: ~64 in series)
    pre_m = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
    post_m = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
    comb_m = tl.zeros((BLOCK_T, NP, NP), dtype=tl.float32)
    ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
    row = part_ptr + rows * stride_pt
    cidx = offs_i[:, None] * N + offs_i[None, :]
    for s in tl.static_range(S):
        r_s = row + s * stride_ps
        pre_m += tl.load(r_s[:, None] + offs_i[None, :], mask=m2, other=0.0)
        post_m += tl.load(r_s[:, None] + N + offs_i[None, :], mask=m2, other=0.0)
        comb_m += tl.load(r_s[:, None, None] + 2 * N + cidx[None, :, :], mask=m3, other=0.0)
        ss += tl.load(r_s + NMIX, mask=t_mask, other=0.0)
    ms = tl.div_rn(ss, tl.cast(k_f, tl.float32) + tl.zeros_like(ss)) + tl.cast(rms_eps, tl.float32)
    r = tl.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.sqrt_rn(ms))

    # 2. gates and Sinkhorn in float64 (as the oracle), rounded to fp32
    eps = (tl.cast(e_hi, tl.float64) + tl.cast(e_mid, tl.float64)) + tl.cast(e_lo, tl.float64)
    sc0 = tl.load(scale_ptr).to(tl.float64)
    sc1 = tl.load(scale_ptr + 1).to(tl.float64)
    sc2 = tl.load(scale_ptr + 2).to(tl.float64)
    b_pre = tl.load(base_ptr + offs_i, mask=i_ok, other=0.0).to(tl.float64)
    b_post = tl.load(base_ptr + N + offs_i, mask=i_ok, other=0.0).to(tl.float64)
    b_comb = tl.load(base_ptr + 2 * N + cidx, mask=ij_ok, other=0.0).to(tl.float64)
    pre = (_sigmoid64((pre_m * r[:, None]).to(tl.float64) * sc0 + b_pre[None, :]) + eps).to(tl.float32)
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
    first = t_mask & (offs_t * 0 + pid_h == 0)  # slice 0 stores post and comb
    tl.store(post_ptr + rows[:, None] * stride_pot + offs_i[None, :], post, mask=first[:, None] & i_ok[None, :])
    tl.store(comb_ptr + rows[:, None, None] * stride_cbt + cidx[None, :, :], comb.to(tl.float32),
             mask=first[:, None, None] & ij_ok[None, :, :])

    # 3. collapse Σ_i pre_i·R_i (fp32, i in order) over this program's slice of H
    h_begin = pid_h * H_SLICE
    h_end = tl.minimum(h_begin + H_SLICE, H)
    out_dtype = col_ptr.dtype.element_ty
    for h0 in range(h_begin, h_end, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        mh = t_mask[:, None] & (hh < H)[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for i in tl.static_range(N):
            p_i = tl.sum(tl.where(offs_i[None, :] == i, pre, 0.0), axis=1)
            x = tl.load(s_ptr + rows[:, None] * stride_st + i * stride_sn + hh[None, :], mask=mh, other=0.0)
            acc += p_i[:, None] * x.to(tl.float32)
        tl.store(col_ptr + rows[:, None] * stride_ct + hh[None, :], cast(acc, out_dtype, INTERP), mask=mh)


def _bf16x3(dtype: torch.dtype, cfg: dict) -> bool:
    """The mixes on tensor cores (``_mix_dot``): bf16 streams only (their values are exact in bf16;
    fp16 / fp32 streams keep the fp32 FMA dot), unless config ``MIX_BF16X3`` is False."""
    return bool(cfg["MIX_BF16X3"]) and dtype == torch.bfloat16


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


def _part(T: int, n: int, H: int, cfg: dict, dev):
    """(part [S, T, NMIX_P] fp32 for the mixes partials, NMIX_P, S)."""
    nmix_p = triton.next_power_of_2(2 * n + n * n + 1)  # + the Σx² column
    S = math.ceil(n * H / cfg["SPLIT"])
    return torch.empty((S, T, nmix_p), dtype=torch.float32, device=dev), nmix_p, S


def _gates(part: torch.Tensor, streams: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           iters: int, hc_eps: float, rms_eps: float, cfg: dict):
    """``_gate_kernel`` over the summed partials: (collapsed, post, comb) of ``streams``."""
    T, n, H = streams.shape
    dev = streams.device
    collapsed = torch.empty((T, H), dtype=streams.dtype, device=dev)
    post = torch.empty((T, n), dtype=torch.float32, device=dev)
    comb = torch.empty((T, n, n), dtype=torch.float32, device=dev)
    base32 = base.float().reshape(-1).contiguous()
    scale32 = scale.float().reshape(-1).contiguous()
    e_hi, e_mid, e_lo = _f64_parts(float(hc_eps))
    _gate_kernel[(math.ceil(T / cfg["GATE_BLOCK_T"]), math.ceil(H / cfg["H_SLICE"]))](
        part, streams, base32, scale32, collapsed, post, comb,
        T, H, float(n * H), int(iters), float(rms_eps), e_hi, e_mid, e_lo,
        part.stride(0), part.stride(1), streams.stride(0), streams.stride(1), collapsed.stride(0),
        post.stride(0), comb.stride(0),
        S=part.shape[0], N=n, NP=triton.next_power_of_2(n), NMIX=2 * n + n * n, BLOCK_T=cfg["GATE_BLOCK_T"],
        H_SLICE=cfg["H_SLICE"], BLOCK_H=cfg["GATE_BLOCK_H"], INTERP=interpreting(), num_warps=cfg["GATE_WARPS"])
    return collapsed, post, comb


def _empty_pre(T: int, n: int, H: int, dtype, dev):
    return (torch.empty((T, H), dtype=dtype, device=dev), torch.empty((T, n), dtype=torch.float32, device=dev),
            torch.empty((T, n, n), dtype=torch.float32, device=dev))


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           iters: int, hc_eps: float, rms_eps: float, *, config: dict | None = None):
    """Same contract as ``dsv4.model.mhc.hc_pre``: streams [T, n, H] → (collapsed [T, H] in the
    stream dtype, post [T, n] fp32, comb [T, n, n] fp32)."""
    streams = _check_streams(streams)
    T, n, H = streams.shape
    nmix, k = 2 * n + n * n, n * H
    _check_pre_weights(n, H, fn, base, scale, streams.shape)
    cfg = dict(CONFIG, **(config or {}))
    if T == 0:
        return _empty_pre(T, n, H, streams.dtype, streams.device)
    fn32 = fn.float().contiguous()  # no-op for the checkpoint's fp32 fn
    part, nmix_p, S = _part(T, n, H, cfg, streams.device)
    _mix_kernel[(math.ceil(T / cfg["MIX_BLOCK_T"]), S)](
        streams, fn32, part, T, k, streams.stride(0), fn32.stride(0), part.stride(0), part.stride(1),
        NMIX=nmix, NMIX_P=nmix_p, SPLIT=cfg["SPLIT"], BLOCK_T=cfg["MIX_BLOCK_T"], BLOCK_K=cfg["MIX_BLOCK_K"],
        BF16X3=_bf16x3(streams.dtype, cfg), INTERP=interpreting(),
        num_warps=cfg["MIX_WARPS"] if T <= DECODE_MAX_ROWS else cfg["MIX_WARPS_PREFILL"])
    return _gates(part, streams, base, scale, iters, hc_eps, rms_eps, cfg)


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
                     stride_fn, stride_ps, stride_pt,
                     N: tl.constexpr, NMIX: tl.constexpr, NMIX_P: tl.constexpr, SPLIT: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BF16X3: tl.constexpr, INTERP: tl.constexpr):
    """hc_post for one SPLIT slice of y [T, n·H] (``_post_kernel``'s arithmetic), then that slice's
    partial mixes and Σy² (``_mix_kernel``'s arithmetic, on the values it would read back)."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, NMIX_P)
    offs_k = tl.arange(0, BLOCK_K)
    t_mask = offs_t < T
    c_mask = offs_c < NMIX
    rows = offs_t.to(tl.int64)
    dt = y_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_T, NMIX_P), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    k_begin = pid_s * SPLIT
    k_end = tl.minimum(k_begin + SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        m = t_mask[:, None] & k_mask[None, :]
        j = k0 // H  # the whole step lies in stream j (H and SPLIT are multiples of BLOCK_K)
        hh = (k0 - j * H) + offs_k
        # post: y[:, j, hh] = post_j·out + Σ_i comb[i, j]·R[i], rounded as in _post_kernel
        p = cast(tl.load(post_ptr + rows * stride_pot + j, mask=t_mask, other=0.0), dt, INTERP)
        o = tl.load(o_ptr + rows[:, None] * stride_ot + hh[None, :], mask=m, other=0.0)
        spread = cast(p.to(tl.float32)[:, None] * o.to(tl.float32), dt, INTERP)  # post·out in dt
        pacc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for i in tl.static_range(N):  # Σ_i comb[i, j]·R[i] in fp32, i in order
            c = cast(tl.load(comb_ptr + rows * stride_ct + i * stride_ci + j, mask=t_mask, other=0.0), dt, INTERP)
            r = tl.load(s_ptr + rows[:, None] * stride_st + i * stride_sn + hh[None, :], mask=m, other=0.0)
            pacc += c.to(tl.float32)[:, None] * r.to(tl.float32)
        y = cast(spread.to(tl.float32) + cast(pacc, dt, INTERP).to(tl.float32), dt, INTERP)
        tl.store(y_ptr + rows[:, None] * stride_yt + kk[None, :], y, mask=m)
        # mixes: as _mix_kernel on the stored y
        x = y.to(tl.float32)
        f = tl.load(fn_ptr + offs_c[None, :] * stride_fn + kk[:, None],
                    mask=c_mask[None, :] & k_mask[:, None], other=0.0).to(tl.float32)
        sq += x * x
        acc = _mix_dot(x, f, acc, BF16X3, INTERP)
    ss = tl.sum(sq, axis=1)
    acc = tl.where(offs_c[None, :] == NMIX, ss[:, None], acc)
    tl.store(part_ptr + pid_s * stride_ps + rows[:, None] * stride_pt + offs_c[None, :], acc,
             mask=t_mask[:, None])


def fusable(H: int, config: dict | None = None) -> bool:
    """Whether ``mhc_post_pre`` runs fused for hidden size H (else it runs hc_post, then hc_pre)."""
    cfg = dict(CONFIG, **(config or {}))
    return H > 0 and H % cfg["MIX_BLOCK_K"] == 0 and cfg["SPLIT"] % cfg["MIX_BLOCK_K"] == 0


def mhc_post_pre(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
                 rms_eps: float, *, config: dict | None = None):
    """``hc_post(streams, out, post, comb)`` then ``hc_pre`` of the result with (fn, base, scale):
    → (new streams [T, n, H], collapsed [T, H], post [T, n], comb [T, n, n]), bitwise those of the
    two ops (same contract as ``dsv4.model.mhc.hc_post_pre``)."""
    streams, out, post, comb = _check_post(streams, out, post, comb)
    T, n, H = streams.shape
    _check_pre_weights(n, H, fn, base, scale, streams.shape)
    cfg = dict(CONFIG, **(config or {}))
    fused_max = cfg["POST_MIX_FUSED_MAX_T"]
    if not fusable(H, cfg) or (fused_max is not None and T > fused_max):
        y = hc_post(streams, out, post, comb, config=config)
        return (y, *hc_pre(y, fn, base, scale, iters, hc_eps, rms_eps, config=config))
    dev = streams.device
    y = torch.empty((T, n, H), dtype=streams.dtype, device=dev)
    if T == 0:
        return (y, *_empty_pre(T, n, H, streams.dtype, dev))
    fn32 = fn.float().contiguous()
    part, nmix_p, S = _part(T, n, H, cfg, dev)
    _post_mix_kernel[(math.ceil(T / cfg["MIX_BLOCK_T"]), S)](
        streams, out, post, comb, y, fn32, part, T, H, n * H,
        streams.stride(0), streams.stride(1), out.stride(0), post.stride(0), comb.stride(0), comb.stride(1),
        y.stride(0), fn32.stride(0), part.stride(0), part.stride(1),
        N=n, NMIX=2 * n + n * n, NMIX_P=nmix_p, SPLIT=cfg["SPLIT"], BLOCK_T=cfg["MIX_BLOCK_T"],
        BLOCK_K=cfg["MIX_BLOCK_K"], BF16X3=_bf16x3(streams.dtype, cfg), INTERP=interpreting(),
        num_warps=cfg["MIX_WARPS"] if T <= DECODE_MAX_ROWS else cfg["POST_MIX_WARPS_PREFILL"])
    return (y, *_gates(part, y, base, scale, iters, hc_eps, rms_eps, cfg))
