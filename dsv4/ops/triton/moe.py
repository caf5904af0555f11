"""Triton MoE: routing (sqrt-softplus top-k) and grouped MXFP4 / FP8 expert GEMMs.

Routing (``moe_route``), one program per BLOCK_T rows × all experts (``route_config``; BLOCK_T and
num_warps can be overridden for tuning, rows are independent so any choice gives the same result):
  logits → float64 softplus (x > 20 → x, else log1p(exp x), log1p by the exact w = 1 + u trick) →
  sqrt → float32 scores; selection key = score + bias in float32 with NaN → -1e30 and ±inf → ±FLT_MAX
  (``torch.nan_to_num``); TOPK rounds of (row max, lowest column holding it, mask it out) give the
  same order as a stable descending sort. Hash layers read the ids instead. Weights = the scores
  at the ids / (float64 sum + 1e-20) × scale. Rows with valid == False → id -1, weight 0.

Experts (``moe_experts``) over a slot list (slot = t·topk + j):
  * grouping: slots sorted by expert (stably) and each expert's run padded to a multiple of
    BLOCK_M, so every block of BLOCK_M rows belongs to one expert; a block→expert table marks
    unused blocks -1. Slots with id -1 (padding tokens) are never placed. No host sync. Up to
    DECODE_MAX_ROWS tokens one Triton launch does it (``group_slots_triton``: per program a
    histogram over the experts + prefix sum and an O(n·CHUNK) rank of its slots), replacing the
    ~25 small kernels of the torch version (``group_slots``: sort, scatter_add, cumsum,
    searchsorted...), which stays the reference and the path for larger batches.
  * up kernel, program = (block, BLOCK_N columns of I): per K step of 128 the x rows of the block
    (gathered by token, loaded contiguously and split into even/odd k) and the W1 and W3 tiles of
    the block's expert — MXFP4 bytes [BLOCK_N, 64]: low nibble = even k, high nibble = odd k, each
    decoded to E2M1 × 2^(b-127) with the row's 4 scale bytes broadcast over their 32-k groups (or
    FP8 bytes × the 128×128 block scale), rounded to x.dtype — then tl.dot(W_even, x_evenᵀ) +
    tl.dot(W_odd, x_oddᵀ) (at the prefill tiles one tl.dot over both halves joined along K, ``one_dot``)
    into fp32 [BLOCK_N, BLOCK_M] accumulators (swap-AB: the decoded weight
    is the register operand; with ``kperm``, the default, both operands' columns are permuted within
    each 16-byte group into that operand's register order, ``_kperm``). The scale bytes of the next
    K step are loaded during this one (``scale_ahead``), from the groups-major scales ``stack_experts``
    stores. Epilogue h = silu(min(g, limit)) · clamp(u, ±limit) with g, u
    rounded to x.dtype first (as the reference's x.dtype GEMMs), stored in x.dtype. With bf16
    activations on CUDA sm_80+ the MXFP4 decode runs in PTX (``e2m1_bytes_to_bf16_ptx``, same bits,
    about a third of the instructions; config ``ptx_fp4=False`` turns it off), and where every scale
    code of the tensor is ≤ 128 (real checkpoints: scales far below 2) with the E2M1 bias folded into
    the scale (``e2m1_bytes_to_bf16_ptx_folded``: one multiply per value pair instead of two; same bits;
    ``fold_scales=False`` turns it off).
    At the decode tile (``merge_gu``) the gate and up rows form one [2·BLOCK_N, 64] operand per K half, so a
    K step issues two MMA groups instead of four (each group waits for the one before).
  * down kernel, program = (block, BLOCK_N columns of H): h rows × W2 tile, y rounded to x.dtype,
    stored at row ``slot`` of a [T·topk, H] buffer.
  * tail blocks: with ``tail`` (prefill tiles) each kernel runs twice, once over the blocks whose second
    half holds a slot and once, at half the rows, over the others (an expert's last block).
  * direct (decode) mode, T·topk ≤ 48: no grouping; one program per (slot, BLOCK_N columns) does
    the same decode as a CUDA-core GEMV (Σ_k w·x in fp32; no MMA padding of a single row).
  * combine kernel, program = (token, BLOCK_H): Σ_j weight[t, j] · y[t·topk + j] in fp32 in slot
    order, skipping id -1 slots without reading them; rows with no valid slot are exactly 0.
Weights stay packed in memory: tiles are decoded in registers, never materialized.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...model.branches import Deferred, Pending, resolve
from ..invariance import DECODE_MAX_ROWS, batch_invariant
from ._common import (
    cast,
    e2m1_bytes_to_bf16_ptx,
    e2m1_bytes_to_bf16_ptx_folded,
    e2m1_to_f32,
    fp8_to_f32,
    fp8_weight_bytes,
    interpreting,
    native_fp8,
    ptx_fp4,
    scale_kind,
    ue8m0_to_f32,
)
from .fp8_linear import act_quant_consts, act_quant_rows

__all__ = ["moe_route", "moe_experts", "group_slots", "group_slots_triton"]

FLT_MAX = tl.constexpr(3.4028234663852886e38)


# ---------------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------------

@triton.jit
def _sqrt_softplus(lg):
    x = lg.to(tl.float64)
    u = tl.exp(tl.where(x > 20.0, 0.0, x))  # the x > 20 branch returns x: keep exp finite (NaN stays NaN)
    w = 1.0 + u
    d = tl.where(w == 1.0, 1.0, w - 1.0)
    l1p = tl.where(w == 1.0, u, tl.log(w) * (u / d))  # log1p(u), accurate for tiny u
    sp = tl.where(x > 20.0, x, l1p)
    return tl.sqrt(sp).to(tl.float32)  # fp64 sqrt is IEEE (sqrt.rn.f64); only fp32 has an approximate form


@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits_ptr, bias_ptr, hash_ptr, valid_ptr, ids_ptr, w_ptr, T, E,
                  stride_lt, stride_le, stride_ht, stride_hk, scale,
                  TOPK: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HASH: tl.constexpr, HAS_VALID: tl.constexpr, NORM: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    r_mask = rows < T
    ok = r_mask
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + rows, mask=r_mask, other=0) != 0)
    cols = tl.arange(0, BLOCK_E)
    c_mask = cols < E
    lrow = logits_ptr + rows.to(tl.int64)[:, None] * stride_lt
    kcols = tl.arange(0, KP)  # slot axis padded to a power of two; slots >= TOPK stay 0
    k_mask = kcols < TOPK
    if HASH:
        hm = ok[:, None] & k_mask[None, :]
        hid = tl.load(hash_ptr + rows[:, None] * stride_ht + kcols[None, :] * stride_hk, mask=hm, other=0)
        hid = hid.to(tl.int32)
        lg = tl.load(lrow + hid * stride_le, mask=hm & (hid >= 0) & (hid < E), other=0.0)
        sel_ids = hid
        sel_s = tl.where(k_mask[None, :], _sqrt_softplus(lg), 0.0)
    else:
        sel_ids = tl.zeros((BLOCK_T, KP), dtype=tl.int32)
        sel_s = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
        lg = tl.load(lrow + cols[None, :] * stride_le, mask=ok[:, None] & c_mask[None, :], other=0.0)
        s = _sqrt_softplus(lg)
        key = s
        if HAS_BIAS:
            key = key + tl.load(bias_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        key = tl.where(key != key, -1e30, key)  # torch.nan_to_num(nan=-1e30): NaN, then ±inf -> ±max
        key = tl.minimum(tl.maximum(key, -FLT_MAX), FLT_MAX)
        key = tl.where(c_mask[None, :], key, float("-inf"))
        for j in tl.static_range(TOPK):
            mx = tl.max(key, axis=1)
            idx = tl.min(tl.where(key == mx[:, None], cols[None, :], BLOCK_E), axis=1)
            hit = cols[None, :] == idx[:, None]
            sj = tl.sum(tl.where(hit, s, 0.0), axis=1)
            key = tl.where(hit, float("-inf"), key)
            sel_ids = tl.where(kcols[None, :] == j, idx[:, None], sel_ids)
            sel_s = tl.where(kcols[None, :] == j, sj[:, None], sel_s)
    if NORM:
        tot = tl.sum(sel_s.to(tl.float64), axis=1) + 1e-20
        w = (sel_s.to(tl.float64) / tot[:, None]).to(tl.float32)
    else:
        w = sel_s
    w = w * scale
    w = tl.where(ok[:, None], w, 0.0)
    sel_ids = tl.where(ok[:, None], sel_ids, -1)
    out = rows[:, None] * TOPK + kcols[None, :]
    om = r_mask[:, None] & k_mask[None, :]
    tl.store(ids_ptr + out, sel_ids, mask=om)
    tl.store(w_ptr + out, w, mask=om)


def moe_route(gate_logits: torch.Tensor, bias: torch.Tensor | None, topk: int, scale: float = 1.0,
              norm: bool = True, hash_ids: torch.Tensor | None = None,
              valid: torch.Tensor | None = None, *,
              config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``dsv4.ops.torch_ops.moe_route`` (hash ids must lie in [0, E): clamp
    token ids before the ``tid2eid`` lookup, as the reference does).

    ``config``: launch overrides of ``route_config``'s ``BLOCK_T`` (rows per program, a power of
    two) and ``num_warps``, for tuning (bench/kernels.py --sweep --only route). Rows are
    independent, so the results are the same for any config."""
    logits = gate_logits if gate_logits.dtype == torch.float32 else gate_logits.float()
    t, e = logits.shape
    if not 1 <= topk <= e:
        raise ValueError(f"topk must be in [1, {e}], got {topk}")
    dev = logits.device
    ids = torch.empty((t, topk), dtype=torch.int32, device=dev)
    w = torch.empty((t, topk), dtype=torch.float32, device=dev)
    if t == 0:
        return ids, w
    block_e = triton.next_power_of_2(e)
    cfg = route_config(e, config, t)
    block_t = cfg["BLOCK_T"]
    hs = (0, 0)
    if hash_ids is not None:
        if tuple(hash_ids.shape) != (t, topk):
            raise ValueError(f"hash_ids shape {tuple(hash_ids.shape)} != {(t, topk)}")
        hs = hash_ids.stride()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    vt = valid.reshape(t).to(torch.int8).contiguous() if valid is not None else None
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, bias if bias is not None else logits, hash_ids if hash_ids is not None else logits,
        vt if vt is not None else logits, ids, w, t, e, logits.stride(0), logits.stride(1), hs[0], hs[1],
        float(scale), TOPK=topk, KP=triton.next_power_of_2(topk), BLOCK_T=block_t, BLOCK_E=block_e,
        HAS_BIAS=bias is not None, HASH=hash_ids is not None, HAS_VALID=valid is not None, NORM=bool(norm),
        num_warps=cfg["num_warps"])
    return ids, w


def route_config(n_experts: int, config: dict | None = None, t: int | None = None) -> dict:
    """The routing kernel's launch shape: BLOCK_T rows × all experts per program; ``config`` entries
    override. Rows are independent, so any shape gives the same bits (tested). Default from the
    H200 sweep (``bench/kernels.py --sweep --only route``, E=256, top-6, CUDA-graph µs): one row per
    program — 4 warps up to 64 rows (6.1 µs at T = 1..64; the former 16 rows × 4 warps took ~42 µs:
    each thread ran 32 fp64 softplus in series), 1 warp above (30.5 µs at T = 8192, 46.0 with 4)."""
    cfg = dict(BLOCK_T=1, num_warps=4 if t is None or t <= 64 else 1)
    if interpreting():  # the interpreter pays per program: 16 rows a program (same bits, as any shape)
        cfg["BLOCK_T"] = max(1, min(16, 4096 // triton.next_power_of_2(n_experts)))
    if config:
        unknown = set(config) - set(cfg)
        if unknown:
            raise ValueError(f"unknown moe_route config keys {sorted(unknown)}")
        cfg.update(config)
    for k in ("BLOCK_T", "num_warps"):
        v = cfg[k]
        if not (isinstance(v, int) and v >= 1 and v & (v - 1) == 0):
            raise ValueError(f"moe_route {k} must be a power of two >= 1, got {v!r}")
    return cfg


# ---------------------------------------------------------------------------------------------
# grouping
# ---------------------------------------------------------------------------------------------

def group_slots(ids: torch.Tensor, n_experts: int, block_m: int):
    """Sort the T·topk slots by expert, each expert's run padded to a multiple of block_m.

    Returns (slot_ids int32 [max_blocks·block_m] with -1 in padding rows, block_expert int32
    [max_blocks] with -1 for unused blocks). Slots whose id is -1 are left out. Pure torch, no
    host synchronisation (max_blocks is a bound: ceil(n/block_m) + min(E, n)).
    """
    dev = ids.device
    n = ids.numel()
    flat = ids.reshape(-1).to(torch.int64)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, n_experts))
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:n_experts]
    blocks = (counts + block_m - 1) // block_m
    bends = torch.cumsum(blocks, 0)
    bstart = bends - blocks
    cstart = torch.cumsum(counts, 0) - counts
    max_blocks = triton.cdiv(n, block_m) + min(n_experts, n)
    kc = sorted_key.clamp(max=n_experts - 1)
    pos = bstart[kc] * block_m + (torch.arange(n, device=dev) - cstart[kc])
    pos = torch.where(sorted_key < n_experts, pos, torch.full_like(pos, max_blocks * block_m))
    slot_ids = torch.full((max_blocks * block_m + 1,), -1, dtype=torch.int32, device=dev)
    slot_ids[pos] = order.to(torch.int32)
    b = torch.arange(max_blocks, device=dev)
    bexp = torch.searchsorted(bends, b, right=True)
    bexp = torch.where(b < bends[-1], bexp, torch.full_like(bexp, -1)).to(torch.int32)
    return slot_ids[:-1], bexp


@triton.jit(do_not_specialize=["N", "MAX_BLOCKS"])
def _group_slots_kernel(ids_ptr, slot_ptr, bexp_ptr, N, E, MAX_BLOCKS,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Program p places slots p·CHUNK.. and fills blocks p·CHUNK.. of ``group_slots``' layout.

    Every program recounts the per-expert histogram (O(n·E), cheap at decode sizes) so that one
    launch suffices: block ends = cumsum(cdiv(count, BLOCK_M)); slot i goes to row
    bstart[e_i]·BLOCK_M + #{j < i : e_j = e_i} (the stable sort's order); block b's expert is
    #{e : bend[e] ≤ b} (searchsorted), -1 past the last used block; the rows of a block past its
    expert's slots get -1. Slot rows and padding rows are disjoint: no ordering between programs.
    """
    pid = tl.program_id(0)
    c = tl.arange(0, CHUNK)
    ex = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for j0 in range(0, N, CHUNK):
        ej = tl.load(ids_ptr + j0 + c, mask=j0 + c < N, other=-1)
        counts += tl.sum((ej[:, None] == ex[None, :]).to(tl.int32), axis=0)  # -1 matches no expert
    counts = tl.where(ex < E, counts, 0)  # ids >= E (invalid) are neither counted nor placed
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    bends = tl.cumsum(blocks, axis=0)
    bstart = bends - blocks
    total = tl.sum(blocks, axis=0)
    # this program's slots
    i = pid * CHUNK + c
    ei = tl.load(ids_ptr + i, mask=i < N, other=-1)
    ei = tl.where(ei < E, ei, -1)
    rank = tl.zeros((CHUNK,), dtype=tl.int32)
    for j0 in range(0, tl.minimum(N, pid * CHUNK + CHUNK), CHUNK):  # only j < i count
        j = j0 + c
        ej = tl.load(ids_ptr + j, mask=j < N, other=-1)
        same = (ej[None, :] == ei[:, None]) & (j[None, :] < i[:, None])
        rank += tl.sum(same.to(tl.int32), axis=1)
    bs_i = tl.sum(tl.where(ei[:, None] == ex[None, :], bstart[None, :], 0), axis=1)
    tl.store(slot_ptr + bs_i * BLOCK_M + rank, i, mask=ei >= 0)
    # this program's blocks
    b = pid * CHUNK + c
    b_ok = b < MAX_BLOCKS
    used = b < total
    be = tl.sum((bends[None, :] <= b[:, None]).to(tl.int32), axis=1)
    tl.store(bexp_ptr + b, tl.where(used, be, -1), mask=b_ok)
    hb = be[:, None] == ex[None, :]
    cnt_b = tl.sum(tl.where(hb, counts[None, :], 0), axis=1)
    bs_b = tl.sum(tl.where(hb, bstart[None, :], 0), axis=1)
    filled = tl.where(used, cnt_b - (b - bs_b) * BLOCK_M, 0)  # rows of block b holding slots (may be > BLOCK_M)
    r = tl.arange(0, BLOCK_M)
    tl.store(slot_ptr + b[:, None] * BLOCK_M + r[None, :], tl.full((CHUNK, BLOCK_M), -1, tl.int32),
             mask=b_ok[:, None] & (r[None, :] >= filled[:, None]))


GROUP_KERNEL_MAX_ROWS = 512  # tokens per call up to which moe_experts groups in Triton (faster on the H200
# up to 512 tokens: 58 vs 93 µs at T = 512, E = 256, top-6; 334 vs 136 µs at 2048; bench/kernels.py --only group)
GROUP_KERNEL_MAX_EXPERTS = 1024  # the histogram tile is [CHUNK, next_pow2(E)]


def group_slots_triton(ids: torch.Tensor, n_experts: int, block_m: int, chunk: int = 32):
    """``group_slots`` in one Triton launch (identical tensors). The torch version issues ~25 small
    kernels (sort, scatter_add, cumsum, searchsorted, index_put...), which dominate a decode step's
    grouping time inside a CUDA graph; here ``cdiv(max(n, max_blocks), chunk)`` programs each redo
    the O(n·E) histogram and an O(n·chunk) rank, which is cheap for decode-sized n."""
    n = ids.numel()
    max_blocks = triton.cdiv(n, block_m) + min(n_experts, n)
    slot_ids = torch.empty((max_blocks * block_m,), dtype=torch.int32, device=ids.device)
    bexp = torch.empty((max_blocks,), dtype=torch.int32, device=ids.device)
    if n == 0:
        return slot_ids, bexp
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    _group_slots_kernel[(triton.cdiv(max(n, max_blocks), chunk),)](
        flat, slot_ids, bexp, n, n_experts, max_blocks, BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(n_experts), CHUNK=chunk, num_warps=4)
    return slot_ids, bexp


# ---------------------------------------------------------------------------------------------
# expert kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _block_rows(slot_ptr, bexp_ptr, b, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, PART: tl.constexpr):
    """(expert, slot per row, row valid, h-buffer row) of the program's BLOCK_M rows of grouped block b
    (ROWS rows in the slot table). PART 0: the whole block (BLOCK_M = ROWS). The split form runs each
    block in one of two launches (``tail``): PART 1, the whole block, only if its second half holds a
    slot; PART 2, its first half (BLOCK_M = ROWS / 2), only if the second half holds none. A block's
    slots fill its rows from the first, so row ROWS / 2 tells the two apart; expert -1: nothing to do."""
    r = tl.arange(0, BLOCK_M)
    e = tl.load(bexp_ptr + b)
    if PART == 1:
        e = tl.where(tl.load(slot_ptr + b * ROWS + ROWS // 2) >= 0, e, -1)
    if PART == 2:
        e = tl.where(tl.load(slot_ptr + b * ROWS + BLOCK_M) < 0, e, -1)
    slot = tl.load(slot_ptr + b * ROWS + r)
    ok = slot >= 0
    hrow = b * ROWS + r
    return e, slot, ok, hrow


@triton.jit
def _fp4_scale_bytes(s_base, rows, r_mask, k0, KH, stride_sn, stride_sk, BLOCK_K: tl.constexpr):
    """The BLOCK_K/32 UE8M0 scale bytes [R, BLOCK_K/32] of the MXFP4 rows ``rows`` at K step k0
    (127, i.e. 1.0, past the end: a look-ahead load one step past the last one is harmless)."""
    gi = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    return tl.load(s_base + rows[:, None] * stride_sn + gi[None, :] * stride_sk,
                   mask=r_mask[:, None] & (gi < KH // 32)[None, :], other=127)


@triton.jit
def _kperm(v, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns of a [R, BLOCK_K/2] tile (one per MXFP4 byte of a K step) in the wgmma register
    operand's order: within each 16-byte group, memory bytes 4c..4c+3 become columns 2c, 2c+1,
    2c+8, 2c+9 — the four a thread holds per k16 chunk — so one 32-bit load feeds one decode call.
    Applied to the weights and to the activations alike: the same products, summed in another order."""
    v = tl.reshape(v, (R, BLOCK_K // 32, 4, 2, 2))
    return tl.reshape(tl.permute(v, (0, 1, 3, 2, 4)), (R, BLOCK_K // 2))


@triton.jit
def _w_tile_fp4(w_base, sb, rows, r_mask, k0, KH, stride_wn, stride_wk,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr,
                PTX: tl.constexpr = False, EVEN_K: tl.constexpr = False, KPERM: tl.constexpr = False,
                FOLD: tl.constexpr = False):
    """(even-k, odd-k) tiles [BLOCK_N, BLOCK_K/2] in DTYPE of the MXFP4 rows ``rows``, K range
    k0..k0+BLOCK_K: byte j holds k0+2j (low nibble) and k0+2j+1 (high nibble), both in scale
    group (k0 + 2j) // 32; ``sb``, the rows' BLOCK_K/32 scale bytes (``_fp4_scale_bytes``), is
    broadcast over the groups.
    PTX (bf16, CUDA sm_80+): the same bits from ``e2m1_bytes_to_bf16_ptx`` (the decode is the
    grouped kernels' bottleneck at decode batch sizes: ~11 integer/convert ops per nibble).
    EVEN_K (K a multiple of BLOCK_K): no K mask (a few instructions per step; the weight loads' width
    is set by the decode's register layout, see ``_kperm``, not by this mask).
    FOLD (with PTX; every scale code of the tensor ≤ 128, checked on the host by ``_fold_ok``): the
    E2M1 bias folded into the scale, 2^(b-1) as bf16 in one integer op per scale byte, and one
    multiply per value pair (``e2m1_bytes_to_bf16_ptx_folded``): the same bits with about a third
    fewer decode instructions (SASS, sm_90a, decode-tile up kernel: 612 → 460 per K step)."""
    j = tl.arange(0, BLOCK_K // 2)
    kb = k0 // 2 + j
    if EVEN_K:
        m = r_mask[:, None]
    else:
        m = r_mask[:, None] & (kb < KH // 2)[None, :]
    byte = tl.load(w_base + rows[:, None] * stride_wn + kb[None, :] * stride_wk, mask=m, other=0)
    if KPERM:
        byte = _kperm(byte, BLOCK_N, BLOCK_K)
    if PTX and FOLD:
        sc = ((sb.to(tl.int32) + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 2^(b-1), b ≤ 128
    else:
        sc = ue8m0_to_f32(sb)
        if PTX:
            sc = sc.to(tl.bfloat16)  # exact: powers of two 2^-127..2^127 and NaN
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
    if PTX and FOLD:
        lo, hi = e2m1_bytes_to_bf16_ptx_folded(byte.to(tl.uint8), sc)
    elif PTX:
        lo, hi = e2m1_bytes_to_bf16_ptx(byte.to(tl.uint8), sc)
    else:
        byte = byte.to(tl.int32)
        lo = cast(e2m1_to_f32(byte & 15) * sc, DTYPE, INTERP)
        hi = cast(e2m1_to_f32((byte >> 4) & 15) * sc, DTYPE, INTERP)
    return lo, hi


@triton.jit
def _w_tile_fp8(w_base, s_base, rows, srow0, r_mask, k0, KH, stride_wn, stride_wk, stride_sn, stride_sk,
                BLOCK_K: tl.constexpr, SCALE_UE8M0: tl.constexpr, NATIVE: tl.constexpr, FNUZ: tl.constexpr,
                DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """Tile [R, BLOCK_K] in DTYPE of FP8 rows ``rows`` (scale row srow0 + row // 128, column k0 // 128)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    m = r_mask[:, None] & (kk < KH)[None, :]
    byte = tl.load(w_base + rows[:, None] * stride_wn + kk[None, :] * stride_wk, mask=m, other=0)
    sb = tl.load(s_base + (srow0 + rows // 128) * stride_sn + (k0 // 128) * stride_sk, mask=r_mask, other=0)
    if SCALE_UE8M0:
        sc = ue8m0_to_f32(sb)
    else:
        sc = sb.to(tl.float32)
    return cast(fp8_to_f32(byte, NATIVE, FNUZ) * sc[:, None], DTYPE, INTERP)


@triton.jit
def _load_rows(row_ptrs, ok, k0, KH, stride_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
               EVEN_K: tl.constexpr = False, KPERM: tl.constexpr = False):
    """Activation rows [BLOCK_M, BLOCK_K] at k0 (contiguous load); SPLIT: de-interleaved (even, odd);
    EVEN_K: K a multiple of BLOCK_K, no K mask."""
    kk = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        m = ok[:, None]
    else:
        m = ok[:, None] & (kk < KH)[None, :]
    v = tl.load(row_ptrs + kk[None, :] * stride_k, mask=m, other=0.0)
    if SPLIT:
        ve, vo = tl.split(tl.reshape(v, (BLOCK_M, BLOCK_K // 2, 2)))
        if KPERM:
            ve = _kperm(ve, BLOCK_M, BLOCK_K)
            vo = _kperm(vo, BLOCK_M, BLOCK_K)
        return ve, vo
    else:
        return v, v


@triton.jit
def _dot(w, x, acc, DOT_F32: tl.constexpr):
    """acc + w [N, K] · xᵀ ([M, K]) -> [N, M], accumulated in fp32 inside the MMA ("swap-AB": the
    decoded weight is the register-resident left operand, the few token rows only set the MMA's N
    width). Accumulating into ``acc`` (not ``acc += dot(..)``) keeps one accumulator live per
    output instead of two: the sum-then-add form held a second [N, M] fp32 temporary and spilled
    at the prefill tiles (ptxas, sm_90a: 255 registers + 336 B of spills at 128 × 128, 8 warps)."""
    if DOT_F32:
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _dot_halves(lo, hi, xe, xo, acc, DOT_F32: tl.constexpr, ONE_DOT: tl.constexpr):
    """acc + lo·xeᵀ + hi·xoᵀ (the even-k and odd-k halves of a K step), the lo products first. ONE_DOT: as one
    MMA over the K step ([lo | hi] · [xe | xo]ᵀ): the same k16 MMAs in the same order, so the same bits, and one
    wait for the MMAs a K step instead of two (Triton drains the first dot before the second starts)."""
    if ONE_DOT:
        w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (lo.shape[0], 2 * lo.shape[1]))
        x = tl.reshape(tl.permute(tl.join(xe, xo), (0, 2, 1)), (xe.shape[0], 2 * xe.shape[1]))
        return _dot(w, x, acc, DOT_F32)
    return _dot(hi, xo, _dot(lo, xe, acc, DOT_F32), DOT_F32)


@triton.jit
def _moe_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, slot_ptr, bexp_ptr,
                   H, I, TOPK, S3_ROW, limit,
                   stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                   stride_hp, stride_hi,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr,
                   SCALE_UE8M0: tl.constexpr, NATIVE: tl.constexpr, FNUZ: tl.constexpr,
                   DOT_F32: tl.constexpr, INTERP: tl.constexpr, PTX_FP4: tl.constexpr,
                   SCALE_AHEAD: tl.constexpr = False, EVEN_K: tl.constexpr = False,
                   KPERM: tl.constexpr = False, FOLD: tl.constexpr = False,
                   ROWS: tl.constexpr = None, PART: tl.constexpr = None, MERGE_GU: tl.constexpr = False,
                   ONE_DOT: tl.constexpr = False):
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, slot, ok, hrow = _block_rows(slot_ptr, bexp_ptr, b, BLOCK_M, ROWS, PART)
    if e >= 0:
        x_dtype = x_ptr.dtype.element_ty
        tok = tl.where(ok, slot // TOPK, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = s_ptr + e.to(tl.int64) * stride_se
        x_rows = x_ptr + tok[:, None] * stride_xt
        if MERGE_GU:  # FP4 only: the gate and up rows as one 2·BLOCK_N-row tile (see ``_merged_up``)
            g_acc, u_acc = _merged_up(x_rows, ok, w_base, s_base, pid_n, H, I, stride_xh, stride_wn, stride_wk,
                                      stride_sn, stride_sk, BLOCK_M, BLOCK_N, BLOCK_K, x_dtype, INTERP, PTX_FP4,
                                      EVEN_K, KPERM, FOLD, DOT_F32, ONE_DOT)
            _swiglu_store(g_acc, u_acc, limit, h_ptr, hrow, ok, offs_n, n_mask, stride_hp, stride_hi, x_dtype,
                          INTERP)
            return
        acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # gate, [n, m]
        acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # up
        sb1 = _fp4_scale_bytes(s_base, offs_n, n_mask, 0, H, stride_sn, stride_sk, BLOCK_K)
        sb3 = _fp4_scale_bytes(s_base, I + offs_n, n_mask, 0, H, stride_sn, stride_sk, BLOCK_K)
        for k0 in range(0, H, BLOCK_K):
            xe, xo = _load_rows(x_rows, ok, k0, H, stride_xh, BLOCK_M, BLOCK_K, FP4, EVEN_K, KPERM)
            if FP4:
                if SCALE_AHEAD:  # next step's scale bytes now: the byte loads' latency overlaps this step
                    nb1 = _fp4_scale_bytes(s_base, offs_n, n_mask, k0 + BLOCK_K, H, stride_sn, stride_sk, BLOCK_K)
                    nb3 = _fp4_scale_bytes(s_base, I + offs_n, n_mask, k0 + BLOCK_K, H, stride_sn, stride_sk,
                                           BLOCK_K)
                else:
                    sb1 = _fp4_scale_bytes(s_base, offs_n, n_mask, k0, H, stride_sn, stride_sk, BLOCK_K)
                    sb3 = _fp4_scale_bytes(s_base, I + offs_n, n_mask, k0, H, stride_sn, stride_sk, BLOCK_K)
                lo1, hi1 = _w_tile_fp4(w_base, sb1, offs_n, n_mask, k0, H, stride_wn, stride_wk,
                                       BLOCK_N, BLOCK_K, x_dtype, INTERP, PTX_FP4, EVEN_K, KPERM, FOLD)
                acc1 = _dot_halves(lo1, hi1, xe, xo, acc1, DOT_F32, ONE_DOT)
                lo3, hi3 = _w_tile_fp4(w_base, sb3, I + offs_n, n_mask, k0, H, stride_wn, stride_wk,
                                       BLOCK_N, BLOCK_K, x_dtype, INTERP, PTX_FP4, EVEN_K, KPERM, FOLD)
                acc3 = _dot_halves(lo3, hi3, xe, xo, acc3, DOT_F32, ONE_DOT)
                if SCALE_AHEAD:
                    sb1 = nb1
                    sb3 = nb3
            else:
                w1 = _w_tile_fp8(w_base, s_base, offs_n, 0, n_mask, k0, H, stride_wn, stride_wk, stride_sn,
                                 stride_sk, BLOCK_K, SCALE_UE8M0, NATIVE, FNUZ, x_dtype, INTERP)
                acc1 = _dot(w1, xe, acc1, DOT_F32)
                w3 = _w_tile_fp8(w_base + I * stride_wn, s_base, offs_n, S3_ROW, n_mask, k0, H, stride_wn,
                                 stride_wk, stride_sn, stride_sk, BLOCK_K, SCALE_UE8M0, NATIVE, FNUZ, x_dtype, INTERP)
                acc3 = _dot(w3, xe, acc3, DOT_F32)
        _swiglu_store(acc1, acc3, limit, h_ptr, hrow, ok, offs_n, n_mask, stride_hp, stride_hi, x_dtype, INTERP)


@triton.jit
def _swiglu_store(acc1, acc3, limit, h_ptr, hrow, ok, offs_n, n_mask, stride_hp, stride_hi, x_dtype: tl.constexpr,
                  INTERP: tl.constexpr):
    """h = silu(min(g, limit)) · clamp(u, ±limit) of the fp32 gate / up tiles [BLOCK_N, BLOCK_M], g and u
    rounded to x's dtype first (as the reference's x.dtype GEMMs), stored at the block's h rows."""
    g = tl.minimum(cast(acc1, x_dtype, INTERP).to(tl.float32), limit)
    u = cast(acc3, x_dtype, INTERP).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    hv = g / (1.0 + tl.exp(-g)) * u
    hp = h_ptr + hrow.to(tl.int64)[None, :] * stride_hp + offs_n[:, None] * stride_hi
    tl.store(hp, cast(hv, h_ptr.dtype.element_ty, INTERP), mask=n_mask[:, None] & ok[None, :])


@triton.jit
def _merged_up(x_rows, ok, w_base, s_base, pid_n, H, I, stride_xh, stride_wn, stride_wk, stride_sn, stride_sk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, x_dtype: tl.constexpr,
               INTERP: tl.constexpr, PTX_FP4: tl.constexpr, EVEN_K: tl.constexpr, KPERM: tl.constexpr,
               FOLD: tl.constexpr, DOT_F32: tl.constexpr, ONE_DOT: tl.constexpr = False):
    """The MXFP4 up kernel's K loop with the gate rows (n) and the up rows (I + n) in one [2·BLOCK_N, K]
    weight tile: two MMAs a K step (even k, odd k) over both, instead of four. A row's products and their
    order are those of the separate tiles (the MMA's row blocks are independent), so are its bits; the
    fewer, larger MMAs wait for each other half as often (each wgmma group waits for the previous one
    before its register operand is rewritten). Returns the (gate, up) fp32 tiles [BLOCK_N, BLOCK_M]."""
    r2 = tl.arange(0, 2 * BLOCK_N)
    half = r2 // BLOCK_N  # 0: gate row, 1: up row
    n_of = pid_n * BLOCK_N + r2 % BLOCK_N
    rows = n_of + half * I
    r_mask = n_of < I
    acc = tl.zeros((2 * BLOCK_N, BLOCK_M), dtype=tl.float32)
    sb = _fp4_scale_bytes(s_base, rows, r_mask, 0, H, stride_sn, stride_sk, BLOCK_K)
    for k0 in range(0, H, BLOCK_K):
        xe, xo = _load_rows(x_rows, ok, k0, H, stride_xh, BLOCK_M, BLOCK_K, True, EVEN_K, KPERM)
        nb = _fp4_scale_bytes(s_base, rows, r_mask, k0 + BLOCK_K, H, stride_sn, stride_sk, BLOCK_K)
        lo, hi = _w_tile_fp4(w_base, sb, rows, r_mask, k0, H, stride_wn, stride_wk,
                             2 * BLOCK_N, BLOCK_K, x_dtype, INTERP, PTX_FP4, EVEN_K, KPERM, FOLD)
        acc = _dot_halves(lo, hi, xe, xo, acc, DOT_F32, ONE_DOT)
        sb = nb
    g_acc, u_acc = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    return g_acc, u_acc


@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, s_ptr, y_ptr, slot_ptr, bexp_ptr, H, I,
                     stride_hp, stride_hi, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                     stride_ys, stride_yh,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr,
                     SCALE_UE8M0: tl.constexpr, NATIVE: tl.constexpr, FNUZ: tl.constexpr,
                     DOT_F32: tl.constexpr, INTERP: tl.constexpr, PTX_FP4: tl.constexpr,
                     SCALE_AHEAD: tl.constexpr = False, EVEN_K: tl.constexpr = False,
                     KPERM: tl.constexpr = False, FOLD: tl.constexpr = False,
                     ROWS: tl.constexpr = None, PART: tl.constexpr = None, ONE_DOT: tl.constexpr = False):
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, slot, ok, hrow = _block_rows(slot_ptr, bexp_ptr, b, BLOCK_M, ROWS, PART)
    if e >= 0:
        h_dtype = h_ptr.dtype.element_ty
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = s_ptr + e.to(tl.int64) * stride_se
        h_rows = h_ptr + tl.where(ok, hrow, 0).to(tl.int64)[:, None] * stride_hp
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        sb = _fp4_scale_bytes(s_base, offs_n, n_mask, 0, I, stride_sn, stride_sk, BLOCK_K)
        for k0 in range(0, I, BLOCK_K):
            he, ho = _load_rows(h_rows, ok, k0, I, stride_hi, BLOCK_M, BLOCK_K, FP4, EVEN_K, KPERM)
            if FP4:
                if SCALE_AHEAD:
                    nb = _fp4_scale_bytes(s_base, offs_n, n_mask, k0 + BLOCK_K, I, stride_sn, stride_sk, BLOCK_K)
                else:
                    sb = _fp4_scale_bytes(s_base, offs_n, n_mask, k0, I, stride_sn, stride_sk, BLOCK_K)
                lo, hi = _w_tile_fp4(w_base, sb, offs_n, n_mask, k0, I, stride_wn, stride_wk,
                                     BLOCK_N, BLOCK_K, h_dtype, INTERP, PTX_FP4, EVEN_K, KPERM, FOLD)
                acc = _dot_halves(lo, hi, he, ho, acc, DOT_F32, ONE_DOT)
                if SCALE_AHEAD:
                    sb = nb
            else:
                w = _w_tile_fp8(w_base, s_base, offs_n, 0, n_mask, k0, I, stride_wn, stride_wk, stride_sn,
                                stride_sk, BLOCK_K, SCALE_UE8M0, NATIVE, FNUZ, h_dtype, INTERP)
                acc = _dot(w, he, acc, DOT_F32)
        yp = y_ptr + tl.where(ok, slot, 0).to(tl.int64)[None, :] * stride_ys + offs_n[:, None] * stride_yh
        tl.store(yp, cast(acc, y_ptr.dtype.element_ty, INTERP), mask=n_mask[:, None] & ok[None, :])


@triton.jit
def _gemv_rows(w, x, INTERP: tl.constexpr):
    """Σ_k w[n, k] · x[k] in fp32 ([N]); w already rounded to the activation dtype."""
    return tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)


@triton.jit
def _moe_up_gemv_kernel(x_ptr, w_ptr, s_ptr, h_ptr, ids_ptr, H, I, TOPK, S3_ROW, limit,
                        stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                        stride_hp, stride_hi,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr,
                        SCALE_UE8M0: tl.constexpr, NATIVE: tl.constexpr, FNUZ: tl.constexpr, INTERP: tl.constexpr,
                        PTX_FP4: tl.constexpr, EVEN_K: tl.constexpr = False, FOLD: tl.constexpr = False):
    """Direct (decode) mode: one program = one slot × BLOCK_N columns of I, CUDA-core GEMV."""
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + slot)
    if e >= 0:
        x_dtype = x_ptr.dtype.element_ty
        x_row = x_ptr + (slot // TOPK).to(tl.int64) * stride_xt
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = s_ptr + e.to(tl.int64) * stride_se
        acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if FP4:
                ke = k0 + 2 * tl.arange(0, BLOCK_K // 2)
                xe = tl.load(x_row + ke * stride_xh, mask=ke < H, other=0.0)
                xo = tl.load(x_row + (ke + 1) * stride_xh, mask=ke < H, other=0.0)
                sb1 = _fp4_scale_bytes(s_base, offs_n, n_mask, k0, H, stride_sn, stride_sk, BLOCK_K)
                lo1, hi1 = _w_tile_fp4(w_base, sb1, offs_n, n_mask, k0, H, stride_wn, stride_wk,
                                       BLOCK_N, BLOCK_K, x_dtype, INTERP, PTX_FP4, EVEN_K, False, FOLD)
                acc1 += _gemv_rows(lo1, xe, INTERP) + _gemv_rows(hi1, xo, INTERP)
                sb3 = _fp4_scale_bytes(s_base, I + offs_n, n_mask, k0, H, stride_sn, stride_sk, BLOCK_K)
                lo3, hi3 = _w_tile_fp4(w_base, sb3, I + offs_n, n_mask, k0, H, stride_wn, stride_wk,
                                       BLOCK_N, BLOCK_K, x_dtype, INTERP, PTX_FP4, EVEN_K, False, FOLD)
                acc3 += _gemv_rows(lo3, xe, INTERP) + _gemv_rows(hi3, xo, INTERP)
            else:
                kk = k0 + tl.arange(0, BLOCK_K)
                xv = tl.load(x_row + kk * stride_xh, mask=kk < H, other=0.0)
                w1 = _w_tile_fp8(w_base, s_base, offs_n, 0, n_mask, k0, H, stride_wn, stride_wk, stride_sn,
                                 stride_sk, BLOCK_K, SCALE_UE8M0, NATIVE, FNUZ, x_dtype, INTERP)
                acc1 += _gemv_rows(w1, xv, INTERP)
                w3 = _w_tile_fp8(w_base + I * stride_wn, s_base, offs_n, S3_ROW, n_mask, k0, H, stride_wn,
                                 stride_wk, stride_sn, stride_sk, BLOCK_K, SCALE_UE8M0, NATIVE, FNUZ, x_dtype, INTERP)
                acc3 += _gemv_rows(w3, xv, INTERP)
        g = tl.minimum(cast(acc1, x_dtype, INTERP).to(tl.float32), limit)
        u = cast(acc3, x_dtype, INTERP).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        hv = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + slot.to(tl.int64) * stride_hp + offs_n * stride_hi, cast(hv, h_ptr.dtype.element_ty, INTERP),
                 mask=n_mask)


@triton.jit
def _moe_down_gemv_kernel(h_ptr, w_ptr, s_ptr, y_ptr, ids_ptr, H, I,
                          stride_hp, stride_hi, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                          stride_ys, stride_yh,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr,
                          SCALE_UE8M0: tl.constexpr, NATIVE: tl.constexpr, FNUZ: tl.constexpr, INTERP: tl.constexpr,
                          PTX_FP4: tl.constexpr, EVEN_K: tl.constexpr = False, FOLD: tl.constexpr = False):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + slot)
    if e >= 0:
        h_dtype = h_ptr.dtype.element_ty
        h_row = h_ptr + slot.to(tl.int64) * stride_hp
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = s_ptr + e.to(tl.int64) * stride_se
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            if FP4:
                ke = k0 + 2 * tl.arange(0, BLOCK_K // 2)
                he = tl.load(h_row + ke * stride_hi, mask=ke < I, other=0.0)
                ho = tl.load(h_row + (ke + 1) * stride_hi, mask=ke < I, other=0.0)
                sb = _fp4_scale_bytes(s_base, offs_n, n_mask, k0, I, stride_sn, stride_sk, BLOCK_K)
                lo, hi = _w_tile_fp4(w_base, sb, offs_n, n_mask, k0, I, stride_wn, stride_wk,
                                     BLOCK_N, BLOCK_K, h_dtype, INTERP, PTX_FP4, EVEN_K, False, FOLD)
                acc += _gemv_rows(lo, he, INTERP) + _gemv_rows(hi, ho, INTERP)
            else:
                kk = k0 + tl.arange(0, BLOCK_K)
                hv = tl.load(h_row + kk * stride_hi, mask=kk < I, other=0.0)
                w = _w_tile_fp8(w_base, s_base, offs_n, 0, n_mask, k0, I, stride_wn, stride_wk, stride_sn,
                                stride_sk, BLOCK_K, SCALE_UE8M0, NATIVE, FNUZ, h_dtype, INTERP)
                acc += _gemv_rows(w, hv, INTERP)
        tl.store(y_ptr + slot.to(tl.int64) * stride_ys + offs_n * stride_yh, cast(acc, y_ptr.dtype.element_ty, INTERP),
                 mask=n_mask)


@triton.jit
def _moe_combine_kernel(y_ptr, ids_ptr, w_ptr, out_ptr, add_ptr, H, stride_ys, stride_yh, stride_ot, stride_oh,
                        stride_at, stride_ah, TOPK: tl.constexpr, BLOCK_H: tl.constexpr, ADD: tl.constexpr,
                        INTERP: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        sl = t * TOPK + j
        eid = tl.load(ids_ptr + sl)
        wt = tl.load(w_ptr + sl)
        use = m & ((offs * 0 + eid) >= 0)
        yv = tl.load(y_ptr + sl.to(tl.int64) * stride_ys + offs * stride_yh, mask=use, other=0.0)
        acc += tl.where(use, yv.to(tl.float32) * wt, 0.0)
    dt = out_ptr.dtype.element_ty
    res = cast(acc, dt, INTERP)
    if ADD:  # + add, as a torch add in the output dtype: the rounded sum plus add in fp32, rounded again
        a = tl.load(add_ptr + t.to(tl.int64) * stride_at + offs * stride_ah, mask=m, other=0.0)
        res = cast(res.to(tl.float32) + a.to(tl.float32), dt, INTERP)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs * stride_oh, res, mask=m)


DIRECT_MAX_SLOTS = 48
# The grouped MXFP4 kernels' K step as one MMA over both nibble halves (``_dot_halves``; the same bits) at the
# prefill tiles; the decode tile keeps two. H200, CUDA-graph µs of the op, two against one
# (``bench/kernels.py --sweep --only moe_one_dot``): T = 1 / 8 / 64 (the decode tile) 64.1 / 278.5 / 1192.5 against
# 78.9 / 294.8 / 1241.0; T = 1024 / 8192 2187.5 / 8822.7 against 2144.9 / 8334.7 (43 layers, batch 1: 9.32 against
# 9.97 ms a step). At the decode tile the first half's MMAs overlap the second half's decode.
PREFILL_ONE_DOT = True
DECODE_MERGE_GU = True  # the decode tile's up kernel with the gate and up rows as one MMA operand (``merge_gu``)
# grouped tiles of at least this many rows run the blocks whose second half is empty in a second launch of half
# the rows (``pick_moe_config``'s ``tail``)
TAIL_MIN_BLOCK_M = 32
FOLD_MAX_CODE = 128  # largest UE8M0 code whose 2^(b-1) is a normal bf16 (``e2m1_bytes_to_bf16_ptx_folded``)


def _fold_ok(s: torch.Tensor, raw: torch.Tensor) -> bool:
    """Whether every UE8M0 code of the scales ``s`` (bytes ``raw``) is ≤ FOLD_MAX_CODE, i.e. the
    folded MXFP4 decode gives the same bits. Real checkpoints' expert scales are far below 2 (code
    128); a checkpoint with a larger one keeps the two-multiply decode. The answer is kept on ``s``
    (the caller's tensor, e.g. the model's expert stack) with its in-place version, so the one
    device-to-host read happens on the first call, not on every step; while a CUDA graph is being
    captured nothing can be read, so an unchecked tensor takes the two-multiply decode there (same
    bits, slower). An inference-mode tensor has no version counter, so its answer is not kept (an
    in-place change could not be seen): it is read on every eager call."""
    try:
        key = (raw.data_ptr(), tuple(raw.shape), s._version)
    except RuntimeError:  # "Inference tensors do not track version counter"
        key = None
    hit = getattr(s, "_dsv4_fold_ok", None)
    if key is not None and hit is not None and hit[0] == key:
        return hit[1]
    if raw.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    ok = raw.numel() == 0 or int(raw.max()) <= FOLD_MAX_CODE
    if key is not None:
        try:
            s._dsv4_fold_ok = (key, ok)
        except (AttributeError, RuntimeError):  # a tensor subclass that takes no attributes: checked every call
            pass
    return ok


def pick_moe_config(t: int, topk: int, n_experts: int, expert_dtype: str, config: dict | None = None,
                    x_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tile configuration (``config`` entries override). Direct mode for T·topk ≤ DIRECT_MAX_SLOTS;
    otherwise BLOCK_M from the mean rows per expert. BLOCK_K is 128 in grouped mode (one FP8 scale
    block; four MXFP4 scale groups) and 256 in direct MXFP4 mode (128 for FP8 experts).
    ``down_BLOCK_N`` / ``down_num_warps`` / ``down_num_stages``: the down kernel's own launch (the
    up kernel's by default); neither changes a row's bits: every tile reduces K in the same steps.
    ``maxnreg`` / ``down_maxnreg`` (grouped kernels, for tuning; default: ptxas decides): a cap on
    registers per thread, so more programs fit on an SM (at the decode tile the up kernel takes 119,
    i.e. 4 programs of 4 warps per SM). Only register allocation changes (the PTX is the same), so the
    bits do not. ``scale_ahead`` (grouped MXFP4 kernels; default on): load the next K step's scale
    bytes during this one (byte loads are below ``cp.async``'s 4-byte minimum, so the pipeliner leaves
    them in the loop as loads the same step waits for); the same values reach the same instructions.
    ``fold_scales`` (MXFP4 with the PTX decode; default on): the folded decode wherever the scale
    codes allow it (``_fold_ok``), same bits. ``even_k`` (default on): no K masks where K is a multiple of
    BLOCK_K. ``kperm`` (grouped MXFP4;
    default on): the weight bytes and the activations' columns in the wgmma register operand's order
    (``_kperm``): one 32-bit load per decode call instead of repacking 2-byte pieces; the same
    products summed in another order, so every grouped tile must use the same setting. ``tail`` (grouped
    tiles of BLOCK_M ≥ TAIL_MIN_BLOCK_M; default on): the blocks whose second half holds no slot (an
    expert's last block, about half the time) run in a second launch of BLOCK_M / 2 rows with their own
    ``tail_BLOCK_N`` / ``tail_num_warps`` / ``tail_num_stages``, so those MMAs skip the empty half;
    a row's K steps do not change, so neither do its bits. ``merge_gu`` (MXFP4; default on at the decode tile,
    ``DECODE_MERGE_GU``): the up kernel's gate and up rows as one 2·BLOCK_N-row MMA operand (``_merged_up``): the
    same products in the same order, so the same bits, with half the MMA groups (and waits) a K step.
    ``one_dot`` (grouped MXFP4; default on at the prefill tiles, ``PREFILL_ONE_DOT``): a K step's even-k and odd-k
    halves as one MMA (``_dot_halves``), the same k16 MMAs in the same order, so the same bits."""
    n = t * topk
    decode_tile = batch_invariant() and t <= DECODE_MAX_ROWS
    if decode_tile:
        # decode, batch-invariant: always the grouped kernels with one tile shape, so a token's
        # expert rows are computed the same way whatever else is in the batch. It must also round
        # like the prefill tiles below (a short prompt's chunk takes this path, a long one those):
        # on Hopper they run wgmma, which needs a multiple of 4 warps. The H200 sweep's fastest
        # decode tile, 32 columns × 2 warps (T=1/8/64 in 146/464/1736 us per layer against
        # 159/490/1854), falls back to mma.sync and changed a 10-token prompt's logits by 0.03
        # between a prompt alone and in a larger chunk. The down kernel takes 128 columns (with the
        # folded decode: T=1/8/64 in 69.7/276.0/1159.6 against 71.4/280.7/1172.4 us at 64, same bits:
        # BLOCK_N does not change a row's K steps)
        cfg = dict(direct=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, down_BLOCK_N=128,
                   merge_gu=DECODE_MERGE_GU)
    elif n <= DIRECT_MAX_SLOTS:
        # GEMV kernels (BLOCK_M unused): narrow column blocks, 256-wide K steps (H200 sweep: T=1 in
        # 94 us vs 137 us for 64 x 128)
        cfg = dict(direct=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)
    else:
        avg = n / n_experts
        bm = 16 if avg <= 16 else (32 if avg <= 32 else (64 if avg <= 96 else 128))
        cfg = dict(
            direct=False,
            BLOCK_M=bm,
            BLOCK_N=64 if bm <= 32 else 128,
            BLOCK_K=128,
            num_warps=4 if bm <= 32 else 8,
            num_stages=3,
        )
    if x_dtype == torch.float32 and not interpreting():  # fp32 operands: 2x the shared memory
        cfg.update(BLOCK_N=min(cfg["BLOCK_N"], 64), num_stages=2)
        cfg.pop("down_BLOCK_N", None)
    if config:
        cfg.update(config)
    for key in ("BLOCK_N", "num_warps", "num_stages"):  # the down kernel's own tile (BLOCK_M is shared)
        cfg.setdefault("down_" + key, cfg[key])
    if expert_dtype == "fp8" and not (config and "BLOCK_K" in config):
        cfg["BLOCK_K"] = 128
    if expert_dtype == "fp8" and cfg["BLOCK_K"] != 128:
        raise ValueError("FP8 experts need BLOCK_K = 128 (one scale block per K step)")
    cfg.setdefault("scale_ahead", expert_dtype == "fp4")  # H200: 1-4 % faster at every tile, same bits
    # K order of the MMA operands (``_kperm``): decode and prefill tiles must share it (batch invariance)
    cfg.setdefault("kperm", expert_dtype == "fp4")
    cfg.setdefault("one_dot", PREFILL_ONE_DOT and not decode_tile)
    if cfg["BLOCK_K"] % 32 or cfg["BLOCK_K"] < 64:
        raise ValueError("BLOCK_K must be a multiple of 32 and at least 64")
    # blocks whose second half is empty run at half the rows (a token's row: the same K steps, so the
    # same bits); the decode tile keeps one launch
    cfg.setdefault("tail", not cfg["direct"] and cfg["BLOCK_M"] >= TAIL_MIN_BLOCK_M)
    if cfg["tail"] and (cfg["direct"] or cfg["BLOCK_M"] < 32):
        raise ValueError(f"tail needs the grouped kernels with BLOCK_M >= 32, got {cfg}")
    cfg.setdefault("tail_BLOCK_N", 128 if cfg["BLOCK_M"] >= 128 and cfg["BLOCK_N"] >= 128 else 64)
    # (ptxas, sm_90a: the 64 × 128 tail at 4 warps takes 255 registers and spills; at 8, 185)
    cfg.setdefault("tail_num_warps", 8 if cfg["tail_BLOCK_N"] >= 128 else 4)
    cfg.setdefault("tail_num_stages", cfg["num_stages"])
    return cfg


def _checked_add(add: torch.Tensor | None, t: int, hdim: int, dtype: torch.dtype) -> torch.Tensor | None:
    if add is not None and (tuple(add.shape) != (t, hdim) or add.dtype != dtype):
        raise ValueError(f"add must be [T, H] = {(t, hdim)} in {dtype}, got {tuple(add.shape)} {add.dtype}")
    return add


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    limit: float = 10.0,
    expert_dtype: str | None = None,
    add: torch.Tensor | None = None,
    act_quant: bool = False,
    act_fmt=None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Same contract as ``dsv4.ops.torch_ops.moe_experts`` (``add`` in the combine kernel's epilogue; a
    ``Pending`` one is joined just before that launch, so its branch runs beside the expert GEMMs; a ``Deferred``
    one is forked after the up kernel's launch). ``act_quant``: x and h FP8-rounded per 128 columns by
    ``act_quant_rows`` launches before the up and the down kernels (the values the release's FP8 GEMMs see)."""
    from ...formats.experts import expert_dtype_of

    expert_dtype = expert_dtype or expert_dtype_of(w13)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    t, hdim = x.shape
    topk = ids.shape[1]
    n_exp = w13.shape[0]
    i2 = w13.shape[1]
    idim = i2 // 2
    dev = x.device
    fnuz = False
    if expert_dtype == "fp4":
        w13b = w13.view(torch.uint8) if w13.dtype == torch.int8 else w13
        w2b = w2.view(torch.uint8) if w2.dtype == torch.int8 else w2
        s13b, ue1 = scale_kind(s13)
        s2b, ue2 = scale_kind(s2)
        if not (ue1 and ue2):
            raise TypeError("MXFP4 expert scales must be UE8M0 bytes")
        if w13b.shape[2] * 2 != hdim or tuple(w2b.shape[1:]) != (hdim, idim // 2):
            raise ValueError(
                f"FP4 expert shapes w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match H={hdim}, I={idim}"
            )
        s3_row = 0
    elif expert_dtype == "fp8":
        w13b, fnuz = fp8_weight_bytes(w13)
        w2b, fnuz2 = fp8_weight_bytes(w2)
        s13b, ue1 = scale_kind(s13)
        s2b, ue2 = scale_kind(s2)
        if ue1 != ue2 or fnuz != fnuz2:
            raise TypeError("w13/s13 and w2/s2 must use the same FP8 flavour and scale encoding")
        if w13b.shape[2] != hdim or tuple(w2b.shape[1:]) != (hdim, idim):
            raise ValueError(
                f"FP8 expert shapes w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match H={hdim}, I={idim}"
            )
        s3_row = math.ceil(idim / 128)
    else:
        raise ValueError(f"expert_dtype must be 'fp4' or 'fp8', got {expert_dtype!r}")
    if not isinstance(add, (Pending, Deferred)):  # a tensor is checked before any launch; a branch where it is joined
        _checked_add(add, t, hdim, x.dtype)
    quant = None
    if act_quant:
        from ..torch_ops import check_act_quant_width

        check_act_quant_width(hdim, "x")
        check_act_quant_width(idim, "the experts' intermediate h")
        consts = act_quant_consts(act_fmt)

        def quant(v: torch.Tensor) -> torch.Tensor:
            return act_quant_rows(v, *consts)

    out = torch.empty((t, hdim), dtype=x.dtype, device=dev)
    if t == 0:
        _checked_add(resolve(add), t, hdim, x.dtype)
        return out
    cfg = pick_moe_config(t, topk, n_exp, expert_dtype, config, x.dtype)
    if quant is not None:
        x = quant(x)
    bm = cfg["BLOCK_M"]
    ids32 = ids.to(torch.int32).contiguous()
    wts = weights.to(torch.float32).contiguous()
    if cfg["direct"]:
        nblocks = t * topk
        h = torch.empty((t * topk, idim), dtype=x.dtype, device=dev)
    else:
        if t <= GROUP_KERNEL_MAX_ROWS and n_exp <= GROUP_KERNEL_MAX_EXPERTS:
            slot_ids, bexp = group_slots_triton(ids32, n_exp, bm)  # one launch instead of ~25
        else:
            slot_ids, bexp = group_slots(ids32, n_exp, bm)
        nblocks = bexp.numel()
        h = torch.empty((nblocks * bm, idim), dtype=x.dtype, device=dev)
    y = torch.empty((t * topk, hdim), dtype=x.dtype, device=dev)
    native = cfg.get("native", native_fp8(dev) and expert_dtype == "fp8" and not fnuz)
    dot_f32 = interpreting() or x.dtype == torch.float32
    ptx_ok = ptx_fp4(dev, x.dtype)
    ptx = bool(cfg.get("ptx_fp4", ptx_ok)) and expert_dtype == "fp4"
    if ptx and not ptx_ok:
        raise ValueError(
            f"config ptx_fp4=True needs bf16 activations on a compiled CUDA sm_80+ device, got "
            f"{x.dtype} on {dev}{' (Triton interpreter)' if interpreting() else ''}"
        )
    fold = ptx and bool(cfg.get("fold_scales", True))
    fold_up, fold_down = fold and _fold_ok(s13, s13b), fold and _fold_ok(s2, s2b)
    common = dict(
        BLOCK_M=bm,
        BLOCK_K=cfg["BLOCK_K"],
        FP4=expert_dtype == "fp4",
        SCALE_UE8M0=ue1,
        NATIVE=bool(native),
        FNUZ=fnuz,
        DOT_F32=dot_f32,
        INTERP=interpreting(),
        PTX_FP4=ptx,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    grouped_only = dict(SCALE_AHEAD=bool(cfg["scale_ahead"]), KPERM=bool(cfg["kperm"]),
                        ONE_DOT=bool(cfg["one_dot"]) and expert_dtype == "fp4")
    even = cfg.get("even_k", True)  # K masks dropped where K is a multiple of BLOCK_K (False: kept, for A/B)
    even_up, even_down = even and hdim % cfg["BLOCK_K"] == 0, even and idim % cfg["BLOCK_K"] == 0
    bn = cfg["BLOCK_N"]
    if cfg["direct"]:
        g = dict(
            BLOCK_K=cfg["BLOCK_K"],
            FP4=expert_dtype == "fp4",
            SCALE_UE8M0=ue1,
            NATIVE=bool(native),
            FNUZ=fnuz,
            INTERP=interpreting(),
            PTX_FP4=ptx,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
        _moe_up_gemv_kernel[(nblocks, triton.cdiv(idim, bn))](
            x,
            w13b,
            s13b,
            h,
            ids32,
            hdim,
            idim,
            topk,
            s3_row,
            float(limit),
            x.stride(0),
            x.stride(1),
            w13b.stride(0),
            w13b.stride(1),
            w13b.stride(2),
            s13b.stride(0),
            s13b.stride(1),
            s13b.stride(2),
            h.stride(0),
            h.stride(1),
            BLOCK_N=bn,
            EVEN_K=even_up,
            FOLD=fold_up,
            **g,
        )
        if isinstance(add, Deferred):  # its branch's launches after the up kernel's (``Deferred``)
            add = add.issue()
        if quant is not None:
            h = quant(h)
        _moe_down_gemv_kernel[(nblocks, triton.cdiv(hdim, bn))](
            h,
            w2b,
            s2b,
            y,
            ids32,
            hdim,
            idim,
            h.stride(0),
            h.stride(1),
            w2b.stride(0),
            w2b.stride(1),
            w2b.stride(2),
            s2b.stride(0),
            s2b.stride(1),
            s2b.stride(2),
            y.stride(0),
            y.stride(1),
            BLOCK_N=bn,
            EVEN_K=even_down,
            FOLD=fold_down,
            **g,
        )
    else:
        up = dict(common, **grouped_only, **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
        down = dict(
            common,
            **grouped_only,
            num_warps=cfg["down_num_warps"],
            num_stages=cfg["down_num_stages"],
            **({"maxnreg": cfg["down_maxnreg"]} if cfg.get("down_maxnreg") else {}),
        )
        # (PART, up launch, down launch): one launch per kernel, or with ``tail`` the blocks whose second
        # half is empty in a second launch of half the rows (``_block_rows``)
        merge = bool(cfg.get("merge_gu", False)) and expert_dtype == "fp4"
        parts = [(0, dict(up, BLOCK_N=bn, MERGE_GU=merge), dict(down, BLOCK_N=cfg["down_BLOCK_N"]))]
        if cfg["tail"]:
            half = dict(
                common,
                **grouped_only,
                BLOCK_M=bm // 2,
                BLOCK_N=cfg["tail_BLOCK_N"],
                num_warps=cfg["tail_num_warps"],
                num_stages=cfg["tail_num_stages"],
            )
            parts = [(1,) + parts[0][1:], (2, half, half)]
        for part, up_l, _ in parts:
            _moe_up_kernel[(nblocks, triton.cdiv(idim, up_l["BLOCK_N"]))](
                x,
                w13b,
                s13b,
                h,
                slot_ids,
                bexp,
                hdim,
                idim,
                topk,
                s3_row,
                float(limit),
                x.stride(0),
                x.stride(1),
                w13b.stride(0),
                w13b.stride(1),
                w13b.stride(2),
                s13b.stride(0),
                s13b.stride(1),
                s13b.stride(2),
                h.stride(0),
                h.stride(1),
                EVEN_K=even_up,
                FOLD=fold_up,
                ROWS=bm,
                PART=part,
                **up_l,
            )
        if isinstance(add, Deferred):  # its branch's launches after the up kernel's (``Deferred``)
            add = add.issue()
        if quant is not None:  # (rows of h no block fills are rounded too: unread)
            h = quant(h)
        for part, _, down_l in parts:
            _moe_down_kernel[(nblocks, triton.cdiv(hdim, down_l["BLOCK_N"]))](
                h,
                w2b,
                s2b,
                y,
                slot_ids,
                bexp,
                hdim,
                idim,
                h.stride(0),
                h.stride(1),
                w2b.stride(0),
                w2b.stride(1),
                w2b.stride(2),
                s2b.stride(0),
                s2b.stride(1),
                s2b.stride(2),
                y.stride(0),
                y.stride(1),
                EVEN_K=even_down,
                FOLD=fold_down,
                ROWS=bm,
                PART=part,
                **down_l,
            )
    block_h = min(1024, triton.next_power_of_2(hdim))
    add = _checked_add(resolve(add), t, hdim, x.dtype)
    _moe_combine_kernel[(t, triton.cdiv(hdim, block_h))](
        y,
        ids32,
        wts,
        out,
        out if add is None else add,
        hdim,
        y.stride(0),
        y.stride(1),
        out.stride(0),
        out.stride(1),
        *((0, 0) if add is None else add.stride()),
        TOPK=topk,
        BLOCK_H=block_h,
        ADD=add is not None,
        INTERP=interpreting(),
        num_warps=4,
    )
    return out
