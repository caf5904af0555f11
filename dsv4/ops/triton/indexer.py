"""Lightning Indexer over the paged indexer-key cache: scores and a sync-free stable top-k.

``indexer_logits``: logit[t, e] = Σ_h w[t,h] · ReLU(q[t,h] · k[e]) for every entry e of token t's
sequence (entry e lives at page ``block_table[seq, e // B]``, offset ``e % B``), −inf at columns
≥ n_visible[t]. Grid (T, column chunks); a program loads its token's q [Hi, 128] once, then per
64-entry tile loads the keys once (FP8 codes decoded in-kernel, or dense rows), computes all heads
with one ``tl.dot`` [Hi, 128]·[128, 64], applies ReLU and the head weights and sums over heads.
Tiles past n_visible are skipped (only −inf is stored), so the launch shape depends only on
(T, n_cols), never on the data: a CUDA graph can replay it.

Numerics. FP8 pages: keys are e4m3 codes with one power-of-two fp32 scale per entry; q is already
fake-quantized (FP8 × 2^k per head), so both dot operands are exact in bf16 and the bf16 dot (fp32
accumulation) forms the same exact products as the fp32 reference; the key scale is applied after
the head sum (a power-of-two factor commutes with every rounding). Dense pages ('auto' cache):
q is arbitrary fp32, so the dot runs in IEEE fp32 (never TF32). The interpreter rounds the operands
to bf16 the same way but feeds them to an fp32 dot (its bf16 dot is wrong), so a q that is not
FP8-representable shows up there too. Padded heads (Hi < 16: ``tl.dot`` needs ≥ 16 rows) have
q = w = 0.

Batch invariance: every entry's logit is computed by the same instruction sequence (fixed 64-entry
tile, fixed head padding and warp count); the configuration only changes how many tiles one
program walks, so a token's logits are bitwise the same alone, in any batch, and for any n_cols.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...formats import get_fp8_format
from ...formats.indexer_record import INDEXER_DIM, INDEXER_RECORD_BYTES, INDEXER_VALUE_BYTES
from ._common import fp8_to_f32, interpreting, native_fp8, num_sms

__all__ = ["indexer_logits", "indexer_topk", "paged_indexer_topk", "pick_config", "select_topk_ascending"]

BLOCK_E = 64  # entries per tile: fixed, so results never depend on the configuration
NUM_WARPS = 4  # fixed: the head-sum reduction order follows the layout


@triton.jit(do_not_specialize=["seq_ptr", "nvis_ptr", "bt_ptr", "n_cols", "n_blocks", "stride_bs", "stride_ot",
                                "TILES"])
def _indexer_logits_kernel(q_ptr, w_ptr, seq_ptr, nvis_ptr, k_ptr, s_ptr, bt_ptr, out_ptr,
                           H, n_cols, n_blocks,
                           stride_qt, stride_qh, stride_qd, stride_wt, stride_wh,
                           stride_bs, stride_bb, stride_kp, stride_ke, stride_kd, stride_sp, scale_base,
                           stride_ot, ws0, ws1,
                           HP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TILES,
                           EPB: tl.constexpr, FP8: tl.constexpr, NATIVE: tl.constexpr, FNUZ: tl.constexpr,
                           DOT_BF16: tl.constexpr, N_WS: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0)
    first = tl.program_id(1) * (TILES * BLOCK)
    nv = tl.load(nvis_ptr + t).to(tl.int32)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, D)
    hm = offs_h < tl.where(first < nv, H, 0)  # a program with nothing visible reads nothing
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=hm[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h * stride_wh, mask=hm, other=0.0).to(tl.float32)
    if N_WS >= 1:  # the weight scales, in order, each an fp32 multiply (``scaled_weights``)
        w = w * ws0
    if N_WS >= 2:
        w = w * ws1
    qd = q
    if DOT_BF16:
        qd = q.to(tl.bfloat16)  # exact: q is FP8 × 2^k here
        if INTERP:
            qd = qd.to(tl.float32)  # the interpreter's bf16 dot is wrong: same values in fp32
    out_row = out_ptr + t.to(tl.int64) * stride_ot
    for i in range(TILES):
        e0 = first + i * BLOCK
        offs_e = e0 + tl.arange(0, BLOCK)
        res = tl.full([BLOCK], float("-inf"), tl.float32)
        if e0 < nv:
            vis = offs_e < nv
            b = offs_e // EPB
            blk = tl.load(bt_ptr + seq * stride_bs + b * stride_bb, mask=vis & (b < n_blocks), other=-1)
            blk = blk.to(tl.int64)
            ok = vis & (blk >= 0)
            off = offs_e % EPB
            row = blk * stride_kp + off * stride_ke
            raw = tl.load(k_ptr + row[:, None] + offs_d[None, :] * stride_kd,
                          mask=ok[:, None] & (offs_d[None, :] < D), other=0)
            if FP8:
                k = fp8_to_f32(raw, NATIVE, FNUZ)
                ks = tl.load(s_ptr + blk * stride_sp + scale_base + off, mask=ok, other=0.0)
            else:
                k = raw.to(tl.float32)
            if DOT_BF16:
                kd = k.to(tl.bfloat16)  # exact: e4m3 values
                if INTERP:
                    kd = kd.to(tl.float32)
                s = tl.dot(qd, tl.trans(kd))  # exact operands, fp32 accumulation
            else:
                s = tl.dot(qd, tl.trans(k), input_precision="ieee")
            lg = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
            if FP8:
                lg = lg * ks  # power of two: exact
            res = tl.where(vis, lg, float("-inf"))
        tl.store(out_row + offs_e, res, mask=offs_e < n_cols)


def pick_config(t: int, n_cols: int, device: torch.device, config: dict | None = None) -> dict:
    """Tiles per program from the launch shape only: the most (≤ 8, which amortises the q load)
    that still gives about two programs per SM. ``config`` entries override."""
    tiles_total = max(1, math.ceil(n_cols / BLOCK_E))
    want = 2 * num_sms(device)
    tiles = 1
    while tiles < 8 and t * math.ceil(tiles_total / (2 * tiles)) >= want:
        tiles *= 2
    cfg = dict(TILES=tiles, num_stages=2)
    if config:
        cfg.update(config)
    return cfg


def _pages_operands(idx_pages: torch.Tensor, entries_per_block: int, fmt):
    """(key tensor, scale tensor, key strides (page, entry, dim), scale page stride, scale base, fmt or None)."""
    if fmt is None:
        if idx_pages.dim() != 3 or idx_pages.shape[1] != entries_per_block or idx_pages.shape[2] != INDEXER_DIM:
            raise ValueError(f"dense indexer pages must be [P, {entries_per_block}, {INDEXER_DIM}], "
                             f"got {tuple(idx_pages.shape)}")
        if idx_pages.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"dense indexer pages must be fp32/bf16/fp16, got {idx_pages.dtype}")
        return idx_pages, idx_pages, idx_pages.stride(), 0, 0, None
    f = get_fp8_format(fmt)
    need = entries_per_block * INDEXER_RECORD_BYTES
    if idx_pages.dtype != torch.uint8 or idx_pages.dim() != 2 or idx_pages.stride(1) != 1 \
            or idx_pages.shape[1] < need:
        raise ValueError(f"FP8 indexer pages must be a 2-D uint8 tensor [P, ≥{need}] with unit inner stride, "
                         f"got {idx_pages.dtype} shape {tuple(idx_pages.shape)} stride {idx_pages.stride()}")
    try:
        scales = idx_pages.view(torch.float32)  # same storage: page row stride / 4
    except RuntimeError as e:
        raise ValueError(f"FP8 indexer pages: the fp32 scales need 4-byte aligned rows (stride "
                         f"{idx_pages.stride(0)}, storage offset {idx_pages.storage_offset()}): {e}") from e
    base = entries_per_block * INDEXER_VALUE_BYTES // 4
    return idx_pages, scales, (idx_pages.stride(0), INDEXER_VALUE_BYTES, 1), scales.stride(0), base, f


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, seq_ids: torch.Tensor, n_visible: torch.Tensor,
                   idx_pages: torch.Tensor, block_table: torch.Tensor, entries_per_block: int, n_cols: int,
                   fmt, *, weight_scales: tuple[float, ...] = (), config: dict | None = None) -> torch.Tensor:
    """fp32 [T, n_cols] indexer logits, −inf at columns ≥ n_visible[t] (see the module docstring).

    q [T, Hi, 128] fp32 (RoPE'd; FP8-representable when ``fmt`` is set), weights [T, Hi] (any float
    dtype; in fp32 times ``weight_scales`` in order, ``torch_indexer.scaled_weights``, in the kernel), seq_ids
    [T] (row of block_table), n_visible [T], idx_pages uint8 block-packed (fmt OCP/FNUZ) or dense [P, B, 128]
    (fmt None), block_table [S, n_blocks].
    """
    if len(weight_scales) > 2:
        raise ValueError(f"weight_scales: at most 2 factors, got {len(weight_scales)}")
    if q.dim() != 3 or q.shape[2] != INDEXER_DIM:
        raise ValueError(f"q must be [T, Hi, {INDEXER_DIM}], got {tuple(q.shape)}")
    t, h, _ = q.shape
    if tuple(weights.shape) != (t, h):
        raise ValueError(f"weights must be [T, Hi] = {(t, h)}, got {tuple(weights.shape)}")
    if tuple(seq_ids.shape) != (t,) or tuple(n_visible.shape) != (t,):
        raise ValueError(f"seq_ids and n_visible must be [T] = [{t}], got {tuple(seq_ids.shape)} and "
                         f"{tuple(n_visible.shape)}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [S, n_blocks], got {tuple(block_table.shape)}")
    if entries_per_block <= 0 or n_cols < 0:
        raise ValueError(f"entries_per_block must be > 0 and n_cols ≥ 0, got {entries_per_block}, {n_cols}")
    keys, scales, (skp, ske, skd), ssp, sbase, f = _pages_operands(idx_pages, entries_per_block, fmt)
    out = torch.empty(t, n_cols, dtype=torch.float32, device=q.device)
    if t == 0 or n_cols == 0:
        return out
    cfg = pick_config(t, n_cols, q.device, config)
    grid = (t, math.ceil(n_cols / (BLOCK_E * cfg["TILES"])))
    _indexer_logits_kernel[grid](
        q, weights, seq_ids, n_visible, keys, scales, block_table, out,
        h, n_cols, block_table.shape[1],
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
        block_table.stride(0), block_table.stride(1), skp, ske, skd, ssp, sbase, out.stride(0),
        *(tuple(float(v) for v in weight_scales) + (1.0, 1.0))[:2],
        HP=max(16, triton.next_power_of_2(h)), D=INDEXER_DIM, BLOCK=BLOCK_E, TILES=cfg["TILES"],
        EPB=entries_per_block, FP8=f is not None,
        NATIVE=bool(cfg.get("native", f is not None and f.name == "ocp" and native_fp8(q.device))),
        FNUZ=f is not None and f.name == "fnuz", DOT_BF16=f is not None, N_WS=len(weight_scales),
        INTERP=interpreting(), num_warps=NUM_WARPS, num_stages=cfg["num_stages"])
    return out


def indexer_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [T, k]: the columns of the k largest logits per row in descending order, ties to the
    lowest column (exactly ``stable_topk``), −1 where the pick is −inf (invisible) or past n_cols.
    No host synchronisation and no data-dependent branch."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, n_cols], got {tuple(logits.shape)}")
    if k < 0:
        raise ValueError(f"k must be ≥ 0, got {k}")
    t, n = logits.shape
    kk = min(k, n)
    # a stable descending sort is exactly (logit descending, column ascending) and was 1.3-3× faster
    # on the H200 than torch.topk on 64-bit (logit bits, reversed column) keys (bench/kernels_indexer.py:
    # 21 vs 61 µs at T=1 / 8K context, 134 vs 171 µs at T=64 / 64K)
    idx = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :kk]
    picked = torch.gather(logits, 1, idx)
    idx = torch.where(picked == float("-inf"), torch.full_like(idx, -1), idx)
    if kk < k:
        idx = torch.cat([idx, idx.new_full((t, k - kk), -1)], dim=1)
    return idx


SELECT_MAX_COLS = 16384  # a row in registers (16 warps: 32 values a thread); wider rows sort in torch


@triton.jit(do_not_specialize=["n", "k", "stride_x", "stride_o"])
def _select_kernel(x_ptr, out_ptr, n, k, stride_x, stride_o, BLOCK: tl.constexpr, KB: tl.constexpr):
    """One row: the columns of its k largest logits (ties to the lowest column, NaN above +inf as in
    torch.sort, −0 = +0), minus −inf picks, in ascending column order, then −1."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=float("-inf"))
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0.0, 0, bits)
    bits = tl.where(x != x, 0x7FC00000, bits)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648  # float order, in [0, 2^32)
    key = tl.where(ok, key, -1)
    # the k-th largest key: the largest tau with #(key >= tau) >= k, decided bit by bit from the top
    tau = tl.zeros((1,), tl.int64)
    for b in tl.static_range(32):
        cand = tau | (tl.full((1,), 1, tl.int64) << (31 - b))
        cnt = tl.sum((key[None, :] >= cand[:, None]).to(tl.int32), axis=1)
        tau = tl.where(cnt >= k, cand, tau)
    gt = key > tau
    eq = (key == tau).to(tl.int32)
    need = k - tl.sum(gt.to(tl.int32), axis=0)
    sel = ok & (x != float("-inf")) & (gt | ((eq == 1) & (tl.cumsum(eq, axis=0) - eq < need)))
    si = sel.to(tl.int32)
    pos = tl.cumsum(si, axis=0) - si
    row = out_ptr + t * stride_o
    tl.store(row + pos, cols.to(tl.int64), mask=sel)
    j = tl.arange(0, KB)
    tl.store(row + j, tl.full((KB,), -1, tl.int64), mask=(j >= tl.sum(si, axis=0)) & (j < k))


def select_topk_ascending(logits: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [T, k]: the set of ``indexer_topk``'s picks (−1 dropped) in ascending column order, −1
    last — what the batched attention reads. One program per row (rows up to SELECT_MAX_COLS
    columns), instead of a stable sort of the logits and a sort of the picks."""
    t, n = logits.shape
    if n > SELECT_MAX_COLS or not logits.is_contiguous():
        from ..torch_indexer import ascending_picks

        return ascending_picks(indexer_topk(logits, k), n)
    out = torch.empty((t, k), dtype=torch.long, device=logits.device)
    if t == 0 or k == 0:
        return out
    block = max(16, triton.next_power_of_2(n))
    _select_kernel[(t,)](logits, out, n, k, logits.stride(0), out.stride(0), BLOCK=block,
                         KB=max(16, triton.next_power_of_2(k)), num_warps=min(16, max(4, block // 512)))
    return out


def paged_indexer_topk(q, weights, seq_ids, n_visible, idx_pages, block_table, entries_per_block: int,
                       n_cols: int, k: int, fmt, *, ascending: bool = False, weight_scales: tuple[float, ...] = (),
                       config: dict | None = None) -> torch.Tensor:
    """The ``indexer`` op: top-k visible compressed entries per query, [T, k] int64, −1 padded;
    ``ascending``: the same set in ascending column order, −1 last (``select_topk_ascending``)."""
    logits = indexer_logits(q, weights, seq_ids, n_visible, idx_pages, block_table, entries_per_block, n_cols,
                            fmt, weight_scales=weight_scales, config=config)
    return select_topk_ascending(logits, k) if ascending else indexer_topk(logits, k)
