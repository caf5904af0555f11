"""Triton ``compressor_pool_insert``: the batched compressor's ring store, pooling, RMSNorm, RoPE and
compressed-page insert in one launch (the torch backend, ``dsv4.ops.torch_compressor``, is ~25 kernels).

One program per row (decode form: every token of the step; it stores its state row into its ring
slot, and the tokens that close a block go on) or per closing entry (chunk form). A program of
entry e of ratio r:

* gathers the block's rows — positions e·r .. e·r+r-1, and for the ratio-4 overlap first the
  previous block's (their first ``dim`` channels; kv 0 / score −inf for e = 0) — a row at a position
  ≥ the chunk's start from the step's ``rows``, an earlier one from the ring (a decode token's own
  row from ``rows``, the others from the ring), as ``torch.where`` picks them in the torch backend;
* softmax over the rows per channel in float64 like torch's CPU kernel: max, then a sequential
  Σ exp(s − max) over the rows, then exp(s − max) / Σ, rounded to fp32;
* pooled = Σ kv·w in fp32, in row order, rows summed in groups of 16 and the group sums summed in
  order (torch's CPU cascade sum over a non-inner dim does exactly this; for ≤ 16 rows it is a
  plain sequential sum). Products are rounded before the add: launched without FP fusion (no FMA);
* RMSNorm as ``dense._rms_norm_kernel``: Σx² by ``tl.sum``, mean by div_rn, 1/sqrt_rn(ms + eps),
  x·r, then weight·(x·r);
* RoPE at position e·r with ``cos_sin`` semantics computed in-kernel: angle = fp32(position) ×
  inv_freq (fp32), cos/sin in float64, rounded to fp32; the interleaved pairs rotated in fp32;
* the insert: a 584-byte ``fp8_ds_mla`` record bf16-rounded first (``kv_insert.store_kv_record``),
  a 132-byte indexer key record (``quantize_indexer_k``: not rounded), or dense rows cast to the
  pages' dtype. Entries whose page is −1 (or whose block lies past the table) are not written.

No host synchronisation and no data-dependent shape: the op runs inside the decode CUDA graphs.
An entry's bytes depend only on its own rows, so entries pooled in a decode step and in a chunk
step are bit-identical. Against the torch backend the values differ only where the reduction
orders differ (Σx² of the RMSNorm; on the GPU also torch's softmax and sum) or an fp64 exp/cos
differs by an ulp before the fp32 rounding (tests/ops/test_ops_compressor_triton.py measures it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...formats.fp8 import get_fp8_format
from ...formats.indexer_record import INDEXER_DIM, INDEXER_RECORD_BYTES, INDEXER_VALUE_BYTES
from ...formats.kv_record import KV_DIM, RECORD_BYTES
from ...model.rope import inv_freq
from ._common import cast, interpreting, ue8m0_to_f32
from .kv_insert import _quant_consts, encode_e4m3, scale_byte, store_kv_record

__all__ = ["compressor_pool_insert"]

SUM_GROUP = 16  # rows per first-level partial sum (torch's CPU cascade sum)


@triton.jit
def _row(j, e, start, base, slot, rows_ptr, ring_ptr, stride_row, stride_rs, stride_rr, ring_size,
         RATIO: tl.constexpr, OVERLAP: tl.constexpr, D: tl.constexpr):
    """Row j of entry e's pooling window: (pointer into rows, pointer into the ring, take it from rows,
    take it from the ring, the row exists). The pointers are at its first channel (kv part)."""
    if OVERLAP:  # rows 0..r-1: the previous block's first D channels; r..2r-1: this block's second D
        prev = j < RATIO
        p = tl.where(prev, (e - 1) * RATIO + j, e * RATIO + j - RATIO)
        ch0 = tl.where(prev, 0, D)
        valid = (e > 0) | (j >= RATIO)
    else:
        p = e * RATIO + j
        ch0 = p * 0
        valid = p >= 0
    pc = tl.maximum(p, 0)
    step = pc >= start
    rrow = rows_ptr + (base + tl.where(step, pc - start, 0)) * stride_row + ch0
    grow = ring_ptr + slot * stride_rs + (pc % ring_size) * stride_rr + ch0
    return rrow, grow, step & valid, (pc < start) & valid, valid


@triton.jit
def _load_row(rrow, grow, from_rows, from_ring, ch, chm):
    a = tl.load(rrow + ch, mask=tl.where(from_rows, chm, False), other=0.0)
    b = tl.load(grow + ch, mask=tl.where(from_ring, chm, False), other=0.0)
    return tl.where(from_rows, a, b)


@triton.jit(do_not_specialize=["pos_ptr", "seq_ptr", "slots_ptr", "bt_ptr", "cl_ptr", "stride_bt", "stride_cl",
                                "n_blocks"])
def _compressor_kernel(pages_ptr, ring_ptr, rows_ptr, pos_ptr, seq_ptr, slots_ptr, bt_ptr, cl_ptr, norm_ptr, invf_ptr,
                       ape_ptr,
                       stride_page, stride_pb, stride_pd, stride_rs, stride_rr, stride_row, stride_bt, stride_cl,
                       n_blocks, ring_size, BLOCK_SIZE, eps,
                       RATIO: tl.constexpr, OVERLAP: tl.constexpr, NR: tl.constexpr, D: tl.constexpr,
                       HALF: tl.constexpr, WIDTH: tl.constexpr,
                       ROPE_HALF: tl.constexpr, DECODE: tl.constexpr, MODE: tl.constexpr, GROUP: tl.constexpr,
                       STORE_BLOCK: tl.constexpr, Q_MANT: tl.constexpr, Q_EXP: tl.constexpr,
                       FMT_MAX: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr, INTERP: tl.constexpr,
                       APE: tl.constexpr = False):
    i = tl.program_id(0).to(tl.int64)
    if DECODE:
        t = i
        seq = tl.load(seq_ptr + i).to(tl.int64)
    else:
        t = tl.load(cl_ptr + i).to(tl.int64)
        seq = tl.load(cl_ptr + 3 * stride_cl + i).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if DECODE:
        start = pos  # the token's own row from rows, every earlier one from the ring
        base = t
        ring_row = ring_ptr + slot * stride_rs + (pos % ring_size) * stride_rr
        for c0 in range(0, 2 * WIDTH, STORE_BLOCK):
            c = c0 + tl.arange(0, STORE_BLOCK)
            v = tl.load(rows_ptr + t * stride_row + c, mask=c < 2 * WIDTH)
            if APE:  # raw GEMM rows: the state row is formed here (``state_rows_from``), the kv half untouched
                sc = c >= WIDTH
                a = tl.load(ape_ptr + (pos % RATIO) * WIDTH + (c - WIDTH), mask=sc & (c < 2 * WIDTH), other=0.0)
                v = tl.where(sc, v.to(tl.float32) + a.to(tl.float32), v.to(tl.float32))
            tl.store(ring_row + c, v, mask=c < 2 * WIDTH)
        if APE:  # the pooling reads the token's own row back from the ring (stored above by this program)
            tl.debug_barrier()
            start = pos + 1
    else:
        start = tl.load(cl_ptr + stride_cl + i).to(tl.int64)
        base = tl.load(cl_ptr + 2 * stride_cl + i).to(tl.int64)
    emits = (pos + 1) % RATIO == 0
    e = tl.maximum((pos + 1) // RATIO - 1, 0)
    blk = e // BLOCK_SIZE
    ok = emits & (blk < n_blocks)
    page = tl.load(bt_ptr + seq * stride_bt + tl.where(ok, blk, 0)).to(tl.int64)
    page = tl.where(ok, page, -1)
    off = e % BLOCK_SIZE
    if page >= 0:
        ch = tl.arange(0, HALF)[:, None] * 2 + tl.arange(0, 2)[None, :]  # [D/2, 2]: pairs (2i, 2i+1)
        chm = ch < D
        # 1. per-channel max of the scores over the rows
        m = tl.full((HALF, 2), float("-inf"), tl.float32)
        for j in range(NR):
            rrow, grow, fr, fg, valid = _row(j, e, start, base, slot, rows_ptr, ring_ptr, stride_row, stride_rs,
                                             stride_rr, ring_size, RATIO, OVERLAP, D)
            s = tl.where(valid, _load_row(rrow + WIDTH, grow + WIDTH, fr, fg, ch, chm), float("-inf"))
            m = tl.maximum(m, s)
        m64 = m.to(tl.float64)
        # 2. Σ exp(s - max) in float64, rows in order
        den = tl.zeros((HALF, 2), tl.float64)
        for j in range(NR):
            rrow, grow, fr, fg, valid = _row(j, e, start, base, slot, rows_ptr, ring_ptr, stride_row, stride_rs,
                                             stride_rr, ring_size, RATIO, OVERLAP, D)
            s = tl.where(valid, _load_row(rrow + WIDTH, grow + WIDTH, fr, fg, ch, chm), float("-inf"))
            den += tl.exp(s.to(tl.float64) - m64)
        # 3. pooled = Σ kv·w (w = the fp64 softmax rounded to fp32), fp32 sums of GROUP rows in order
        pooled = tl.zeros((HALF, 2), tl.float32)
        for g in range(0, NR, GROUP):
            part = tl.zeros((HALF, 2), tl.float32)
            for jj in range(GROUP):
                j = g + jj
                rrow, grow, fr, fg, valid = _row(j, e, start, base, slot, rows_ptr, ring_ptr, stride_row, stride_rs,
                                                 stride_rr, ring_size, RATIO, OVERLAP, D)
                s = tl.where(valid, _load_row(rrow + WIDTH, grow + WIDTH, fr, fg, ch, chm), float("-inf"))
                kv = tl.where(valid, _load_row(rrow, grow, fr, fg, ch, chm), 0.0)
                w = (tl.exp(s.to(tl.float64) - m64) / den).to(tl.float32)
                part += kv * w
            pooled += part
        # 4. RMSNorm (dense._rms_norm_kernel's arithmetic)
        zero = tl.zeros((1,), tl.float32)
        ms = tl.div_rn(tl.sum(tl.sum(pooled * pooled, axis=1), axis=0) + zero, D + zero)
        r = tl.div_rn(zero + 1.0, tl.sqrt_rn(ms + tl.cast(eps, tl.float32)))
        y = tl.load(norm_ptr + ch, mask=chm, other=0.0).to(tl.float32) * (pooled * r)
        # 5. RoPE on the last ROPE_HALF pairs at position e·r (cos_sin: fp32 angle, fp64 cos/sin)
        ev, od = tl.split(y)
        pair = tl.arange(0, HALF)
        k = pair - (HALF - ROPE_HALF)
        is_rope = k >= 0
        ang = (e * RATIO).to(tl.float32) * tl.load(invf_ptr + tl.where(is_rope, k, 0), mask=is_rope, other=0.0)
        c = tl.cos(ang.to(tl.float64)).to(tl.float32)
        sn = tl.sin(ang.to(tl.float64)).to(tl.float32)
        ev2 = tl.where(is_rope, ev * c - od * sn, ev)
        od2 = tl.where(is_rope, od * c + ev * sn, od)
        y = tl.join(ev2, od2)  # [D/2, 2] = channel order again
        # 6. the insert
        if MODE == 0:  # dense pages [P, B, D]
            ptr = pages_ptr + page * stride_page + off * stride_pb + ch * stride_pd
            tl.store(ptr, cast(y, pages_ptr.dtype.element_ty, INTERP), mask=chm)
        elif MODE == 1:  # fp8_ds_mla record, bf16-rounded (the compressor path)
            store_kv_record(pages_ptr + page * stride_page, off, page >= 0, tl.reshape(y, (8, 64)), BLOCK_SIZE,
                            Q_MANT, Q_EXP, FMT_MAX, BIAS, FNUZ, True)
        else:  # indexer key record: 128 codes with one power-of-two scale (no bf16 rounding)
            pbase = pages_ptr + page * stride_page
            eb = scale_byte(tl.max(tl.max(tl.abs(y), axis=1), axis=0), Q_MANT, Q_EXP)
            inv = ue8m0_to_f32(254 - eb)
            codes = encode_e4m3(y * inv, FMT_MAX, BIAS, FNUZ)
            tl.store(pbase + off * D + ch, codes.to(tl.uint8), mask=chm)
            sb = ue8m0_to_f32(eb + tl.zeros((4,), tl.int32)).to(tl.int32, bitcast=True)  # the fp32 scale's bits
            q = tl.arange(0, 4)
            tl.store(pbase + BLOCK_SIZE * D + off * 4 + q, ((sb >> (8 * q)) & 0xFF).to(tl.uint8))


def compressor_pool_insert(pages: torch.Tensor, ring: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                           seq_ids: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor,
                           closing: torch.Tensor | None, norm: torch.Tensor, eps: float, rope, ratio: int,
                           overlap: bool, kind: str, fmt, block_size: int, ape: torch.Tensor | None = None) -> None:
    """``dsv4.ops.torch_compressor.compressor_pool_insert`` in one kernel (same arguments; with ``ape`` the
    state rows are formed from the raw rows in the kernel's ring store)."""
    d = norm.shape[0]
    if d % 64 or d & (d - 1):
        raise ValueError(f"compressor_pool_insert: dim must be a power of two ≥ 64, got {d}")
    if rows.dim() != 2 or rows.shape[1] % 2 or ring.dim() != 3 or ring.shape[2] != rows.shape[1]:
        raise ValueError(f"compressor_pool_insert: rows [T, 2·width] and ring [S, size, 2·width] expected, got "
                         f"{tuple(rows.shape)} and {tuple(ring.shape)}")
    width = rows.shape[1] // 2
    if width != (2 * d if overlap else d):
        raise ValueError(f"compressor_pool_insert: state width {width} does not match dim {d} "
                         f"(overlap={overlap})")
    if ring.dtype != torch.float32 or ring.stride(2) != 1:
        raise ValueError("compressor_pool_insert: the ring must be float32 with unit inner stride")
    decode = closing is None
    if ape is not None:
        if not decode:
            raise ValueError("compressor_pool_insert: ape (raw rows) is taken by the decode form only (closing=None)")
        if tuple(ape.shape) != (ratio, width):
            raise ValueError(f"compressor_pool_insert: ape must be [ratio, width] = {(ratio, width)}, got "
                             f"{tuple(ape.shape)}")
        ape = ape if ape.is_contiguous() else ape.contiguous()
    n = rows.shape[0] if decode else closing.shape[1]
    if n == 0:
        return
    if ape is None:
        rows = rows.float()
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    nr = 2 * ratio if overlap else ratio
    group = min(SUM_GROUP, nr)
    if nr % group:
        raise ValueError(f"compressor_pool_insert: {nr} rows are not a multiple of {group}")
    invf = inv_freq(rope, rows.device).float().contiguous()
    q_mant = q_exp = bias = 0
    fmax, fnuz = 0.0, False
    if pages.dtype == torch.uint8:
        if fmt is None:
            raise ValueError("compressor_pool_insert: uint8 pages need an FP8 format, got fmt=None")
        if pages.dim() != 2 or pages.stride(1) != 1:
            raise ValueError(f"compressor_pool_insert: record pages must be 2-D with unit inner stride, got "
                             f"{tuple(pages.shape)} stride {pages.stride()}")
        if kind == "kv":
            mode, rec, need_d = 1, RECORD_BYTES, KV_DIM
        elif kind == "index":
            mode, rec, need_d = 2, INDEXER_RECORD_BYTES, INDEXER_DIM
            assert INDEXER_VALUE_BYTES == INDEXER_DIM
        else:
            raise ValueError(f"compressor_pool_insert: kind must be 'kv' or 'index', got {kind!r}")
        if d != need_d or pages.shape[1] < block_size * rec:
            raise ValueError(f"compressor_pool_insert: {kind} records need dim {need_d} and pages of ≥ "
                             f"{block_size * rec} bytes, got dim {d} and {pages.shape[1]}")
        q_mant, q_exp, fmax, bias, fnuz = _quant_consts(get_fp8_format(fmt))
        strides = (pages.stride(0), 0, 0)
    else:
        if pages.dim() != 3 or pages.shape[1] != block_size or pages.shape[2] != d:
            raise ValueError(f"compressor_pool_insert: dense pages must be [P, {block_size}, {d}], got "
                             f"{tuple(pages.shape)}")
        mode, strides = 0, pages.stride()
    cl = positions if decode else closing.contiguous()
    store_block = min(triton.next_power_of_2(2 * width), 1024)
    _compressor_kernel[(n,)](
        pages,
        ring,
        rows,
        positions,
        seq_ids,
        slots,
        block_table,
        cl,
        norm,
        invf,
        ape if ape is not None else norm,  # (unread without APE)
        *strides,
        ring.stride(0),
        ring.stride(1),
        rows.stride(0),
        block_table.stride(0),
        cl.stride(0) if not decode else 0,
        block_table.shape[1],
        ring.shape[1],
        block_size,
        float(eps),
        RATIO=ratio,
        OVERLAP=bool(overlap),
        NR=nr,
        D=d,
        HALF=d // 2,
        WIDTH=width,
        ROPE_HALF=invf.shape[0],
        DECODE=decode,
        MODE=mode,
        GROUP=group,
        STORE_BLOCK=store_block,
        Q_MANT=q_mant,
        Q_EXP=q_exp,
        FMT_MAX=fmax,
        BIAS=bias,
        FNUZ=fnuz,
        INTERP=interpreting(),
        APE=ape is not None,
        num_warps=4,
        enable_fp_fusion=False,
    )
