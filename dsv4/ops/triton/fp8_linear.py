"""Triton FP8 block-scaled linear: y = x · dequant(W)ᵀ, W e4m3 [N, K] with one scale per 128×128 block.

Per program: a [BLOCK_M, BLOCK_N] output tile over a run of K chunks (see "Batch invariance").
Per K step (BLOCK_K = 128 = one scale block column):

1. load the x tile [BLOCK_M, 128] (bf16/fp16/fp32; rows ≥ M and columns ≥ K masked to 0);
2. load the weight bytes [BLOCK_N, 128] (rows ≥ N, columns ≥ K masked to 0) and the BLOCK_N
   scales of this block column (row n uses scale[n // 128, k // 128]; UE8M0 bytes or float32);
3. decode to fp32 (hardware e4m3 conversion on sm_89+, exact integer decode elsewhere), multiply
   by the scale, round to x's dtype (the reference dequantizes to x.dtype), and accumulate
   W_tile · x_tileᵀ into an fp32 [BLOCK_N, BLOCK_M] tile ("swap-AB": the decoded weight is the
   register-resident left operand, the activations the right one, so decode batches of 1..64 rows
   only narrow the MMA instead of padding it to 64 rows). fp32 x uses an IEEE fp32 dot, never
   TF32; the interpreter sums the products k by k in fp32 (``dense.dot_acc``: its bf16 dot is
   wrong and its fp32 dot is a BLAS call whose row result depends on the row's place in the tile).

Batch invariance (the default, ``dsv4.ops.invariance``): K is reduced in chunks whose width depends
on the weight shape alone (``invariant_chunk``), each chunk accumulated from 0 and the chunks added
in order, y = round(((0 + P_0) + P_1) + …). Decode sizes (M ≤ 64) use 64-row weight tiles over the
narrowest MMA that holds M (``decode_block_m``) and one program per chunk (the fp32 partials added in
order by each tile's last program in the same launch,
``_common.SPLIT_FIXUP``, or by a second launch, ``sum_in_order``); prefill sizes use their
fastest tiles and fold the chunks in one program. The bits of a row are the same for every M (on
the H200 the MMA tile shape does not change them, ``tests/gpu``), so a prompt's logits do not
depend on the other requests of its step, its chunking or prefix-cache hits.

Tiles by M (chosen from an H200 sweep, CUDA-graph timings): decode (M ≤ 64; without invariance
BLOCK_M 16/32/64, BLOCK_N 64/128, and split-K so that about two programs per SM run even when N is
small) and prefill (BLOCK_M 256 × BLOCK_N 128, 8 warps, when that gives ≥ 96 tiles — 256 × 64 for a
weight of ≤ 2048 rows whose K is several chunks — else 128 × 64 with 4 warps; grouped program
order for L2 reuse of weight tiles).

``act_quant`` (the release's FP8 activations): each 128-column block of each x row is rounded to FP8 with a
power-of-two scale, exactly the reference's ``fake_quant_fp8_pow2``, once, in a launch of its own
(``act_quant_rows``), before the GEMM. Done in the K loop, every program re-quantized its x tile (a row max and a
register round trip before each MMA), N / BLOCK_N times over at prefill: H200, weights cold in L2, the decode
launch of wq_b took 23.8 µs against 15.0 with the separate launch, and M = 8192 5.0 ms against 1.29
(``bench/kernels.py --sweep --only linear_act_quant``). The MMA sees the same values, so the same bits.

Long prefills (M ≥ W16_MIN_M) of a weight whose K is several chunks take the weight dequantized to
x's dtype first (``dequant_weight``: one launch computing step 3's values) and load that tile as it is
(``W16``): the two live fp32 tiles of the chunked sum left no registers for the in-register decode at
the large tiles, and the plain bf16 tile runs 20-30 % faster at 128 × 128. The products and their
order are the same, so are the bits (H200: every shape's rows equal the decode tile's). The bf16 copy
is made per launch (~28 µs for a 32M-weight matrix), not kept from load time: keeping one would double
the memory of every FP8 linear weight for a prefill-only gain.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...formats import OCP
from ..invariance import DECODE_MAX_ROWS, batch_invariant
from . import _common
from ._common import (
    FIXUP_ROWS,
    cast,
    e4m3_bytes,
    fake_quant_rows,
    fp8_to_f32,
    fp8_weight_bytes,
    grouped_tile,
    interpreting,
    native_fp8,
    num_sms,
    quant_rows,
    scale_kind,
    split_counters,
    split_sum_last,
    sum_in_order,
    ue8m0_to_f32,
)
from .dense import dot_acc
from .kv_insert import _quant_consts

__all__ = ["fp8_linear", "pick_config", "invariant_chunk", "dequant_weight"]

BLOCK = 128
BLOCK_Q = tl.constexpr(BLOCK)  # the activation quantization's block (one FP8 scale per 128 columns)
_OCP_Q = _quant_consts(OCP)  # ``quant_rows``' constants for OCP e4m3, the FP8 MMA's activation codes
A8_Q_MANT, A8_Q_EXP, A8_MIN_E = tl.constexpr(_OCP_Q[0]), tl.constexpr(_OCP_Q[1]), tl.constexpr(1 - _OCP_Q[3])


@triton.jit
def _dequant_tile(wb, sb, DTYPE: tl.constexpr, SCALE_UE8M0: tl.constexpr, NATIVE: tl.constexpr, FNUZ: tl.constexpr,
                  INTERP: tl.constexpr):
    """e4m3 bytes [rows, k] times their rows' block scales (UE8M0 bytes or float32), rounded to DTYPE:
    the one expression both the GEMM (in registers) and ``dequant_weight`` (to memory) evaluate."""
    if SCALE_UE8M0:
        s = ue8m0_to_f32(sb)
    else:
        s = sb.to(tl.float32)
    return cast(fp8_to_f32(wb, NATIVE, FNUZ) * s[:, None], DTYPE, INTERP)


@triton.jit
def _chunk(
    x_ptr,
    w_ptr,
    s_ptr,
    c,
    CHUNK,
    K,
    offs_m,
    offs_n,
    offs_k,
    m_mask,
    n_mask,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_UE8M0: tl.constexpr,
    NATIVE: tl.constexpr,
    FNUZ: tl.constexpr,
    DOT_F32: tl.constexpr,
    INTERP: tl.constexpr,
    W16: tl.constexpr = False,
    EVEN_K: tl.constexpr = False,
    xs_ptr=None,
    stride_xsm=0,
    A8: tl.constexpr = False,
    A8_QUANT: tl.constexpr = False,
):
    """P_c = W_tile · x_tileᵀ over K chunk c ([BLOCK_N, BLOCK_M] fp32, accumulated from 0). W16:
    w_ptr holds the weight already dequantized to x's dtype (``dequant_weight``: the same values).
    EVEN_K: K is a multiple of BLOCK_K (no column masks). A8: x_ptr holds e4m3 codes and xs_ptr their per-128
    scales (``act_quant_codes``, ``_a8_chunk``)."""
    if A8:
        acc = _a8_chunk(x_ptr, xs_ptr, w_ptr, s_ptr, c, CHUNK, K, offs_m, offs_n, offs_k, m_mask, n_mask, stride_xm,
                        stride_xk, stride_xsm, stride_wn, stride_wk, stride_sn, stride_sk, BLOCK_M, BLOCK_N, BLOCK_K,
                        SCALE_UE8M0, INTERP, A8_QUANT, A8_Q_MANT, A8_Q_EXP,
                        A8_MIN_E)
    else:
        x_dtype = x_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, K), BLOCK_K):
            kk = k0 + offs_k
            if EVEN_K:
                xm = m_mask[:, None]
                wm = n_mask[:, None]
            else:
                k_mask = kk < K
                xm = m_mask[:, None] & k_mask[None, :]
                wm = n_mask[:, None] & k_mask[None, :]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk, mask=xm, other=0.0)
            if W16:
                w = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :] * stride_wk, mask=wm, other=0.0)
            else:
                wb = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :] * stride_wk, mask=wm, other=0)
                sb = tl.load(s_ptr + (offs_n // 128) * stride_sn + (k0 // 128) * stride_sk, mask=n_mask, other=0)
                w = _dequant_tile(wb, sb, x_dtype, SCALE_UE8M0, NATIVE, FNUZ, INTERP)
            if INTERP:  # k by k (dense.dot_acc): a row's value does not depend on its place in the tile
                acc = dot_acc(w, tl.trans(x), acc, True, INTERP)
            elif DOT_F32:
                acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(w, tl.trans(x))
    return acc


@triton.jit
def _a8_chunk(x_ptr, xs_ptr, w_ptr, s_ptr, c, CHUNK, K, offs_m, offs_n, offs_k, m_mask, n_mask, stride_xm, stride_xk,
              stride_xsm, stride_wn, stride_wk, stride_sn, stride_sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, SCALE_UE8M0: tl.constexpr, INTERP: tl.constexpr, QUANT: tl.constexpr = False,
              Q_MANT: tl.constexpr = 0, Q_EXP: tl.constexpr = 0, MIN_E: tl.constexpr = 0):
    """``_chunk`` of FP8 activations (the release's ``fp8_gemm``): per 128-column block, the e4m3 × e4m3 MMA of the
    weight's and x's codes (k32 steps, from 0), then that block's product times the weight block's scale and each
    row's x scale (powers of two for UE8M0 weights: exact) added to the chunk's fp32 sum, so the MMA's reduced-width
    accumulation spans 128 products at most. K is a multiple of 128 (act_quant's contract). The interpreter
    decodes both codes to fp32 and sums k by k (``dense.dot_acc``). QUANT: x_ptr holds x itself, each block
    quantized as loaded (``quant_rows``, OCP constants): the codes and scales ``act_quant_codes`` stores, so the
    same MMA operands (compiled, the codes are the hardware's fp32 -> e4m3 conversion of values on its grid)."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, K), BLOCK_K):
        kk = k0 + offs_k
        wb = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :] * stride_wk, mask=n_mask[:, None], other=0)
        sb = tl.load(s_ptr + (offs_n // 128) * stride_sn + (k0 // 128) * stride_sk, mask=n_mask, other=0)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk
        if QUANT:
            xv, xs = quant_rows(tl.load(x_ptrs, mask=m_mask[:, None], other=0.0).to(tl.float32), Q_MANT, Q_EXP,
                                MIN_E)
        else:
            xb = tl.load(x_ptrs, mask=m_mask[:, None], other=0)
            xs = tl.load(xs_ptr + offs_m * stride_xsm + k0 // 128, mask=m_mask, other=0.0)
        if SCALE_UE8M0:
            ws = ue8m0_to_f32(sb)
        else:
            ws = sb.to(tl.float32)
        if INTERP:
            if not QUANT:
                xv = fp8_to_f32(xb, False, False)
            p = dot_acc(fp8_to_f32(wb, False, False), tl.trans(xv), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32),
                        True, INTERP)
        else:
            if QUANT:
                x8 = xv.to(tl.float8e4nv)
            else:
                x8 = xb.to(tl.float8e4nv, bitcast=True)
            p = tl.dot(wb.to(tl.float8e4nv, bitcast=True), tl.trans(x8))
        acc += p * ws[:, None] * xs[None, :]
    return acc


@triton.jit
def _act_quant_kernel(x_ptr, y_ptr, K, stride_xm, stride_xk, stride_ym, Q_MANT: tl.constexpr, Q_EXP: tl.constexpr,
                      MIN_E: tl.constexpr, NB: tl.constexpr, INTERP: tl.constexpr, s_ptr=None, stride_sm=0,
                      CODES: tl.constexpr = False):
    """Row program_id(0) of x as [K/128 blocks, 128]: each block's FP8 round trip (``fake_quant_rows``, the codec's
    ``fake_quant_fp8_pow2``), stored in x's dtype (exact there). CODES: the e4m3 bytes to y and each block's
    power-of-two scale (fp32) to s instead (``quant_rows``: their products are the round trip's values)."""
    row = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, NB)[:, None] * BLOCK_Q + tl.arange(0, BLOCK_Q)[None, :]
    m = kk < K
    x = tl.load(x_ptr + row * stride_xm + kk * stride_xk, mask=m, other=0.0)
    if CODES:
        v, scale = quant_rows(x.to(tl.float32), Q_MANT, Q_EXP, MIN_E)
        tl.store(y_ptr + row * stride_ym + kk, e4m3_bytes(v), mask=m)
        blocks = tl.arange(0, NB)
        tl.store(s_ptr + row * stride_sm + blocks, scale, mask=blocks * BLOCK_Q < K)
    else:
        q = fake_quant_rows(x.to(tl.float32), Q_MANT, Q_EXP, MIN_E)
        tl.store(y_ptr + row * stride_ym + kk, cast(q, y_ptr.dtype.element_ty, INTERP), mask=m)


def act_quant_consts(act_fmt=None) -> tuple[int, int, int]:
    """(Q_MANT, Q_EXP, MIN_E) of ``fake_quant_rows`` for the FP8 format ``act_fmt`` (default: the platform's)."""
    from ..torch_ops import act_format

    q_mant, q_exp, _, bias, _ = _quant_consts(act_format(act_fmt))
    return q_mant, q_exp, 1 - bias


def act_quant_rows(x2: torch.Tensor, q_mant: int, q_exp: int, min_e: int) -> torch.Tensor:
    """x [M, K] (K a multiple of 128) with every 128-column block of every row FP8-round-tripped, in x's dtype."""
    m, k = x2.shape
    y = torch.empty((m, k), dtype=x2.dtype, device=x2.device)
    nb = triton.next_power_of_2(k // BLOCK)
    _act_quant_kernel[(m,)](x2, y, k, x2.stride(0), x2.stride(1), y.stride(0), Q_MANT=q_mant, Q_EXP=q_exp,
                            MIN_E=min_e, NB=nb, INTERP=interpreting(), num_warps=4 if nb <= 32 else 8)
    return y


def act_quant_codes(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) quantized per 128 columns to OCP e4m3 with power-of-two scales: (codes as uint8
    [M, K], scales fp32 [M, K/128]), whose products are ``act_quant_rows``' values (the codec's)."""
    m, k = x2.shape
    codes = torch.empty((m, k), dtype=torch.uint8, device=x2.device)
    scales = torch.empty((m, k // BLOCK), dtype=torch.float32, device=x2.device)
    nb = triton.next_power_of_2(k // BLOCK)
    _act_quant_kernel[(m,)](x2, codes, k, x2.stride(0), x2.stride(1), codes.stride(0), Q_MANT=A8_Q_MANT,
                            Q_EXP=A8_Q_EXP, MIN_E=A8_MIN_E, NB=nb, INTERP=interpreting(), s_ptr=scales,
                            stride_sm=scales.stride(0), CODES=True, num_warps=4 if nb <= 32 else 8)
    return codes, scales


@triton.jit(do_not_specialize=["M", "CHUNKS_PER_PROGRAM", "stride_ys"])
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    GROUP_N,
    CHUNK,
    CHUNKS_PER_PROGRAM,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_ys,
    stride_ym,
    stride_yn,
    out_ptr,
    cnt_ptr,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SCALE_UE8M0: tl.constexpr,
    NATIVE: tl.constexpr,
    FNUZ: tl.constexpr,
    DOT_F32: tl.constexpr,
    INTERP: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    W16: tl.constexpr = False,
    FIXUP: tl.constexpr = False,
    N_PARTS: tl.constexpr = 1,
    EVEN_K: tl.constexpr = False,
    xs_ptr=None,
    stride_xsm=0,
    A8: tl.constexpr = False,
    A8_QUANT: tl.constexpr = False,
):
    """A8: x holds e4m3 codes, xs their per-128 scales (``_a8_chunk``); A8_QUANT: x itself, quantized as loaded."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # grouped (block-diagonal) weights: output rows [g·GROUP_N, (g+1)·GROUP_N) read x's columns
    # [g·K, (g+1)·K); GROUP_N is a multiple of BLOCK_N (N when not grouped: group 0)
    group = ((pid_n * BLOCK_N) // GROUP_N).to(tl.int64)
    x_ptr += group * K * stride_xk
    if A8:
        xs_ptr += group * (K // BLOCK_K)

    # K is cut into chunks of CHUNK columns; this program adds chunks [c_lo, c_hi) in order, each
    # accumulated from 0 apart: total = ((0 + P_lo) + P_lo+1) + ... (split mode: one chunk each,
    # summed in the same order by sum_in_order; fused mode: all chunks here; same bits)
    c_lo = pid_s * CHUNKS_PER_PROGRAM
    c_hi = tl.minimum(c_lo + CHUNKS_PER_PROGRAM, tl.cdiv(K, CHUNK))
    # swap-AB: acc[n, m] = W_tile · x_tileᵀ, so the decoded weight is the left (register) operand
    # and a small M only sets the MMA's N width (no padding of M to 64/128 rows).
    # ONE_CHUNK (every split-mode program, and fused mode when K is one chunk): the chunk's
    # accumulator is the total, plus 0.0 (= 0 + P_0, so -0 becomes +0 as in the general form);
    # no second fp32 tile is live (ptxas, sm_90a: the 256 × 128 prefill tile spilled 1.2 KB with two)
    if ONE_CHUNK:
        total = (
            _chunk(
                x_ptr,
                w_ptr,
                s_ptr,
                c_lo,
                CHUNK,
                K,
                offs_m,
                offs_n,
                offs_k,
                m_mask,
                n_mask,
                stride_xm,
                stride_xk,
                stride_wn,
                stride_wk,
                stride_sn,
                stride_sk,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                SCALE_UE8M0,
                NATIVE,
                FNUZ,
                DOT_F32,
                INTERP,
                W16,
                EVEN_K,
                xs_ptr,
                stride_xsm,
                A8,
                A8_QUANT,
            )
            + 0.0
        )
    else:
        total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for c in range(c_lo, c_hi):
            total += _chunk(
                x_ptr,
                w_ptr,
                s_ptr,
                c,
                CHUNK,
                K,
                offs_m,
                offs_n,
                offs_k,
                m_mask,
                n_mask,
                stride_xm,
                stride_xk,
                stride_wn,
                stride_wk,
                stride_sn,
                stride_sk,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                SCALE_UE8M0,
                NATIVE,
                FNUZ,
                DOT_F32,
                INTERP,
                W16,
                EVEN_K,
                xs_ptr,
                stride_xsm,
                A8,
                A8_QUANT,
            )
    y_ptrs = y_ptr + pid_s * stride_ys + offs_m[None, :] * stride_ym + offs_n[:, None] * stride_yn
    tl.store(y_ptrs, cast(total, y_ptr.dtype.element_ty, INTERP), mask=n_mask[:, None] & m_mask[None, :])
    if FIXUP:  # split mode, y the fp32 partials: the tile's last program sums them into out
        split_sum_last(y_ptr, out_ptr, cnt_ptr, pid, pid_m * BLOCK_M, M, offs_n, n_mask, stride_ys, stride_ym,
                       stride_yn, stride_om, stride_on, N_PARTS, BLOCK_M, BLOCK_N, FIXUP_ROWS, INTERP)


# act_quant's GEMMs as e4m3 × e4m3 MMAs where the hardware has them (CUDA sm_89+; the interpreter emulates them): x
# quantized to codes and per-128 scales in one launch (``act_quant_codes``), no weight decode, k32 MMAs (half the
# bf16 path's count), each 128-column block's product scaled into the fp32 sum (``_a8_chunk``: the release's
# fp8_gemm). Other bits than the bf16 MMA of the rounded x (the MMA's accumulation). Off: H100, 43 layers,
# --act-quant (docs/perf.md), batch 1 10.85 against 10.87 ms a step, and the prefill tile is slower (M = 8192 wq_b
# 1,892 against 1,278 µs); one tile shape serves every M, so decode and prefill change together.
ACT_QUANT_FP8_MMA = False
# With it, the decode launch (M ≤ 64, batch-invariant) quantizes x as it loads each block instead of reading the codes
# launch's output (one launch fewer a GEMM; the same MMA operands, so the same bits): with both, 10.56 ms (above).
A8_QUANT_IN_DECODE = False
# The prefill tile: ptxas sm_90a (Triton 3.6) gives 191 registers (238 with K in several chunks: two fp32 tiles) and no
# spill at 64 x 128 with 8 warps; 128 x 64 with 4 warps, 128 x 128 and 256 x 128 with 8 spill 104-904 bytes.
A8_PREFILL_TILE = dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=4, GROUP_M=8)


def act_quant_fp8_mma(device: torch.device, act_fmt=None) -> bool:
    """Whether ``fp8_linear(act_quant=True)`` multiplies FP8 codes (``ACT_QUANT_FP8_MMA``): OCP activations on CUDA
    sm_89+ compiled, or the interpreter (FNUZ and older GPUs keep the bf16 MMA of the rounded x)."""
    from ..torch_ops import act_format

    if not ACT_QUANT_FP8_MMA or act_format(act_fmt).name != "ocp":
        return False
    return interpreting() or native_fp8(device)


def _decode_block_n(n: int) -> int:
    """BLOCK_N that sets the batch-invariant K chunks of an [n, k] weight (``invariant_chunk``)."""
    return 128 if n >= 4096 else 64


# The batch-invariant decode launch (M ≤ 64): the MMA's N width is the next of 16 / 32 / 64 that holds M and the
# weight tile is 64 rows, whatever the weight: the chunks (``invariant_chunk``) do not change, nor do the bits (the
# H200 gives every tile shape the same row bits). H200, CUDA-graph medians, M = 1 (``bench/kernels.py --sweep --only
# linear_decode``), against the former single 64 × 128 tile (64 for N < 4096): wq_b 18.7 -> 12.3 us, wo_a 20.9 ->
# 14.0, wo_b 21.0 -> 14.1, shared w1 9.2 -> 6.8, shared w2 9.3 -> 6.7, indexer wq_b 9.2 -> 6.6, wq_a 7.3 -> 5.7;
# more K chunks, 4 stages (alone; in the step 4 are faster: DECODE_STAGES), 8 warps, or the block scale moved onto x
# (fewer instructions, but a register round trip of x before the MMA) were slower.
DECODE_BLOCK_N = 64
DECODE_BLOCK_M: int | None = None  # None: by M (``decode_block_m``); 64 (and DECODE_BLOCK_N 128): the former launch
# The decode launch's software-pipeline stages (the same bits at any value). H200, 43 layers, CUDA graphs, one call
# (bench/e2e.py --ab dsv4.ops.triton.fp8_linear.DECODE_STAGES=4): batch 1 8.88 against 8.98 ms a step with 3, batch 8
# 13.88 against 13.89; a replayed launch alone, its weight warm in L2, was faster at 3 (``--sweep --only
# linear_decode``): in the step the weights come from HBM.
DECODE_STAGES = 4


def decode_block_m(m: int) -> int:
    """The decode launch's BLOCK_M (the MMA's N width) for M ≤ 64 rows."""
    if DECODE_BLOCK_M is not None:
        return DECODE_BLOCK_M
    return 16 if m <= 16 else (32 if m <= 32 else 64)


def invariant_chunk(n: int, k: int, device: torch.device) -> int:
    """K columns per chunk of the batch-invariant reduction of an [n, k] weight: a function of the
    weight shape (and the device's SM count) alone, so every M reduces K in the same order. It is
    the split-K share of a 128-row tile for n ≥ 4096 (64 rows below): about two such programs per SM
    at batch 1 (the decode launch runs 64-row tiles, so twice as many for n ≥ 4096)."""
    k_blocks = max(1, math.ceil(k / BLOCK))
    tiles = math.ceil(n / _decode_block_n(n))
    split = max(1, min(k_blocks, (2 * num_sms(device)) // max(tiles, 1)))
    return math.ceil(k_blocks / split) * BLOCK


W16_TILE = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)  # the prefill tile over a bf16 weight
W16_MIN_M = 2048  # rows from which the dequantized weight pays for its launch (measured at 8192 only)
SHARED_LIMIT = 232448  # bytes of shared memory per block on the H200 (sm_90), as Triton reports it


def shared_bytes(cfg: dict, x_bytes: int) -> int:
    """Shared memory a tile configuration needs: (stages - 1) buffers of the x and FP8 weight
    tiles, plus the weight tile upcast to fp32 for the fp32 dot. It reproduces what the H200
    reported for an fp32 128×64 tile at 4 stages (253,952 bytes)."""
    per_stage = cfg["BLOCK_M"] * BLOCK * x_bytes + cfg["BLOCK_N"] * BLOCK
    upcast = cfg["BLOCK_N"] * BLOCK * 4 if x_bytes == 4 else 0
    return (cfg["num_stages"] - 1) * per_stage + upcast


def pick_config(m: int, n: int, k: int, device: torch.device, config: dict | None = None, x_bytes: int = 2,
                a8: bool = False) -> dict:
    """Launch configuration for an [m, k] x [n, k]ᵀ product (``config`` entries override).

    ``x_bytes``: the activation's element size. fp32 activations (the fp32 dot) double the x
    tiles in shared memory and add the upcast weight tile: the H200 measured 248 KiB for
    128×64 at 4 stages (limit 227 KiB), so fp32 prefill tiles are 128×64 at 2 stages.

    Batch-invariant (the default): K is reduced in chunks of ``invariant_chunk(n, k)`` for every M,
    one program per chunk at decode sizes (M ≤ 64, one tile shape; the partials summed in order)
    and all chunks folded in one program at prefill sizes (their fastest tiles): a row's bits do
    not depend on M, so neither on the batch, the chunking of a prompt nor prefix-cache hits.
    Otherwise the fastest per-M choice (decode split-K from M; prefill one chunk). ``a8``: FP8 codes times the
    FP8 weight (``_a8_chunk``): the decode tiles, else ``A8_PREFILL_TILE`` (never the dequantized weight)."""
    invariant = batch_invariant()
    decode = m <= DECODE_MAX_ROWS
    chunked = invariant_chunk(n, k, device) < max(1, math.ceil(k / BLOCK)) * BLOCK  # K in several chunks
    if invariant and decode:  # the weight's K chunks at any M ≤ 64, over the narrowest MMA that holds M
        bn = min(DECODE_BLOCK_N, _decode_block_n(n))
        cfg = dict(BLOCK_M=decode_block_m(m), BLOCK_N=bn, num_warps=4, num_stages=DECODE_STAGES, GROUP_M=1,
                   split_k=None)
    elif a8 and not decode:
        cfg = dict(A8_PREFILL_TILE, split_k=1)
    elif m <= 64:  # decode: narrow MMA (BLOCK_M is its N width), split K to fill the SMs
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        bn = 128 if (m > 16 and n >= 4096) else 64
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=3, GROUP_M=1, split_k=None)
    elif x_bytes > 2:  # fp32 activations: the tiles that fit in shared memory (see above)
        cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, GROUP_M=8, split_k=1)
    elif invariant and m >= W16_MIN_M and chunked:
        # long prefill of a weight whose K is several chunks (two fp32 tiles live): the weight dequantized
        # to x's dtype first (one launch, ~N·K·3 bytes), then a plain 16-bit GEMM at 128 x 128 (same bits;
        # H200, M = 8192, dequantization included, against the 256 x 128 FP8 tile: wo_b
        # 1,525 -> 1,197 us, wo_a 1,704 -> 1,259, shared w2 640 -> 401, indexer wq_b 683 -> 411, shared w1
        # 432 -> 332, wq_a 257 -> 195, wkv 181 -> 148; wq_b, one chunk, keeps 256 x 128)
        cfg = dict(W16_TILE, GROUP_M=8, split_k=1, w16=True)
    elif invariant and n <= 2048 and math.ceil(m / 256) * math.ceil(n / 64) >= 96 and chunked:
        # prefill of a narrow weight whose K is several chunks (two fp32 tiles live): 256 x 64
        # (H200 sweep at M = 8192: wq_a 258 vs 315 us, shared w1 436 vs 468, wkv 180 vs 239)
        cfg = dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=3, GROUP_M=8, split_k=1)
    elif math.ceil(m / 256) * math.ceil(n / 128) >= 96:  # prefill, enough 256x128 tiles (H200 sweep)
        cfg = dict(BLOCK_M=256, BLOCK_N=128, num_warps=8, num_stages=3, GROUP_M=8, split_k=1)
    else:  # mid-size M or narrow N: smaller tiles keep the SMs busy
        cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4, GROUP_M=8, split_k=1)
    override_split = bool(config) and "split_k" in config
    if config:
        cfg.update(config)
    k_blocks = max(1, math.ceil(k / BLOCK))
    if invariant and not override_split:
        chunk = invariant_chunk(n, k, device)
        n_chunks = math.ceil(k_blocks * BLOCK / chunk)
        cfg["chunk"] = chunk
        cfg["split_k"] = n_chunks if decode else 1  # split mode (programs per chunk) or fused mode
        cfg["chunks_per_program"] = 1 if decode else n_chunks
        return cfg
    if cfg["split_k"] is None:  # decode: enough programs to cover the SMs twice
        tiles = math.ceil(m / cfg["BLOCK_M"]) * math.ceil(n / cfg["BLOCK_N"])
        cfg["split_k"] = max(1, min(k_blocks, (2 * num_sms(device)) // max(tiles, 1)))
    per = math.ceil(k_blocks / max(1, int(cfg["split_k"])))
    cfg["chunk"] = per * BLOCK
    cfg["split_k"] = math.ceil(k_blocks / per)
    cfg["chunks_per_program"] = 1
    return cfg


@triton.jit
def _dequant_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_on,
    stride_ok,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_UE8M0: tl.constexpr,
    NATIVE: tl.constexpr,
    FNUZ: tl.constexpr,
    INTERP: tl.constexpr,
):
    """out = the weight tile as ``_chunk`` dequantizes it in registers (``_dequant_tile``)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    kk = k0 + tl.arange(0, BLOCK_K)
    m = (offs_n < N)[:, None] & (kk < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    wb = tl.load(w_ptr + rows * stride_wn + kk[None, :] * stride_wk, mask=m, other=0)
    sb = tl.load(s_ptr + (offs_n // 128) * stride_sn + (k0 // 128) * stride_sk, mask=offs_n < N, other=0)
    w = _dequant_tile(wb, sb, out_ptr.dtype.element_ty, SCALE_UE8M0, NATIVE, FNUZ, INTERP)
    tl.store(out_ptr + rows * stride_on + kk[None, :] * stride_ok, w, mask=m)


def dequant_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The FP8 block-scaled weight [N, K] dequantized to ``dtype`` exactly as the GEMM does it in registers
    (e4m3 -> fp32, times the 128x128 block's scale, rounded to ``dtype``), in one launch."""
    wb, fnuz = fp8_weight_bytes(weight)
    sc, ue8m0 = scale_kind(scale)
    n, k = wb.shape
    out = torch.empty((n, k), dtype=dtype, device=wb.device)
    if n and k:
        _dequant_kernel[(triton.cdiv(n, 64), triton.cdiv(k, BLOCK))](
            wb,
            sc,
            out,
            n,
            k,
            wb.stride(0),
            wb.stride(1),
            sc.stride(0),
            sc.stride(1),
            out.stride(0),
            out.stride(1),
            BLOCK_N=64,
            BLOCK_K=BLOCK,
            SCALE_UE8M0=ue8m0,
            NATIVE=bool(native_fp8(wb.device) and not fnuz),
            FNUZ=fnuz,
            INTERP=interpreting(),
            num_warps=4,
        )
    return out


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out_dtype=None,
    act_quant: bool = False,
    act_fmt=None,
    groups: int = 1,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Same contract as ``dsv4.ops.torch_ops.fp8_linear`` (x [..., groups·K] bf16/fp16/fp32; with
    ``groups`` > 1 one launch computes the block-diagonal product of the attention's grouped
    output projection: group g's N/groups weight rows times x's g-th K columns)."""
    out_dtype = out_dtype or x.dtype
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    wb, fnuz = fp8_weight_bytes(weight)
    n, k = wb.shape
    if groups < 1 or (groups > 1 and (n % groups or (n // groups) % BLOCK)):
        raise ValueError(f"groups={groups} must split the weight's {n} rows into whole {BLOCK}-row blocks")
    if x.shape[-1] != groups * k:
        raise ValueError(
            f"x has K={x.shape[-1]} but the weight is {tuple(wb.shape)} in {groups} group(s): expected {groups * k}"
        )
    sc, ue8m0 = scale_kind(scale)
    if tuple(sc.shape) != (math.ceil(n / BLOCK), math.ceil(k / BLOCK)):
        raise ValueError(
            f"scale grid {tuple(sc.shape)} does not match weight {tuple(wb.shape)} "
            f"(expected {(math.ceil(n / BLOCK), math.ceil(k / BLOCK))})"
        )
    if act_quant and k % BLOCK:
        raise ValueError(f"act_quant needs K to be a multiple of {BLOCK}, got {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, groups * k)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return torch.zeros(*lead, n, dtype=out_dtype, device=x.device)
    a8 = act_quant and act_quant_fp8_mma(x.device, act_fmt)
    cfg = pick_config(m, n, k, x.device, config, x_bytes=1 if a8 else x.element_size(), a8=a8)
    xs = None
    a8_quant = a8 and A8_QUANT_IN_DECODE and batch_invariant() and m <= DECODE_MAX_ROWS
    if a8:
        if cfg.get("w16") not in (None, False):
            raise ValueError("config w16 (a dequantized weight) does not apply to FP8 activations' MMA")
        if not a8_quant:
            x2, xs = act_quant_codes(x2)
    elif act_quant:
        x2 = act_quant_rows(x2, *act_quant_consts(act_fmt))
    if groups > 1 and (n // groups) % cfg["BLOCK_N"]:
        raise ValueError(f"groups={groups}: {n // groups} rows per group is not a multiple of BLOCK_N {cfg['BLOCK_N']}")
    native = cfg.get("native", native_fp8(x.device) and not fnuz)
    w16 = cfg.get("w16")  # the weight dequantized to x's dtype beforehand: True (here), a tensor, or None
    if w16 is True:
        w16 = dequant_weight(weight, scale, x.dtype)
    elif w16 is False:
        w16 = None
    if w16 is not None:
        if tuple(w16.shape) != (n, k) or w16.dtype != x.dtype:
            raise ValueError(
                f"config w16 must be the [{n}, {k}] weight in {x.dtype}, got {tuple(w16.shape)} {w16.dtype}"
            )
        wb = w16
    dot_f32 = interpreting() or x.dtype == torch.float32
    s = cfg["split_k"]
    grid = (math.ceil(m / cfg["BLOCK_M"]) * math.ceil(n / cfg["BLOCK_N"]), s)
    fixup = s > 1 and _common.SPLIT_FIXUP
    if s > 1:
        y = torch.empty((s, m, n), dtype=torch.float32, device=x.device)
        ys = y.stride()
    else:
        y = torch.empty((m, n), dtype=out_dtype, device=x.device)
        ys = (0, *y.stride())
    out, cnt = y, y  # (unread unless fixup)
    if fixup:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
        cnt = split_counters(x.device, grid[0])
    _fp8_linear_kernel[grid](
        x2,
        wb,
        sc,
        y,
        m,
        n,
        k,
        n // groups,
        cfg["chunk"],
        cfg["chunks_per_program"],
        x2.stride(0),
        x2.stride(1),
        wb.stride(0),
        wb.stride(1),
        sc.stride(0),
        sc.stride(1),
        ys[0],
        ys[1],
        ys[2],
        out,
        cnt,
        out.stride(-2),
        out.stride(-1),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=BLOCK,
        GROUP_M=cfg["GROUP_M"],
        SCALE_UE8M0=ue8m0,
        NATIVE=bool(native),
        FNUZ=fnuz,
        DOT_F32=dot_f32,
        INTERP=interpreting(),
        ONE_CHUNK=cfg["chunks_per_program"] == 1,
        W16=w16 is not None,
        FIXUP=fixup,
        N_PARTS=s if fixup else 1,
        EVEN_K=k % BLOCK == 0,
        **({} if not a8 else dict(xs_ptr=x2 if xs is None else xs, stride_xsm=0 if xs is None else xs.stride(0),
                                  A8=True, A8_QUANT=a8_quant)),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if fixup:
        y = out
    elif s > 1:
        y = sum_in_order(y, torch.empty((m, n), dtype=out_dtype, device=x.device))
    return y.reshape(*lead, n)

