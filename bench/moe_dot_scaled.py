"""Prototype: the MoE MXFP4 up-projection with ``tl.dot_scaled`` vs our hand-decoded kernel.

Question: would the grouped up kernel (``dsv4.ops.triton.moe._moe_up_kernel``: nibbles decoded in
PTX, then tl.dot on bf16 tiles, swap-AB) be much faster if Triton did the MXFP4 upcast itself
(``tl.dot_scaled(bf16, e2m1 + e8m0 scales)``, decomposed to an upcast + bf16 MMA on Hopper by the
compiler, as OpenAI's triton_kernels matmul_ogs does for gpt-oss on H100)?

``_moe_up_dot_scaled_kernel`` has the same grid, grouping (``group_slots[_triton]``) and epilogue
(silu(min(g, limit)) · clamp(u, ±limit), g and u rounded to x.dtype first, h stored in x.dtype)
as ``_moe_up_kernel``; per K step it loads the x rows [BLOCK_M, BLOCK_K] (bf16), the W1 and W3
bytes [BLOCK_N, BLOCK_K/2] and their UE8M0 scales [BLOCK_N, BLOCK_K/32], and accumulates with
``tl.dot_scaled``. Two operand orders (constexpr SWAP):
  * "ab":   dot_scaled(x [M, K] bf16, None, trans(w) [K/2, N] e2m1, scales [N, K/32]) -> acc [M, N]
  * "swap": dot_scaled(w [N, K/2] e2m1, scales [N, K/32], trans(x) [K, M] bf16, None) -> acc [N, M]
            (swap-AB like our kernel: the upcast weight is the MMA's register operand)

Checks per T (before timing): every variant's h rows against a torch reference (the used experts
dequantized exactly to fp32, x·Wᵀ in fp32, g/u rounded to bf16, the epilogue in fp32, h rounded
to bf16; max |diff| / max |ref| ≤ 2^-7 passes) and against ``_moe_up_kernel``'s output (max diff
reported; bitwise equality is not expected: different summation order).

Timing: CUDA-graph median of the up kernel launch alone (grouping done once outside). The existing
kernel runs at ``pick_moe_config`` with batch invariance on (the BLOCK_M=16 decode tile for
T ≤ 64, the per-T prefill tile above); the dot_scaled kernel over a small per-T tile sweep. Each
line: µs, % of the bytes bound (w13 + s13 of the used experts + x read + h written, / 4.2 TB/s),
TFLOP/s for T ≥ 1024 (2 · T·topk · H · 2I).

Notes: ``tl.dot_scaled(lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, acc=None,
fast_math=False, lhs_k_pack=True, rhs_k_pack=True, out_dtype=tl.float32)``; an e2m1 operand is
uint8 with 2 values per byte (first element in the low nibble, i.e. our layout) along K; its scale
is [rows, K/32] for lhs [M, K/2] and [N, K/32] for rhs [K/2, N] (rhs_scale is NOT transposed); a
bf16 operand takes scale None. The Triton interpreter implements dot_scaled (numpy decode, fp32
matmul), so ``--tiny`` under TRITON_INTERPRET=1 checks the kernel's numerics on CPU. triton_kernels'
matmul_ogs on Hopper calls dot_scaled only for unswizzled weights; with its Hopper value/scale
swizzle it upcasts itself (mxfp4_to_bf16_triton) and calls tl.dot with the weight as lhs.

    # on the H200 (≈ 2-3 minutes, compile included; --quick ≈ 1 minute)
    PYTHONPATH=. python3 bench/moe_dot_scaled.py --out dot_scaled.json
    # CPU smoke test of the kernels' numerics under the Triton interpreter
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/moe_dot_scaled.py --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dsv4.ops.invariance import set_batch_invariant  # noqa: E402
from dsv4.ops.triton import moe as tmoe  # noqa: E402
from dsv4.ops.triton._common import cast, interpreting, ptx_fp4  # noqa: E402

HBM_BW = 4.2e12  # bytes/s, H200 spec bandwidth used for the "% of bytes bound" column
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ---------------------------------------------------------------------------------------------
# the dot_scaled kernel
# ---------------------------------------------------------------------------------------------

@triton.jit
def _moe_up_dot_scaled_kernel(x_ptr, w_ptr, s_ptr, h_ptr, slot_ptr, bexp_ptr, H, I, TOPK, limit,
                              stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
                              stride_se, stride_sn, stride_sk, stride_hp, stride_hi,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              SWAP: tl.constexpr, FAST_MATH: tl.constexpr, INTERP: tl.constexpr):
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    e = tl.load(bexp_ptr + b)
    slot = tl.load(slot_ptr + b * BLOCK_M + r)
    ok = slot >= 0
    hrow = b * BLOCK_M + r
    if e >= 0:
        x_dtype = x_ptr.dtype.element_ty
        tok = tl.where(ok, slot // TOPK, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        kk = tl.arange(0, BLOCK_K)
        kb = tl.arange(0, BLOCK_K // 2)
        gi = tl.arange(0, BLOCK_K // 32)
        x_ptrs = x_ptr + tok[:, None] * stride_xt + kk[None, :] * stride_xh
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = s_ptr + e.to(tl.int64) * stride_se
        w1_ptrs = w_base + offs_n[:, None] * stride_wn + kb[None, :] * stride_wk
        w3_ptrs = w1_ptrs + I * stride_wn
        s1_ptrs = s_base + offs_n[:, None] * stride_sn + gi[None, :] * stride_sk
        s3_ptrs = s1_ptrs + I * stride_sn
        if SWAP:
            acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # gate, [n, m]
            acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # up
        else:
            acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # gate, [m, n]
            acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            xm = ok[:, None] & ((k0 + kk) < H)[None, :]
            wm = n_mask[:, None] & ((k0 // 2 + kb) < H // 2)[None, :]
            sm = n_mask[:, None] & ((k0 // 32 + gi) < H // 32)[None, :]
            xv = tl.load(x_ptrs + k0 * stride_xh, mask=xm, other=0.0)
            w1 = tl.load(w1_ptrs + (k0 // 2) * stride_wk, mask=wm, other=0)
            w3 = tl.load(w3_ptrs + (k0 // 2) * stride_wk, mask=wm, other=0)
            sc1 = tl.load(s1_ptrs + (k0 // 32) * stride_sk, mask=sm, other=127)
            sc3 = tl.load(s3_ptrs + (k0 // 32) * stride_sk, mask=sm, other=127)
            if SWAP:
                xt = tl.trans(xv)
                acc1 = tl.dot_scaled(w1, sc1, "e2m1", xt, None, "bf16", acc=acc1, fast_math=FAST_MATH)
                acc3 = tl.dot_scaled(w3, sc3, "e2m1", xt, None, "bf16", acc=acc3, fast_math=FAST_MATH)
            else:
                acc1 = tl.dot_scaled(xv, None, "bf16", tl.trans(w1), sc1, "e2m1", acc=acc1, fast_math=FAST_MATH)
                acc3 = tl.dot_scaled(xv, None, "bf16", tl.trans(w3), sc3, "e2m1", acc=acc3, fast_math=FAST_MATH)
        g = tl.minimum(cast(acc1, x_dtype, INTERP).to(tl.float32), limit)
        u = cast(acc3, x_dtype, INTERP).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        hv = cast(g / (1.0 + tl.exp(-g)) * u, h_ptr.dtype.element_ty, INTERP)
        if SWAP:
            hp = h_ptr + hrow.to(tl.int64)[None, :] * stride_hp + offs_n[:, None] * stride_hi
            tl.store(hp, hv, mask=n_mask[:, None] & ok[None, :])
        else:
            hp = h_ptr + hrow.to(tl.int64)[:, None] * stride_hp + offs_n[None, :] * stride_hi
            tl.store(hp, hv, mask=ok[:, None] & n_mask[None, :])


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------

def grouping(ids32, n_exp, bm):
    """(slot_ids, bexp) as moe_experts builds them (Triton grouping for decode sizes)."""
    t = ids32.shape[0]
    if t <= tmoe.GROUP_KERNEL_MAX_ROWS and n_exp <= tmoe.GROUP_KERNEL_MAX_EXPERTS:
        return tmoe.group_slots_triton(ids32, n_exp, bm)
    return tmoe.group_slots(ids32, n_exp, bm)


def make_existing(x, w13, s13, ids32, cfg, limit=10.0):
    """Closure launching ``_moe_up_kernel`` exactly as moe_experts does (grouping precomputed);
    returns (fn, h, slot_ids)."""
    n_exp, i2 = w13.shape[0], w13.shape[1]
    idim, hdim = i2 // 2, x.shape[1]
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    slot_ids, bexp = grouping(ids32, n_exp, bm)
    nblocks = bexp.numel()
    h = torch.empty((nblocks * bm, idim), dtype=x.dtype, device=x.device)
    dot_f32 = interpreting() or x.dtype == torch.float32
    ptx = ptx_fp4(x.device, x.dtype) and bool(cfg.get("ptx_fp4", True))
    grid = (nblocks, triton.cdiv(idim, bn))

    def fn():
        tmoe._moe_up_kernel[grid](
            x, w13, s13, h, slot_ids, bexp, hdim, idim, ids32.shape[1], 0, float(limit),
            x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
            s13.stride(0), s13.stride(1), s13.stride(2), h.stride(0), h.stride(1),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], FP4=True, SCALE_UE8M0=True, NATIVE=False,
            FNUZ=False, DOT_F32=dot_f32, INTERP=interpreting(), PTX_FP4=ptx,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return fn, h, slot_ids


def make_dot_scaled(x, w13, s13, ids32, cfg, limit=10.0, groups=None):
    n_exp, i2 = w13.shape[0], w13.shape[1]
    idim, hdim = i2 // 2, x.shape[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if groups is not None and bm in groups:
        slot_ids, bexp = groups[bm]
    else:
        slot_ids, bexp = grouping(ids32, n_exp, bm)
        if groups is not None:
            groups[bm] = (slot_ids, bexp)
    nblocks = bexp.numel()
    h = torch.empty((nblocks * bm, idim), dtype=x.dtype, device=x.device)
    grid = (nblocks, triton.cdiv(idim, bn))
    kw = {} if interpreting() else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    def fn():
        _moe_up_dot_scaled_kernel[grid](
            x, w13, s13, h, slot_ids, bexp, hdim, idim, ids32.shape[1], float(limit),
            x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
            s13.stride(0), s13.stride(1), s13.stride(2), h.stride(0), h.stride(1),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP=cfg["order"] == "swap",
            FAST_MATH=bool(cfg.get("fast_math", False)), INTERP=interpreting(), **kw)
    return fn, h, slot_ids


def gather_h(h, slot_ids, n_slots):
    """Rows of the grouped h buffer back in slot order ([T·topk, I], NaN for unplaced slots)."""
    out = torch.full((n_slots, h.shape[1]), float("nan"), dtype=torch.float32, device=h.device)
    sid = slot_ids.long()
    m = sid >= 0
    out[sid[m]] = h[: sid.numel()][m].float()
    return out


# ---------------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------------

def dequant_fp32(wb, sb):
    """MXFP4 bytes [R, K/2] + UE8M0 scales [R, K/32] -> exact fp32 [R, K] (scales 1..254 only)."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=wb.device)
    b = wb.long()
    vals = torch.stack((lut[b & 15], lut[b >> 4]), dim=-1).reshape(wb.shape[0], -1)  # low nibble = even k
    sc = torch.exp2(sb.float() - 127.0)
    return vals * sc.repeat_interleave(32, dim=1)


def reference_h(x, ids, w13, s13, limit=10.0):
    """h [T·topk, I] in fp32 holding bf16-rounded values, per slot, experts dequantized exactly."""
    t, topk = ids.shape
    idim = w13.shape[1] // 2
    flat = ids.reshape(-1).long()
    out = torch.full((t * topk, idim), float("nan"), dtype=torch.float32, device=x.device)
    for e in torch.unique(flat[flat >= 0]).tolist():
        sl = torch.nonzero(flat == e).squeeze(1)
        w = dequant_fp32(w13[e], s13[e])  # [2I, H]
        gu = x[sl // topk].float() @ w.t()  # fp32 GEMM of exact operands
        del w
        g = gu[:, :idim].to(x.dtype).float().clamp(max=limit)
        u = gu[:, idim:].to(x.dtype).float().clamp(-limit, limit)
        out[sl] = (g * torch.sigmoid(g) * u).to(x.dtype).float()
    return out


def compare(h, ref):
    """(max |h - ref| / max |ref|, max |h - ref|) over the slots the reference places (id >= 0);
    inf when h misses one of them."""
    m = ~torch.isnan(ref).any(1)
    d = (h[m] - ref[m]).abs()
    mx = ref[m].abs().max().item()
    dm = d.max().item() if d.numel() else 0.0
    if torch.isnan(h[m]).any():
        return float("inf"), float("inf")
    return dm / max(mx, 1e-30), dm


# ---------------------------------------------------------------------------------------------
# configurations
# ---------------------------------------------------------------------------------------------

def cfg(order, bm, bn, bk, wp, st, fast=False):
    return dict(order=order, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=wp, num_stages=st, fast_math=fast)


def candidates(t, n_exp, topk, quick=False):
    """10 dot_scaled tiles per T (4 with --quick), around the mean rows per expert (t·topk / E)."""
    avg = t * topk / n_exp
    if avg <= 16:  # decode: one token row per expert block, BLOCK_M = 16 is all that's needed
        c = [cfg("swap", 16, 64, 128, 4, 3), cfg("swap", 16, 64, 256, 4, 3), cfg("swap", 16, 128, 128, 4, 3),
             cfg("ab", 16, 64, 128, 4, 3), cfg("swap", 16, 128, 256, 8, 3), cfg("swap", 16, 64, 128, 4, 4),
             cfg("swap", 16, 64, 128, 4, 3, True), cfg("ab", 16, 128, 256, 4, 3), cfg("ab", 64, 64, 128, 4, 3),
             cfg("swap", 32, 64, 128, 4, 3)]
    elif avg <= 64:  # T ≈ 1024: ~24 rows per expert
        c = [cfg("swap", 32, 64, 128, 4, 3), cfg("swap", 32, 128, 128, 4, 3), cfg("swap", 32, 128, 256, 8, 3),
             cfg("ab", 64, 128, 128, 4, 3), cfg("swap", 16, 64, 128, 4, 3), cfg("swap", 32, 64, 256, 4, 4),
             cfg("swap", 64, 128, 128, 8, 3), cfg("swap", 32, 128, 128, 4, 3, True), cfg("ab", 32, 128, 128, 4, 3),
             cfg("ab", 64, 128, 256, 8, 3)]
    else:  # T ≈ 8192: ~190 rows per expert
        c = [cfg("ab", 128, 128, 128, 8, 3), cfg("ab", 128, 64, 128, 4, 3), cfg("ab", 64, 128, 128, 4, 3),
             cfg("swap", 128, 128, 128, 8, 3), cfg("ab", 128, 128, 256, 8, 2), cfg("ab", 128, 128, 128, 8, 4),
             cfg("ab", 128, 128, 128, 8, 3, True), cfg("ab", 64, 64, 128, 4, 4), cfg("swap", 64, 128, 128, 4, 3),
             cfg("swap", 128, 64, 128, 4, 4)]
    return c[:4] if quick else c  # the first four mix both operand orders


def cfg_str(c):
    s = (f"{c.get('order', 'ptx')} M{c['BLOCK_M']} N{c['BLOCK_N']} K{c['BLOCK_K']} "
         f"w{c['num_warps']} s{c['num_stages']}")
    return s + (" fast" if c.get("fast_math") else "")


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def make_weights(n_exp, hid, inter, dev, g):
    """Random MXFP4 experts in the stacked layout (as bench/kernels.py): random bytes, scales 2^-9..2^-6."""
    w13 = torch.randint(0, 256, (n_exp, 2 * inter, hid // 2), device=dev, dtype=torch.uint8, generator=g)
    s13 = torch.randint(118, 122, (n_exp, 2 * inter, hid // 32), device=dev, dtype=torch.uint8, generator=g)
    return w13, s13


def random_ids(t, n_exp, topk, dev, g):
    """Top-k random routing: k distinct experts per token, uniformly."""
    return torch.rand(t, n_exp, device=dev, generator=g).topk(topk, dim=1).indices.to(torch.int32).contiguous()


nan = float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 tiles per T, shorter timing")
    ap.add_argument("--tiny", action="store_true", help="E=4, H=256, I=128, T=3 (CPU / TRITON_INTERPRET=1 check)")
    ap.add_argument("--T", type=str, default=None, help="comma-separated token counts (default 1,8,64,1024,8192)")
    ap.add_argument("--out", type=str, default=None, help="write the rows as JSON")
    ap.add_argument("--no-time", action="store_true", help="checks only")
    args = ap.parse_args(argv)

    set_batch_invariant(True)
    cuda = torch.cuda.is_available() and not interpreting()
    dev = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        n_exp, topk, hid, inter, t_list = 4, 2, 256, 128, [3]
    else:
        n_exp, topk, hid, inter, t_list = 256, 6, 4096, 2048, [1, 8, 64, 1024, 8192]
    if args.T:
        t_list = [int(v) for v in args.T.split(",")]
    timing = cuda and not args.no_time
    if not cuda:
        print(f"# no compiled CUDA (interpreter={interpreting()}): checks only, no timing")
    if timing:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from kernels import bench_graph  # CUDA-graph median (ms), None if not capturable
        print(f"# {torch.cuda.get_device_name()} triton {triton.__version__} torch {torch.__version__}")
    rep = 15 if args.quick else 30  # ms per CUDA-graph median
    t_start = time.time()
    g = torch.Generator(device=dev).manual_seed(0)
    w13, s13 = make_weights(n_exp, hid, inter, dev, g)
    per_expert = w13[0].numel() + s13[0].numel()
    rows = []
    print(f"# E={n_exp} top-{topk} H={hid} I={inter} bf16; bytes bound at {HBM_BW / 1e12:.1f} TB/s; "
          f"check = max|h-ref|/max|ref| vs fp32 ref (pass ≤ 2^-7), d_old = max|h - _moe_up_kernel h|")
    print(f"{'T':>5} {'variant':<42} {'us':>9} {'%bytes':>7} {'TFLOP/s':>8}  {'rel_err':>9} {'d_old':>9}  note")
    for t in t_list:
        x = torch.randn(t, hid, device=dev, generator=g).to(torch.bfloat16)
        ids32 = random_ids(t, n_exp, topk, dev, g)
        used = int(torch.unique(ids32).numel())
        nbytes = used * per_expert + t * hid * 2 + t * topk * inter * 2
        flops = 2 * t * topk * hid * 2 * inter
        bound_us = nbytes / HBM_BW * 1e6
        ref = reference_h(x, ids32, w13, s13)
        base = tmoe.pick_moe_config(t, topk, n_exp, "fp4", None, x.dtype)
        if base.get("direct"):  # not reached with batch invariance on; keep the grouped kernel
            base = dict(base, direct=False)

        def line(name, c, make, h_old):
            """Build (make() -> fn, h buffer, slot_ids), run, check, time; one printed line."""
            rec = dict(T=t, variant=name, config=c, used_experts=used, bytes=nbytes, flops=flops)
            try:
                fn, h, slot_ids = make()
                fn()
                if cuda:
                    torch.cuda.synchronize()
                hs = gather_h(h, slot_ids, t * topk)
                rel, _ = compare(hs, ref)
                d_old = compare(hs, h_old)[1] if h_old is not None else (0.0 if name.startswith("existing") else nan)
                rec.update(rel_err=rel, d_old=d_old, check="ok" if rel <= 2.0 ** -7 else "FAIL")
                us = None
                if timing:
                    ms = bench_graph(fn, rep)
                    us = ms * 1e3 if ms else None
                rec.update(us=us, pct_bytes=100 * bound_us / us if us else None,
                           tflops=flops / (us * 1e-6) / 1e12 if us else None)
                ust = f"{us:9.1f}" if us else f"{'-':>9}"
                pct = f"{rec['pct_bytes']:6.1f}%" if us else f"{'-':>7}"
                tfl = f"{rec['tflops']:8.1f}" if us and t >= 1024 else f"{'':>8}"
                print(f"{t:>5} {name:<42} {ust} {pct} {tfl}  {rel:9.2e} {d_old:9.2e}  {rec['check']}", flush=True)
                return rec, hs
            except Exception as ex:  # noqa: BLE001 - a compile failure must not stop the sweep
                msg = f"{type(ex).__name__}: {str(ex).strip().splitlines()[0] if str(ex).strip() else ''}"[:160]
                rec.update(error=msg)
                print(f"{t:>5} {name:<42} {'FAILED':>9}  {msg}", flush=True)
                if cuda:
                    try:
                        torch.cuda.synchronize()
                    except Exception:  # noqa: BLE001
                        pass
                return rec, None
            finally:
                rows.append(rec)

        ptx = ptx_fp4(x.device, x.dtype)
        name = "existing " + cfg_str(dict(base, order="ptx" if ptx else "portable"))
        _, h_old = line(name, dict(base, ptx_fp4=ptx), lambda: make_existing(x, w13, s13, ids32, base), None)
        groups = {}
        for c in candidates(t, n_exp, topk, args.quick):
            line("dot_scaled " + cfg_str(c), c, lambda: make_dot_scaled(x, w13, s13, ids32, c, groups=groups), h_old)
        ok = [r for r in rows if r["T"] == t and r.get("us") and r["variant"].startswith("dot_scaled")
              and r.get("check") == "ok"]
        old = [r for r in rows if r["T"] == t and r["variant"].startswith("existing") and r.get("us")]
        if ok and old:
            best = min(ok, key=lambda r: r["us"])
            print(f"{t:>5} best dot_scaled {best['us']:.1f} us ({best['variant'][11:]}) vs existing "
                  f"{old[0]['us']:.1f} us: x{old[0]['us'] / best['us']:.2f}", flush=True)
        del x, ref, groups
        if cuda:
            torch.cuda.empty_cache()
        print(f"# {time.time() - t_start:.0f} s so far", flush=True)
    print(f"# total {time.time() - t_start:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name() if cuda else "cpu", triton=triton.__version__,
            torch=torch.__version__, E=n_exp, topk=topk, H=hid, I=inter, hbm_bw=HBM_BW, rows=rows), indent=1,
            default=str))
        print(f"# wrote {args.out}")
    fails = [r for r in rows if r.get("check") == "FAIL"]
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
