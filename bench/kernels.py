"""Kernel benchmark for the GPU backend (run on the H200): torch reference ops vs Triton kernels.

For every case the Triton result is first checked against the torch op on the same fresh random
inputs; then both are timed with ``triton.testing.do_bench`` (median). Each row reports the bound
max(bytes / measured bandwidth, FLOPs / measured bf16 matmul peak) and the fraction of it achieved.
The bandwidth is measured once with a large device-to-device copy (bytes read + written / time),
the peak once with torch.matmul on 8192³ random bf16.

    PYTHONPATH=. python3 bench/kernels.py --out bench.json [--quick]

Shapes are DeepSeek-V4-Flash's: FP8 linears wq_a [1024×4096], wq_b [32768×1024], wkv [512×4096],
wo_b [4096×8192], shared-expert w1 [2048×4096] at M = 1, 8, 64, 1024, 8192; MoE with 256 experts,
top-6, H = 4096, I = 2048 (MXFP4) at T = 1, 8, 64, 1024; routing at T = 1, 64, 1024, 8192; the MoE
slot grouping (torch vs Triton) at T = 1, 8, 64.

``--sweep`` times tile candidates instead (CUDA-graph medians, each checked against the default):
``--only route`` moe_route's BLOCK_T × num_warps at T = 1, 8, 64, 8192; ``moe`` / ``moe_decode``
the expert GEMM tiles; ``linear`` the FP8 linear tiles; ``moe_prefill`` / ``linear_prefill`` the
prefill tiles that give the decode tile's bits (batch invariance), at T = 8192 (and 1024); ``moe_block_k``
the grouped MXFP4 kernels' K step (128, 256, 512: 64 to 256 contiguous weight bytes per row and step) at
decode and prefill tiles, each prefill tile bit-compared with the decode tile of its K step; ``moe_maxnreg``
the grouped MXFP4 kernels' register caps (more programs per SM), bit-compared with the uncapped launch;
``moe_scale_ahead`` the same kernels loading each K step's scale bytes one step early (also at T = 8192);
``moe_scale_layout`` the MXFP4 scales stored groups-major (a step's bytes of adjacent rows adjacent);
``moe_kperm`` the MMA operands' K order permuted vs memory order, with the prefill-vs-decode-tile bit check;
``moe_fold`` the MXFP4 decode with the E2M1 bias folded into the scale (default) against the two-multiply one;
``moe_tiles`` the decode tile's column width, warps and stages (up and down kernels); ``moe_tail`` the prefill
tiles with and without the half-row launch for an expert's last block, and that launch's tile; ``linear_decode``
the FP8 linear's decode launch on every decode-size linear of a layer; ``linear_act_quant`` the linears that
take act_quant, with and without it (and with its FP8 MMA), weights cold in L2; ``dense_decode`` the bf16 GEMM's decode
launch on a step's bf16 weights; ``mhc_decode`` mhc_post_pre's tiles at decode and prefill sizes, and its gate
launch alone (with 20 Sinkhorn iterations and with 1); each bit-compared with the default; ``mhc_norm`` the same
op with the next sub-layer's RMSNorm in its gate launch, in its loop and rows forms and launch shapes, against the
op then the RMSNorm launch; ``moe_merge`` the MXFP4 up kernel's decode tile with its gate and up rows as one MMA
operand and around it; ``moe_waves`` one token over 1..12 experts (the decode tile's programs against the SMs);
``moe_split_probe`` what K split over programs would save the batch-1 grouped MXFP4 kernels (same bytes);
``mma_rate`` the tensor cores' rate at decode-sized MMAs (``bench/kernels_mma.py``); ``persistent`` what a kernel
boundary costs a chain of dependent decode launches against one persistent launch with grid barriers
(``bench/kernels_persistent.py``); ``read_floor`` what one launch needs to read 0.5-256 MiB, L2 cold
(``bench/kernels_read.py``):

    PYTHONPATH=. python3 bench/kernels.py --sweep --only route --out route_sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LINEARS = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
           "shared_w1": (2048, 4096)}
LINEAR_M = (1, 8, 64, 1024, 8192)
MOE_T = (1, 8, 64, 1024)
ROUTE_T = (1, 64, 1024, 8192)
N_EXP, TOPK, HID, INTER = 256, 6, 4096, 2048
VOCAB = 129280  # the flash checkpoint's vocabulary (the greedy pick's row width)


def random_fp4_experts(dev, g, hid=HID, inter=INTER):
    """(w13, s13, w2, s2): random MXFP4 experts (Flash's shapes by default) as the engine stacks them (3 GiB of
    packed weights; ``stack_experts``: scales groups-major, see ``rows_contiguous``), scale codes 118..121."""
    w13 = torch.randint(0, 256, (N_EXP, 2 * inter, hid // 2), device=dev, dtype=torch.uint8, generator=g)
    s13 = torch.randint(118, 122, (N_EXP, 2 * inter, hid // 32), device=dev, dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (N_EXP, hid, inter // 2), device=dev, dtype=torch.uint8, generator=g)
    s2 = torch.randint(118, 122, (N_EXP, hid, inter // 32), device=dev, dtype=torch.uint8, generator=g)
    return w13, rows_contiguous(s13), w2, rows_contiguous(s2)


def rows_contiguous(s):
    """The same scale values [E, rows, groups] stored groups-major, as ``stack_experts`` stores them: a
    K step's scale bytes of adjacent rows are adjacent (a transposed view of a [E, groups, rows] tensor)."""
    return s.transpose(1, 2).contiguous().transpose(1, 2)


def bench(fn, rep_ms=60, warmup_ms=15):
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))  # ms


def bench_graph(fn, rep_ms=60):
    """Median kernel time with launches replayed from a CUDA graph (no Python/launch overhead);
    None when ``fn`` cannot be captured (host synchronisation)."""
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    except Exception:  # noqa: BLE001 - not capturable
        torch.cuda.synchronize()
        return None


def measure_bandwidth(dev) -> float:
    n = 4 << 30  # 4 GiB source, well past L2
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a), rep_ms=200)
    a = b = None  # freed (a timed closure above refers to them)
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)  # bytes/s (read + write)


def measure_peak(dev) -> float:
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = bench(lambda: torch.matmul(a, b), rep_ms=300)
    return 2 * 8192 ** 3 / (ms * 1e-3)  # FLOP/s


class Table:
    def __init__(self, bw, peak):
        self.bw, self.peak, self.rows = bw, peak, []

    def add(self, kernel, shape, backend, fn, nbytes, flops, check, rep_ms=60, warmup_ms=15, graph=True):
        ms = bench(fn, rep_ms, warmup_ms)
        gms = bench_graph(fn, rep_ms) if graph else None
        bound_ms = max(nbytes / self.bw, flops / self.peak) * 1e3
        row = dict(kernel=kernel, shape=shape, backend=backend, ms=ms, graph_ms=gms, bytes=nbytes, flops=flops,
                   bound_ms=bound_ms, bound="memory" if nbytes / self.bw >= flops / self.peak else "compute",
                   fraction=bound_ms / ms if ms > 0 else None,
                   graph_fraction=bound_ms / gms if gms else None, check=check)
        self.rows.append(row)
        gtxt = f"{gms * 1e3:>10.1f} us {100 * row['graph_fraction']:>6.1f}%" if gms else f"{'-':>13} {'':>7}"
        print(f"{kernel:<12} {shape:<28} {backend:<10} {ms * 1e3:>10.1f} us {100 * row['fraction']:>6.1f}%  "
              f"{gtxt}  bound {bound_ms * 1e3:>8.1f} us ({row['bound'][:3]})  {check}", flush=True)


def check_close(y, ref, absprod=None, rel=1e-5):
    """'ok' when |y - ref| ≤ rel·Σ|x w| (fp32 outputs) — else the max ratio."""
    d = (y.float() - ref.float()).abs()
    lim = rel * absprod if absprod is not None else 2.0 ** -7 * (ref.float().abs() + ref.float().abs().max())
    worst = (d / (lim + 1e-30)).max().item()
    return "ok" if worst <= 1.0 else f"FAIL x{worst:.3g}"


def _split_two_launches(call):
    """``call()`` with ``_common.SPLIT_FIXUP`` off: the split-K partials summed by a second launch
    (``sum_in_order``) instead of by each tile's last program."""
    from dsv4.ops.triton import _common

    _common.SPLIT_FIXUP = False
    try:
        return call()
    finally:
        _common.SPLIT_FIXUP = True


def bench_linears(tab, dev, ms_list):
    from dsv4.formats import dequantize_block_fp8
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import fp8_linear as tfl

    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in LINEARS.items():
        codes = torch.randint(0, 256, (n, k), device=dev, dtype=torch.uint8, generator=g)
        codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes)  # no NaN codes
        w = codes.view(torch.float8_e4m3fn)
        s = torch.randint(118, 124, (math.ceil(n / 128), math.ceil(k / 128)), device=dev, dtype=torch.uint8,
                          generator=g)
        w_bf16 = dequantize_block_fp8(w, s, out_dtype=torch.bfloat16)
        for m in ms_list:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            # correctness first: fp32 outputs of the same bf16 operands
            y = tfl.fp8_linear(x, w, s, out_dtype=torch.float32)
            ref = torch_ops.fp8_linear(x, w, s, out_dtype=torch.float32)
            ap = x.float().abs() @ w_bf16.float().abs().T
            chk = check_close(y, ref, ap)
            y = ref = ap = None  # freed (a timed closure above refers to them)
            nbytes = n * k + s.numel() + 2 * m * k + 2 * m * n
            flops = 2 * m * n * k
            shape = f"{name} M={m} N={n} K={k}"
            tab.add("fp8_linear", shape, "torch_op", lambda: torch_ops.fp8_linear(x, w, s), nbytes, flops, chk)
            tab.add("fp8_linear", shape, "bf16_dense", lambda: torch.nn.functional.linear(x, w_bf16),
                    2 * n * k + 2 * m * k + 2 * m * n, flops, "(pre-dequantized bf16 weight)")
            tab.add("fp8_linear", shape, "triton", lambda: tfl.fp8_linear(x, w, s), nbytes, flops, chk)
            if tfl.pick_config(m, n, k, x.device)["split_k"] > 1:  # split-K summed by a second launch
                def two_launches():
                    return _split_two_launches(lambda: tfl.fp8_linear(x, w, s))

                same = torch.equal(two_launches(), tfl.fp8_linear(x, w, s))
                tab.add("fp8_linear", shape, "triton 2 launches", two_launches, nbytes, flops,
                        "ok (bits of triton)" if same else "FAIL: bits differ from triton")
        w_bf16 = None  # freed (a timed closure above refers to them)
        torch.cuda.empty_cache()


def bench_route(tab, dev):
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import moe as tmoe

    g = torch.Generator(device=dev).manual_seed(1)
    bias = torch.randn(N_EXP, device=dev, generator=g) * 0.1
    for t in ROUTE_T:
        logits = torch.randn(t, N_EXP, device=dev, generator=g) * 2
        valid = torch.rand(t, device=dev, generator=g) > 0.05
        a = tmoe.moe_route(logits, bias, TOPK, 1.5, True, None, valid)
        b = torch_ops.moe_route(logits, bias, TOPK, 1.5, True, None, valid)
        chk = "ok" if torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) else \
            f"FAIL ids {int((a[0] != b[0]).sum())} w {int((a[1] != b[1]).sum())}"
        nbytes = t * N_EXP * 4 + t * TOPK * 8
        flops = t * N_EXP * 10
        shape = f"T={t} E={N_EXP} k={TOPK}"
        tab.add("moe_route", shape, "torch_op",
                lambda: torch_ops.moe_route(logits, bias, TOPK, 1.5, True, None, valid), nbytes, flops, chk)
        tab.add("moe_route", shape, "triton",
                lambda: tmoe.moe_route(logits, bias, TOPK, 1.5, True, None, valid), nbytes, flops, chk)


def bench_pick(tab, dev):
    """The sampler's batched greedy pick at decode batch sizes over the model's vocabulary: torch's
    argmax + isfinite().all() (one single-block reduction per row, then a second pass) vs the Triton
    two-stage pick; checked for identical picks and flags."""
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import greedy as tg

    g = torch.Generator(device=dev).manual_seed(2)
    for n in (1, 8, 64):
        x = torch.randn(n, VOCAB, device=dev, generator=g)
        chk = "ok" if torch.equal(tg.greedy_pick(x), torch_ops.greedy_pick(x)) else "FAIL"
        shape = f"n={n} V={VOCAB}"
        tab.add("greedy_pick", shape, "torch_op", lambda: torch_ops.greedy_pick(x), x.numel() * 4, 0, chk)
        tab.add("greedy_pick", shape, "triton", lambda: tg.greedy_pick(x), x.numel() * 4, 0, chk)


def bench_group(tab, dev):
    """The MoE slot grouping: the torch version (~25 small kernels) vs the one Triton launch
    ``moe_experts`` uses up to GROUP_KERNEL_MAX_ROWS tokens, at decode and eager-step sizes; checked
    for identical tensors."""
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import moe as tmoe

    g = torch.Generator(device=dev).manual_seed(4)
    for t in (1, 8, 64, 256, 512, 2048):
        ids, _ = torch_ops.moe_route(torch.randn(t, N_EXP, device=dev, generator=g) * 2, None, TOPK, 1.5, True)
        ids = ids.to(torch.int32)
        for bm in (16, 32):
            a, b = tmoe.group_slots(ids, N_EXP, bm), tmoe.group_slots_triton(ids, N_EXP, bm)
            chk = "ok" if all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b)) else "FAIL"
            nbytes = 4 * (ids.numel() + a[0].numel() + a[1].numel())
            shape = f"T={t} E={N_EXP} k={TOPK} bm={bm}"
            tab.add("group_slots", shape, "torch_op", lambda: tmoe.group_slots(ids, N_EXP, bm), nbytes, 0, chk)
            tab.add("group_slots", shape, "triton", lambda: tmoe.group_slots_triton(ids, N_EXP, bm), nbytes, 0, chk)


def bench_moe(tab, dev, t_list):
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import moe as tmoe

    g = torch.Generator(device=dev).manual_seed(2)
    w13, s13, w2, s2 = random_fp4_experts(dev, g)
    per_expert = (w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel())
    bias = torch.randn(N_EXP, device=dev, generator=g) * 0.1
    for t in t_list:
        x = torch.randn(t, HID, device=dev, dtype=torch.bfloat16, generator=g)
        ids, w = torch_ops.moe_route(torch.randn(t, N_EXP, device=dev, generator=g) * 2, bias, TOPK, 1.5, True)
        y = tmoe.moe_experts(x, ids, w, w13, s13, w2, s2)
        ref = torch_ops.moe_experts(x, ids, w, w13, s13, w2, s2)
        chk = check_close(y, ref)
        y = ref = None  # freed (a timed closure above refers to them)
        used = int(torch.unique(ids).numel())
        nbytes = used * per_expert + 2 * t * HID * 2 + t * TOPK * HID * 2 * 2 + t * TOPK * INTER * 2 * 2
        flops = t * TOPK * 6 * HID * INTER
        shape = f"T={t} experts_used={used}"
        slow = t >= 1024
        # the torch op syncs (torch.unique): no graph timing
        tab.add("moe_experts", shape, "torch_op", lambda: torch_ops.moe_experts(x, ids, w, w13, s13, w2, s2),
                nbytes, flops, chk, rep_ms=30 if slow else 60, warmup_ms=5 if slow else 15, graph=False)
        tab.add("moe_experts", shape, "triton", lambda: tmoe.moe_experts(x, ids, w, w13, s13, w2, s2),
                nbytes, flops, chk)
        tab.add("moe_experts", shape, "triton, portable MXFP4 decode",  # what the PTX decode saves
                lambda: tmoe.moe_experts(x, ids, w, w13, s13, w2, s2, config={"ptx_fp4": False}), nbytes, flops, chk)


def sweep(dev, only=("linear", "moe")):
    """Time candidate tile configurations (CUDA-graph medians) and print the best per case."""
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import fp8_linear as tfl
    from dsv4.ops.triton import moe as tmoe

    g = torch.Generator(device=dev).manual_seed(3)
    out = {}
    dec = [dict(BLOCK_N=bn, num_warps=wp, num_stages=st) for bn in (32, 64, 128) for wp in (4,) for st in (3, 5)]
    pre = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=wp, num_stages=st, GROUP_M=8, split_k=1)
           for bm, bn, wp, st in ((128, 128, 8, 3), (64, 128, 4, 4), (128, 256, 8, 3), (128, 64, 4, 4),
                                  (64, 256, 8, 3), (256, 128, 8, 3))]
    for name in (("wq_b", "wo_b", "wq_a") if "linear" in only else ()):
        n, k = LINEARS[name]
        w = torch.randint(0, 126, (n, k), device=dev, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        s = torch.randint(118, 124, (math.ceil(n / 128), math.ceil(k / 128)), device=dev, dtype=torch.uint8,
                          generator=g)
        for m in (1, 64, 1024, 8192):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            res = []
            for c in (dec if m <= 64 else pre):
                try:
                    res.append((bench_graph(lambda: tfl.fp8_linear(x, w, s, config=c), 30), c))
                except Exception as e:  # noqa: BLE001
                    res.append((None, f"{c}: {type(e).__name__}"))
            ok = sorted([r for r in res if r[0]], key=lambda r: r[0])
            out[f"fp8_linear {name} M={m}"] = [(r[0], str(r[1])) for r in res]
            print(f"sweep fp8_linear {name} M={m}: " + "; ".join(f"{r[0] * 1e3:.1f}us {r[1]}" for r in ok[:3]),
                  flush=True)
    if "route" in only:
        out.update(sweep_route(dev, g))
    if "linear_decode" in only:
        out.update(sweep_linear_decode(dev, g))
    if "linear_act_quant" in only:
        out.update(sweep_linear_act_quant(dev, g))
    if "mhc_decode" in only:
        out.update(sweep_mhc_decode(dev, g))
    if "mhc_norm" in only:
        out.update(sweep_mhc_norm(dev, g))
    if "dense_decode" in only:
        out.update(sweep_dense_decode(dev, g))
    if "moe_waves" in only:
        out.update(sweep_moe_waves(dev, g))
    if "moe_split_probe" in only:
        out.update(sweep_moe_split_probe(dev, g))
    if "mma_rate" in only:
        from kernels_mma import sweep_mma_rate

        out.update(sweep_mma_rate(dev, bench_graph))
    if "persistent" in only:
        from kernels_persistent import sweep_persistent

        out.update(sweep_persistent(dev, bench_graph))
    if "read_floor" in only:
        from kernels_read import sweep_read_floor

        out.update(sweep_read_floor(dev, bench_graph))
    for name, fn in (("moe_block_k", sweep_moe_block_k), ("moe_maxnreg", sweep_moe_maxnreg),
                     ("moe_scale_ahead", sweep_moe_scale_ahead), ("moe_scale_layout", sweep_moe_scale_layout),
                     ("moe_kperm", sweep_moe_kperm), ("moe_fold", sweep_moe_fold), ("moe_tiles", sweep_moe_tiles),
                     ("moe_tail", sweep_moe_tail), ("moe_merge", sweep_moe_merge), ("moe_one_dot", sweep_moe_one_dot)):
        # the grouped MXFP4 kernels' single-knob sweeps
        if name in only:
            out.update(fn(dev, g))
    if {"moe_prefill", "linear_prefill"} & set(only):
        out.update(sweep_prefill(dev, g, set(only)))
    if not {"moe", "moe_decode", "moe_decode_narrow"} & set(only):
        return out
    w13, s13, w2, s2 = random_fp4_experts(dev, g)
    for t in ((1, 8, 64, 1024) if "moe" in only else ()):
        x = torch.randn(t, HID, device=dev, dtype=torch.bfloat16, generator=g)
        ids, wts = torch_ops.moe_route(torch.randn(t, N_EXP, device=dev, generator=g), None, TOPK, 1.5, True)
        if t * TOPK <= tmoe.DIRECT_MAX_SLOTS:
            cands = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=wp, num_stages=st)
                     for bn in (16, 32, 64) for bk in (128, 256) for wp in (2, 4, 8) for st in (3,)]
            cands += [dict(direct=False, BLOCK_M=16, BLOCK_N=64)]
        else:
            cands = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=wp, num_stages=st)
                     for bm in ((16, 32) if t <= 64 else (16, 32, 64)) for bn in (64, 128) for wp in (4, 8)
                     for st in (3,)]
        res = []
        for c in cands:
            try:
                res.append((bench_graph(lambda: tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=c), 30), c))
            except Exception as e:  # noqa: BLE001
                res.append((None, f"{c}: {type(e).__name__}"))
        ok = sorted([r for r in res if r[0]], key=lambda r: r[0])
        out[f"moe_experts T={t}"] = [(r[0], str(r[1])) for r in res]
        print(f"sweep moe_experts T={t}: " + "; ".join(f"{r[0] * 1e3:.1f}us {r[1]}" for r in ok[:3]), flush=True)
    if "moe_decode" in only or "moe_decode_narrow" in only:
        out.update(sweep_moe_decode(dev, g, w13, s13, w2, s2, narrow="moe_decode_narrow" in only))
    return out


ROUTE_SWEEP_T = (1, 8, 64, 8192)

MOE_PREFILL_TILES = [(128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 8, 2), (64, 128, 8, 3), (64, 128, 4, 3),
                     (128, 64, 8, 3), (64, 64, 4, 3), (128, 256, 8, 3), (64, 256, 8, 3)]
LINEAR_PREFILL_TILES = [(256, 128, 8, 3), (128, 128, 8, 3), (128, 256, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4),
                        (256, 64, 8, 3), (64, 128, 4, 3)]


def _bitwise_trial(run, ref, rows_checked=None):
    """(CUDA-graph ms, "same bits" / "DIFFERS (n values)") of one candidate launch ``run`` whose
    output (its first ``rows_checked`` rows) must equal ``ref`` bitwise; (None, the error) when the
    candidate fails to compile or launch — a result too."""
    try:
        y = run()
        y = y if rows_checked is None else y[:rows_checked]
        same = "same bits" if torch.equal(y, ref) else f"DIFFERS ({(y != ref).sum().item()} values)"
        return bench_graph(run, 60), same
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e)[:80]}"


def sweep_prefill(dev, g, only):
    """Prefill tiles that keep batch invariance: each candidate's output must equal, bitwise, the
    decode tile's (MoE: the batch-invariant decode config run on all T tokens; FP8 linear: the rows
    of an M = 64 launch), since a prompt's chunk of ≤ 64 tokens runs the decode tile and a longer
    one these. Times are CUDA-graph medians; TFLOP/s from the useful FLOPs."""
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import fp8_linear as tfl
    from dsv4.ops.triton import moe as tmoe

    out = {}
    if "moe_prefill" in only:
        w13, s13, w2, s2 = random_fp4_experts(dev, g)
        dec = tmoe.pick_moe_config(1, TOPK, N_EXP, "fp4")
        for t in (8192, 1024):
            x = torch.randn(t, HID, device=dev, dtype=torch.bfloat16, generator=g)
            ids, wts = torch_ops.moe_route(torch.randn(t, N_EXP, device=dev, generator=g), None, TOPK, 1.5, True)
            ref = tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=dec)
            flops = t * TOPK * 6 * HID * INTER
            cur = tmoe.pick_moe_config(t, TOPK, N_EXP, "fp4")
            tiles = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st) for bm, bn, w, st in MOE_PREFILL_TILES]
            current = {k: cur[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
            cands = tiles if current in tiles else [current] + tiles  # the current tile is always timed

            def moe(c):
                return lambda: tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=c)

            rows = [(*_bitwise_trial(moe(c), ref), c) for c in cands]
            best = min((r for r in rows if r[0] and r[1] == "same bits"), key=lambda r: r[0], default=None)
            if best:  # the down kernel's own tile around the best common one
                for bn, w, st in ((64, 4, 3), (128, 4, 3), (128, 8, 3), (256, 8, 3), (64, 8, 3), (128, 8, 4)):
                    c = dict(best[2], down_BLOCK_N=bn, down_num_warps=w, down_num_stages=st)
                    rows.append((*_bitwise_trial(moe(c), ref), c))
            rows = [(ms, c, same) for ms, same, c in rows]
            for ms, c, same in sorted(rows, key=lambda r: r[0] or 1e9):
                tag = " (current)" if all(cur.get(k) == v for k, v in c.items()) else ""
                txt = f"{ms * 1e3:9.1f} us {flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s" if ms else f"{'-':>28}"
                print(f"sweep moe_prefill T={t}: {txt} {c} {same}{tag}", flush=True)
            out[f"moe_prefill T={t}"] = [(ms, str(c), same) for ms, c, same in rows]
    if "linear_prefill" in only:
        for name in ("wq_b", "wo_b", "wq_a", "shared_w1", "wkv"):
            n, k = LINEARS[name]
            w = torch.randint(0, 126, (n, k), device=dev, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
            sc = torch.randint(118, 124, (math.ceil(n / 128), math.ceil(k / 128)), device=dev, dtype=torch.uint8,
                               generator=g)
            m = 8192
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            ref64 = tfl.fp8_linear(x[:64], w, sc)
            cur = tfl.pick_config(m, n, k, dev)
            rows = []
            for bm, bn, wp, st in LINEAR_PREFILL_TILES:
                c = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=wp, num_stages=st)
                ms, same = _bitwise_trial(lambda c=c: tfl.fp8_linear(x, w, sc, config=c), ref64, rows_checked=64)
                rows.append((ms, c, same))
            chunks = cur["chunks_per_program"]
            for ms, c, same in sorted(rows, key=lambda r: r[0] or 1e9):
                tag = " (current)" if all(cur.get(kk) == v for kk, v in c.items()) else ""
                txt = f"{ms * 1e3:9.1f} us {2 * m * n * k / (ms * 1e-3) / 1e12:6.1f} TFLOP/s" if ms else f"{'-':>28}"
                print(f"sweep linear_prefill {name} [{n}x{k}] M={m} chunks={chunks}: {txt} {c} {same}{tag}",
                      flush=True)
            out[f"linear_prefill {name}"] = [(ms, str(c), same) for ms, c, same in rows]
    return out


# the decode-size FP8 linears of one layer ((rows, K, groups); wo_a is the grouped output projection, 8 groups
# of 1024 rows over 4096 columns each) and two fusion candidates (wq_a with wkv; the shared expert's w1 with w3)
DECODE_LINEARS = {"wq_a": (1024, 4096, 1), "wq_b": (32768, 1024, 1), "wkv": (512, 4096, 1), "wo_a": (8192, 4096, 8),
                  "wo_b": (4096, 8192, 1), "shared_w1": (2048, 4096, 1), "shared_w2": (4096, 2048, 1),
                  "idx_wq_b": (8192, 1024, 1), "wq_a+wkv": (1536, 4096, 1), "shared_w13": (4096, 4096, 1)}
LINEAR_DECODE_VARIANTS = {  # name -> config over the batch-invariant decode launch (the weight's K chunks)
    "former tile (M 64, 128 rows for N >= 4096)": dict(BLOCK_M=64, former=True),
    "default": {},
    "8 warps": dict(num_warps=8),
    "4 stages": dict(num_stages=4),
    "2x chunks": dict(chunks=2),
    "4x chunks": dict(chunks=4),
}


def sweep_linear_decode(dev, g, m_list=(1, 8)):
    """The FP8 linear's decode launch variants (``LINEAR_DECODE_VARIANTS``) on every decode-size linear of a
    layer and two fusion candidates: CUDA-graph median, the fraction of the copy bandwidth its bytes take, and
    its bits against the first variant's ("2x chunks" / "4x chunks" reduce K in other chunks: other bits, timed
    against the default's chunks only)."""
    from dsv4.ops.triton import fp8_linear as tfl

    bw = measure_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    out = {"bandwidth_Bps": bw}
    for name, (n, k, groups) in DECODE_LINEARS.items():
        w = torch.randint(0, 126, (n, k), device=dev, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        sc = torch.randint(118, 124, (math.ceil(n / 128), math.ceil(k / 128)), device=dev, dtype=torch.uint8,
                           generator=g)
        for m in m_list:
            x = torch.randn(m, groups * k, device=dev, dtype=torch.bfloat16, generator=g)
            nbytes = n * k + sc.numel() + 2 * m * groups * k + 2 * m * n
            refs = {}
            base = tfl.pick_config(m, n, k, dev)
            for vname, c in LINEAR_DECODE_VARIANTS.items():
                c = dict(c)
                if c.pop("former", False):
                    c["BLOCK_N"] = tfl._decode_block_n(n)
                if c.pop("chunks", 1) > 1:  # more, narrower K chunks (other bits: timed only)
                    split = min(math.ceil(k / 128), base["split_k"] * LINEAR_DECODE_VARIANTS[vname]["chunks"])
                    if split == base["split_k"]:
                        continue
                    c.update(split_k=split, BLOCK_N=c.get("BLOCK_N", base["BLOCK_N"]))
                run = (lambda c=c: tfl.fp8_linear(x, w, sc, groups=groups, config=c))
                key = "split" if "split_k" in c else "plain"
                try:
                    y = run()
                except Exception as e:  # noqa: BLE001
                    print(f"sweep linear_decode {name} M={m} {vname}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                if key in refs:
                    same = "same bits" if torch.equal(y, refs[key]) else f"DIFFERS ({(y != refs[key]).sum().item()})"
                else:
                    refs[key] = y
                    same = "-" if key == "plain" else "other chunks"
                ms = bench_graph(run, 40)
                frac = nbytes / bw / (ms * 1e-3) if ms else 0
                print(f"sweep linear_decode {name} [{n}x{k}/{groups}] M={m}: {ms * 1e3:7.1f} us "
                      f"{100 * frac:5.1f}% of bw {vname}: {same}", flush=True)
                out[f"linear_decode {name} M={m} {vname}"] = (ms, frac, same)
        w = sc = None
        torch.cuda.empty_cache()
    return out


ACT_QUANT_LINEARS = ("wq_a+wkv", "wq_b", "wo_b", "shared_w13", "shared_w2", "idx_wq_b")


def sweep_linear_act_quant(dev, g, m_list=(1, 8, 1024, 8192)):
    """The FP8 linears that take act_quant (activations FP8-rounded per 128: x quantized in a launch of its own, then
    the GEMM) against the same GEMM without it, the weights cold in L2 as in a decode step (the graph cycles through
    copies holding 4x the L2): µs a launch, the quantization launch included, and the share of the copy bandwidth
    the weight bytes take."""
    from dsv4.ops.triton import fp8_linear as tfl

    bw = measure_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    out = {"bandwidth_Bps": bw}
    for name in ACT_QUANT_LINEARS:
        n, k, groups = DECODE_LINEARS[name]
        copies = max(2, (200 << 20) // (n * k))
        ws = [torch.randint(0, 126, (n, k), device=dev, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
              for _ in range(copies)]
        sc = torch.randint(118, 124, (math.ceil(n / 128), math.ceil(k / 128)), device=dev, dtype=torch.uint8,
                           generator=g)
        for m in m_list:
            x = torch.randn(m, groups * k, device=dev, dtype=torch.bfloat16, generator=g)
            ref = None
            for arm, aq, mma in (("act_quant", True, 0), ("act_quant FP8 MMA", True, 1),
                                 ("act_quant FP8 MMA, quantized in the GEMM", True, 2), ("no act_quant", False, 0)):
                if mma == 2 and m > 64:
                    continue
                tfl.ACT_QUANT_FP8_MMA, tfl.A8_QUANT_IN_DECODE = mma > 0, mma == 2
                try:
                    y = tfl.fp8_linear(x, ws[0], sc, groups=groups, act_quant=aq).float()
                    ms = bench_graph(lambda aq=aq: [tfl.fp8_linear(x, w, sc, groups=groups, act_quant=aq)
                                                    for w in ws], 80)
                finally:
                    tfl.ACT_QUANT_FP8_MMA = tfl.A8_QUANT_IN_DECODE = False
                ref = y if ref is None else ref  # the act_quant bf16 MMA: the FP8 MMA's max relative difference
                diff = f", max |Δ|/max|y| {((y - ref).abs().max() / ref.abs().max()).item():.1e}" if aq and mma else ""
                us = ms * 1e3 / copies if ms else None
                frac = n * k / bw / (us * 1e-6) if us else 0
                print(f"sweep linear_act_quant {name} [{n}x{k}/{groups}] M={m}: {us:8.1f} us {100 * frac:5.1f}% "
                      f"of bw, {arm}{diff}", flush=True)
                out[f"linear_act_quant {name} M={m} {arm}"] = (us, frac)
        ws = None
        torch.cuda.empty_cache()
    return out


DENSE_DECODE = {  # name -> (N, K, chunk_rows, out fp32): the 16-bit weights a decode step multiplies (flash widths)
    "CSA compressor [wkv; wgate]": (2048, 4096, 1024, False),
    "HCA compressor [wkv; wgate]": (1024, 4096, 512, False),
    "indexer compressor": (512, 4096, 256, False),
    "router (256 experts)": (256, 4096, None, True),
    "router (32 experts)": (32, 4096, None, True),
    "indexer weights_proj": (64, 4096, None, False),
}
DENSE_DECODE_VARIANTS = {  # name -> dense_linear config["decode"] (None: the base tile); all the same bits
    "default": {},
    "base tile": dict(decode=None),
    **{f"BLOCK_N {bn}": dict(decode=dict(BLOCK_N=bn, num_warps=4, num_stages=4)) for bn in (32, 128)},
    **{f"{w} warps": dict(decode=dict(BLOCK_N=64, num_warps=w, num_stages=4)) for w in (2, 8)},
    **{f"{st} stages": dict(decode=dict(BLOCK_N=64, num_warps=4, num_stages=st)) for st in (2, 3, 6)},
    "BLOCK_N 32, 2 warps": dict(decode=dict(BLOCK_N=32, num_warps=2, num_stages=4)),
}


def sweep_dense_decode(dev, g, m_list=(1, 8)):
    """The 16-bit dense GEMM's decode launch (``DENSE_DECODE_VARIANTS``, and split vs fused mode) on the bf16
    weights of a decode step: CUDA-graph median, the fraction of the copy bandwidth its bytes take, and its bits
    against the default's (the K chunks are the base tile's in every variant: the same bits expected)."""
    from dsv4.ops.triton import dense

    bw = measure_bandwidth(dev)
    out = {}
    for name, (n, k, chunk_rows, f32) in DENSE_DECODE.items():
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        for m in m_list:
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            nbytes = 2 * n * k + 2 * m * k + (4 if f32 else 2) * m * n
            ref = None
            for vname, c in (*DENSE_DECODE_VARIANTS.items(), ("split mode", "split"), ("fused mode", "fused")):
                kw = dict(chunk_rows=chunk_rows, out_dtype=torch.float32 if f32 else None)
                kw.update(mode=c) if isinstance(c, str) else kw.update(config=c or None)
                run = (lambda kw=kw: dense.dense_linear(x, w, **kw))
                try:
                    y = run()
                except Exception as e:  # noqa: BLE001 - a tile the compiler refuses is a row of the table
                    print(f"sweep dense_decode {name} M={m} {vname}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                same = "-" if ref is None else ("same bits" if torch.equal(y, ref) else "DIFFERS")
                ref = y if ref is None else ref
                ms = bench_graph(run, 40)
                frac = nbytes / bw / (ms * 1e-3) if ms else 0
                print(f"sweep dense_decode {name:28s} [{n}x{k}] M={m}: {ms * 1e3:6.1f} us {100 * frac:5.1f}% of bw "
                      f"{vname}: {same}", flush=True)
                out[f"dense_decode {name} M={m} {vname}"] = (ms, frac, same)
    return out


MHC_DECODE_VARIANTS = {  # name -> mhc CONFIG overrides ("SPLIT" cuts the mixes' sum in other slices: other bits)
    "default": {},
    **{f"MIX_BLOCK_T_DECODE {bt}": dict(MIX_BLOCK_T_DECODE=bt) for bt in (4, 16, 32)},
    **{f"MIX_WARPS {w}": dict(MIX_WARPS=w) for w in (2, 4)},
    "apart (hc_post, then hc_pre)": dict(POST_MIX_FUSED_MAX_T=0),
    "GATE_BLOCK_T 1": dict(GATE_BLOCK_T=1),
    "SPLIT 512": dict(SPLIT=512),
}
MHC_PREFILL_VARIANTS = {  # the same bits as the default: the tokens are the mixes MMA's N side
    "default": {},
    **{f"MIX_BLOCK_T {bt}": dict(MIX_BLOCK_T=bt) for bt in (32, 128)},
    **{f"MIX_WARPS_PREFILL {w}": dict(MIX_WARPS_PREFILL=w) for w in (1, 4)},
    "fused (mhc_post_pre in two launches)": dict(POST_MIX_FUSED_MAX_T=None),
    "GATE_BLOCK_T 8, GATE_WARPS 4": dict(GATE_BLOCK_T=8, GATE_WARPS=4),
}


def _mhc_inputs(dev, g, t, n, h):
    """(streams, sub-layer output, post, comb, fn, base, scale) for mhc_post_pre at the checkpoint's scales."""
    nmix = 2 * n + n * n
    s = (torch.randn(t, n, h, device=dev, generator=g) * 3).to(torch.bfloat16)
    o = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
    post = torch.rand(t, n, device=dev, generator=g) * 2
    comb = torch.softmax(torch.randn(t, n, n, device=dev, generator=g), -1)
    fn = torch.randn(nmix, n * h, device=dev, generator=g) / math.sqrt(n * h)
    base = torch.randn(nmix, device=dev, generator=g) * 0.5
    scale = torch.rand(3, device=dev, generator=g) * 0.5 + 0.5
    return s, o, post, comb, fn, base, scale


def sweep_mhc_decode(dev, g, t_list=(1, 8, 64), prefill_t=(1024, 8192)):
    """mhc_post_pre (hc_post + the next hc_pre: two launches a layer boundary) under the CONFIG overrides of
    ``MHC_DECODE_VARIANTS`` (decode sizes) and ``MHC_PREFILL_VARIANTS`` (prefill: hc_post, then hc_pre): CUDA-graph
    µs of the op and, for the default, of the gate launch alone; the bits against the default, and the largest
    gate and collapsed differences against the torch oracle (``dsv4.model.mhc``; collapsed relative to its
    largest value)."""
    from dsv4.model.opset import reference_ops
    from dsv4.ops.triton import mhc as tm

    ref = reference_ops()
    n, h, iters, hc_eps, rms_eps = 4, 4096, 20, 1e-6, 1e-6
    out = {}
    for t in (*t_list, *prefill_t):
        variants = MHC_DECODE_VARIANTS if t in t_list else MHC_PREFILL_VARIANTS
        s, o, post, comb, fn, base, scale = _mhc_inputs(dev, g, t, n, h)
        args = (s, o, post, comb, fn, base, scale, iters, hc_eps, rms_eps)
        pre_ref = ref.mhc_pre(ref.mhc_post(s, o, post, comb), fn, base, scale, iters, hc_eps, rms_eps)
        base_out = tm.mhc_post_pre(*args)
        cfg = dict(tm.CONFIG)
        part = tm._part(t, n, h, cfg, dev)[0].uniform_(0.5, 1.0, generator=g)  # the gate's time: not the values'
        y = base_out[0]
        gate_ms = bench_graph(lambda: tm._gates(part, y, base, scale, iters, hc_eps, rms_eps, cfg), 40)
        one_ms = bench_graph(lambda: tm._gates(part, y, base, scale, 1, hc_eps, rms_eps, cfg), 40)
        print(f"sweep mhc_decode T={t} gate launch alone {gate_ms * 1e3:7.1f} us ({one_ms * 1e3:.1f} with one "
              f"Sinkhorn iteration: the rest of the launch)", flush=True)
        out[f"mhc_decode T={t} gate alone"] = (gate_ms, one_ms)
        for vname, c in variants.items():
            run = (lambda c=c: tm.mhc_post_pre(*args, config=c))
            try:
                got = run()
            except Exception as e:  # noqa: BLE001 - a tile the compiler refuses is a row of the table
                print(f"sweep mhc_decode T={t} {vname:36s} {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            same = "same bits" if all(torch.equal(a, b) for a, b in zip(got, base_out)) else "other bits"
            d_gate = max((got[2] - pre_ref[1]).abs().max().item(), (got[3] - pre_ref[2]).abs().max().item())
            # relative to the output's scale: a near-zero collapsed value comes from cancellation (see kernels_mhc)
            d_col = ((got[1].float() - pre_ref[0].float()).abs().max() / pre_ref[0].float().abs().max()).item()
            ms = bench_graph(run, 40)
            print(f"sweep mhc_decode T={t} {vname:36s} {ms * 1e3:7.1f} us  {same}; vs oracle: gates {d_gate:.1e} "
                  f"collapsed rel {d_col:.1e}", flush=True)
            out[f"mhc_decode T={t} {vname}"] = (ms, same, d_gate, d_col)
    return out


# the loop form (``_gate_kernel``'s collapse program) and the rows form (``_collapse_rows_kernel`` beside
# ``_comb_kernel``); NORM_GATE_* are the loop form's launch and the post/comb program's
MHC_NORM_VARIANTS = {
    **{f"loop, {bt} token(s), {w} warp(s)": dict(NORM_ROWS=False, NORM_GATE_BLOCK_T=bt, NORM_GATE_WARPS=w)
       for bt, w in ((1, 1), (1, 2), (2, 2))},
    **{f"rows, {w} warps, comb {cw}": dict(NORM_ROWS=True, NORM_ROWS_WARPS=w, NORM_GATE_WARPS=cw)
       for w, cw in ((4, 2), (8, 2), (4, 1))},
}


def sweep_mhc_norm(dev, g, t_list=(1, 8, 64, 1024)):
    """mhc_post_pre with the next sub-layer's RMSNorm in its gate launch (``norm``) under the launch shapes of
    ``MHC_NORM_VARIANTS`` (the same bits at every one), against the former pair: mhc_post_pre without it, then
    the RMSNorm launch. CUDA-graph µs of the op and of the gate launch alone."""
    from dsv4.ops.triton import dense as td
    from dsv4.ops.triton import mhc as tm

    n, h, iters, hc_eps, rms_eps = 4, 4096, 20, 1e-6, 1e-6
    out = {}
    for t in t_list:
        s, o, post, comb, fn, base, scale = _mhc_inputs(dev, g, t, n, h)
        w = (torch.rand(h, device=dev, generator=g) + 0.5).to(torch.bfloat16)
        args = (s, o, post, comb, fn, base, scale, iters, hc_eps, rms_eps)

        def pair():
            y, x, p, c = tm.mhc_post_pre(*args)
            return y, td.rms_norm(x, w, rms_eps), p, c

        ms = bench_graph(pair, 40)
        print(f"sweep mhc_norm T={t} mhc_post_pre, then rms_norm     {ms * 1e3:7.1f} us", flush=True)
        out[f"mhc_norm T={t} pair"] = ms
        base_out = tm.mhc_post_pre(*args, w)
        for vname, c in MHC_NORM_VARIANTS.items():
            run = (lambda c=c: tm.mhc_post_pre(*args, w, config=c))
            same = "same bits" if all(torch.equal(a, b) for a, b in zip(run(), base_out)) else "other bits"
            ms = bench_graph(run, 40)
            cfg = dict(tm.CONFIG, **c)
            part = tm._part(t, n, h, cfg, dev)[0].uniform_(0.5, 1.0, generator=g)
            y = base_out[0]
            gate_ms = bench_graph(lambda: tm._gates(part, y, base, scale, iters, hc_eps, rms_eps, cfg, w), 40)
            print(f"sweep mhc_norm T={t} norm in the gate, {vname:22s} {ms * 1e3:7.1f} us (gate launch "
                  f"{gate_ms * 1e3:.1f})  {same}", flush=True)
            out[f"mhc_norm T={t} {vname}"] = (ms, gate_ms, same)
    return out


def sweep_route(dev, g, t_list=ROUTE_SWEEP_T, timer=None, block_ts=(1, 2, 4, 8, 16), warps=(1, 2, 4)):
    """moe_route's launch shape (``config``: BLOCK_T rows × num_warps per program; the default is
    ``route_config``; 16 rows × 4 warps before this sweep ran: ~40 us on the H200 at any T ≤ 64,
    latency-bound; now one row per program): every candidate timed at each T (CUDA-graph median of the scored
    routing with
    bias and padding rows) and checked bit-exact against the default's ids and weights, scored and
    hash-routed. ``timer(fn) -> ms`` defaults to the CUDA-graph median (a stand-in allows a CPU
    dry run under TRITON_INTERPRET=1)."""
    from dsv4.ops.triton import moe as tmoe

    timer = timer or (lambda fn: bench_graph(fn, 30))
    bias = torch.randn(N_EXP, device=dev, generator=g) * 0.1
    cases = []
    for t in t_list:
        logits = torch.randn(t, N_EXP, device=dev, generator=g) * 2
        valid = torch.rand(t, device=dev, generator=g) > 0.05
        hash_ids = torch.randint(0, N_EXP, (t, TOPK), device=dev, generator=g)
        scored = (logits, bias, TOPK, 1.5, True, None, valid)
        hashed = (logits, None, TOPK, 1.5, True, hash_ids, valid)
        cases.append((t, scored, hashed, tmoe.moe_route(*scored), tmoe.moe_route(*hashed)))
    default = tmoe.route_config(N_EXP)
    cands = [dict(BLOCK_T=bt, num_warps=wp) for bt in block_ts for wp in warps]
    if default not in cands:
        cands.append(default)
    same = lambda a, b: torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # noqa: E731
    rows = []
    for c in cands:
        times, check = [], "ok"
        for t, scored, hashed, ref, href in cases:
            try:
                if not (same(tmoe.moe_route(*scored, config=c), ref) and same(tmoe.moe_route(*hashed, config=c), href)):
                    check = f"FAIL T={t}"
                times.append(timer(lambda: tmoe.moe_route(*scored, config=c)))
            except Exception as e:  # noqa: BLE001
                check, times = f"{type(e).__name__}: {e}"[:120], times + [None]
        rows.append((times, c, check))
        tag = " (default)" if c == default else ""
        print(
            "sweep moe_route "
            + " ".join(f"T={t}:{ms * 1e3:.1f}us" if ms else f"T={t}:-" for (t, *_), ms in zip(cases, times))
            + f" {c}{tag} {check}",
            flush=True,
        )
    for i, (t, *_) in enumerate(cases):
        ok = sorted([r for r in rows if r[0][i] and r[2] == "ok"], key=lambda r: r[0][i])
        print(
            f"sweep moe_route best at T={t}: " + "; ".join(f"{r[0][i] * 1e3:.1f}us {r[1]}" for r in ok[:3]), flush=True
        )
    return {
        "moe_route": [
            ([round(ms * 1e3, 1) if ms else None for ms in times], str(c), check) for times, c, check in rows
        ],
        "moe_route_T": list(t_list),
    }


MOE_BLOCK_K_TILES = {  # T -> (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates at every K step
    1: ((16, 64, 4, 3), (16, 64, 8, 3)),
    8: ((16, 64, 4, 3), (16, 64, 8, 3)),
    64: ((16, 64, 4, 3), (16, 64, 8, 3)),
    1024: ((32, 64, 4, 3), (32, 64, 4, 2)),
    8192: ((128, 128, 8, 3), (128, 128, 8, 2), (64, 128, 8, 3)),
}


def sweep_moe_block_k(dev, g, block_ks=(128, 256, 512)):
    """The grouped MXFP4 kernels' K step. Each program reads BLOCK_K/2 bytes of each of its weight
    rows per step (64 at the engine's 128), rows 2 KiB apart: short DRAM bursts. A wider step reads
    longer runs but changes the sum's grouping, so it must be the same at the decode and the prefill
    tiles (batch invariance): every prefill candidate is bit-compared with the first decode
    candidate of its K step run on the same tokens. CUDA-graph µs, the bound, the check vs torch."""
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import moe as tmoe

    bw, peak = measure_bandwidth(dev), measure_peak(dev)
    print(f"moe_block_k: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    w13, s13, w2, s2 = random_fp4_experts(dev, g)
    per_expert = w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel()
    rows = []
    for t, tiles in MOE_BLOCK_K_TILES.items():
        x = torch.randn(t, HID, device=dev, dtype=torch.bfloat16, generator=g)
        ids, wts = torch_ops.moe_route(torch.randn(t, N_EXP, device=dev, generator=g), None, TOPK, 1.5, True)
        ref = torch_ops.moe_experts(x, ids, wts, w13, s13, w2, s2)
        used = int(torch.unique(ids).numel())
        nbytes = used * per_expert + 2 * t * HID * 2 + t * TOPK * HID * 2 * 2 + t * TOPK * INTER * 2 * 2
        flops = t * TOPK * 6 * HID * INTER
        bound = max(nbytes / bw, flops / peak) * 1e3
        for bk in block_ks:
            dec = dict(
                zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), MOE_BLOCK_K_TILES[1][0]),
                direct=False,
                BLOCK_K=bk,
            )
            want = None
            if t > 64:
                try:
                    want = tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=dec)
                except Exception as e:  # noqa: BLE001
                    print(f"moe_block_k T={t} BLOCK_K={bk}: decode tile fails: {type(e).__name__}", flush=True)
            for tile in tiles:
                c = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), tile), direct=False, BLOCK_K=bk)
                run = lambda c=c: tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=c)  # noqa: E731
                try:
                    y = run()
                    chk = check_close(y, ref)
                    inv = (
                        "decode tile"
                        if want is None
                        else ("same bits as decode tile" if torch.equal(y, want) else "DIFFERS from decode tile")
                    )
                    ms = bench_graph(run, 60)
                except Exception as e:  # noqa: BLE001
                    ms, chk, inv = None, f"{type(e).__name__}: {str(e)[:80]}", "-"
                rows.append(
                    dict(
                        T=t, BLOCK_K=bk, tile=tile, us=ms and ms * 1e3, bound_us=bound * 1e3, check=chk, invariance=inv
                    )
                )
                txt = f"{ms * 1e3:9.1f} us ({bound / ms:5.1%} of {bound * 1e3:.1f})" if ms else f"{'-':>30}"
                print(f"moe_block_k T={t:5d} BLOCK_K={bk:3d} {tile}: {txt}  {chk}  {inv}", flush=True)
    return {"moe_block_k": rows, "bandwidth_Bps": bw, "bf16_peak_flops": peak}


MOE_MAXNREG = (
    {"maxnreg": 96},
    {"maxnreg": 80},
    {"down_maxnreg": 80},
    {"down_maxnreg": 64},
    {"maxnreg": 96, "down_maxnreg": 80},
)
MOE_SCALE_AHEAD = (
    {"scale_ahead": True},
    {"scale_ahead": True, "maxnreg": 96},
    {"scale_ahead": True, "maxnreg": 96, "down_maxnreg": 80},
)


def sweep_moe_maxnreg(dev, g, t_list=(1, 8, 64, 1024)):
    """The grouped MXFP4 kernels at the engine's tiles with register caps (``maxnreg`` for the up
    kernel, ``down_maxnreg`` for the down one): at the decode tile the up kernel takes 119 registers
    (4 programs of 4 warps per SM; ptxas, sm_90a: 96 spills 4 bytes, 80 spills 104). CUDA-graph µs
    against the uncapped launch, whose bits each capped one must give (the PTX is the same)."""
    return {"moe_maxnreg": _sweep_moe_variants(dev, g, "moe_maxnreg", MOE_MAXNREG, t_list)}


def sweep_moe_kperm(dev, g, t_list=(1, 8, 64, 1024, 8192)):
    """The grouped MXFP4 kernels with the K order of the MMA operands permuted (``kperm``, default)
    against the memory order (``kperm=False``): CUDA-graph µs; the two differ in bits (another
    summation order), so each is checked against the torch op, and at T > 64 the default prefill
    tile is bit-compared with the decode tile run on the same tokens (batch invariance)."""
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import moe as tmoe

    w13, s13, w2, s2 = random_fp4_experts(dev, g)
    dec = dict(direct=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    rows = []
    for t in t_list:
        x = torch.randn(t, HID, device=dev, dtype=torch.bfloat16, generator=g)
        ids, wts = torch_ops.moe_route(torch.randn(t, N_EXP, device=dev, generator=g), None, TOPK, 1.5, True)
        ref = torch_ops.moe_experts(x, ids, wts, w13, s13, w2, s2) if t <= 1024 else None
        for cfg in ({}, {"kperm": False}):
            run = lambda cfg=cfg: tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=cfg)  # noqa: E731
            y = run()
            chk = check_close(y, ref) if ref is not None else "-"
            inv = "-"
            if t > 64:
                y_dec = tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=dict(dec, **cfg))
                inv = (
                    "same bits as decode tile"
                    if torch.equal(y, y_dec)
                    else f"DIFFERS from decode tile ({(y != y_dec).sum().item()} values)"
                )
            ms = bench_graph(run, 60)
            rows.append(dict(T=t, config=cfg, us=ms and ms * 1e3, check=chk, invariance=inv))
            print(f"moe_kperm T={t:5d} {str(cfg):18s} {ms * 1e3:9.1f} us  {chk}  {inv}", flush=True)
    return {"moe_kperm": rows}


def sweep_moe_fold(dev, g, t_list=(1, 8, 64, 1024, 8192)):
    """The grouped MXFP4 kernels with the folded decode (``fold_scales``, the default where every scale
    code is ≤ 128: one multiply per value pair by 2^(b-1)) against the two-multiply decode
    (``fold_scales=False``). Same values, so the two must give the same bits. CUDA-graph µs."""
    from dsv4.ops.triton import moe as tmoe

    experts = random_fp4_experts(dev, g)
    s13, s2 = experts[1], experts[3]
    print(
        f"moe_fold: codes <= {tmoe.FOLD_MAX_CODE}: s13 {tmoe._fold_ok(s13, s13)}, s2 {tmoe._fold_ok(s2, s2)} "
        f"(max codes {int(s13.max())}, {int(s2.max())})",
        flush=True,
    )
    return {"moe_fold": _sweep_moe_variants(dev, g, "moe_fold", ({"fold_scales": False},), t_list, experts)}


MOE_TILES = (
    {"num_stages": 2},
    {"num_stages": 4},
    {"num_stages": 5},
    {"BLOCK_N": 128},
    {"BLOCK_N": 128, "num_warps": 8},
    {"BLOCK_N": 128, "num_warps": 8, "num_stages": 4},
    {"down_BLOCK_N": 128},
    {"down_BLOCK_N": 128, "down_num_warps": 8},
    {"down_num_stages": 4},
    {"down_num_stages": 5},
)


def sweep_moe_tiles(dev, g, t_list=(1, 8, 64)):
    """The batch-invariant decode tile after the folded decode changed its instruction mix: column width,
    warps and stages of the up and down kernels (BLOCK_K and the K order fixed, so the bits must stay the
    default's). CUDA-graph µs at T = 1, 8, 64."""
    return {"moe_tiles": _sweep_moe_variants(dev, g, "moe_tiles", MOE_TILES, t_list)}


MOE_TAIL = ({"tail": False}, {"tail_num_warps": 4}, {"tail_BLOCK_N": 64, "tail_num_warps": 4}, {"tail_num_stages": 4})


MOE_MERGE = ({"merge_gu": True}, {"merge_gu": True, "num_stages": 4}, {"merge_gu": True, "num_warps": 8},
             {"merge_gu": True, "BLOCK_N": 32})


def sweep_moe_merge(dev, g, t_list=(1, 8, 64)):
    """The MXFP4 up kernel's gate and up rows as one 2·BLOCK_N-row MMA operand (``merge_gu``: two MMA groups a
    K step instead of four) at the decode tile and around it; a row's products and their order do not change,
    so every variant must give the default's bits. CUDA-graph µs."""
    return {"moe_merge": _sweep_moe_variants(dev, g, "moe_merge", MOE_MERGE, t_list)}


MOE_ONE_DOT = ({"one_dot": True}, {"one_dot": False})


def sweep_moe_one_dot(dev, g, t_list=(1, 8, 64, 1024, 8192)):
    """The grouped MXFP4 kernels' K step as one MMA over both nibble halves (``one_dot``: the even-k and odd-k
    tiles joined along K, one wait for the MMAs a K step instead of two) and as two, at the engine's tiles (the
    default: two at the decode tile, one at the prefill tiles); the same k16 MMAs in the same order, so every
    variant must give the default's bits. CUDA-graph µs."""
    return {"moe_one_dot": _sweep_moe_variants(dev, g, "moe_one_dot", MOE_ONE_DOT, t_list)}


def sweep_moe_tail(dev, g, t_list=(1024, 2048, 4096, 8192)):
    """The prefill tiles with an expert's last block run at half the rows when its second half is empty
    (``tail``, the default) against one launch over all blocks (``tail=False``), and the tail launch's
    own width, warps and stages. A row's K steps do not change, so every variant must give the default's
    bits. CUDA-graph µs."""
    return {"moe_tail": _sweep_moe_variants(dev, g, "moe_tail", MOE_TAIL, t_list)}


def sweep_moe_scale_ahead(dev, g, t_list=(1, 8, 64, 1024, 8192)):
    """The grouped MXFP4 kernels at the engine's tiles with the next K step's scale bytes loaded
    during this one (``scale_ahead``; byte loads stay synchronous loads in the loop, below
    ``cp.async``'s 4-byte minimum), alone and with the register caps. CUDA-graph µs against the
    default launch, whose bits each variant must give (the same values reach the same instructions)."""
    return {"moe_scale_ahead": _sweep_moe_variants(dev, g, "moe_scale_ahead", MOE_SCALE_AHEAD, t_list)}


def sweep_moe_scale_layout(dev, g, t_list=(1, 8, 64, 1024, 8192)):
    """The MXFP4 scales' memory layout. Stored as in the checkpoint ([rows, groups], a row's groups
    adjacent), a K step's 64-row tile needs 4 bytes from each of 64 rows, 128 bytes apart: one
    32-byte sector per row (ncu, T = 64: 45 % of the up kernel's L2 sector requests are excess).
    Groups-major (``rows_contiguous``), the tile's bytes for one group are 64 adjacent bytes. Same
    values, so each variant must give the default launch's bits. CUDA-graph µs."""
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import moe as tmoe

    w13, s13t, w2, s2t = random_fp4_experts(dev, g)  # groups-major (the engine's layout)
    s13, s2 = s13t.contiguous(), s2t.contiguous()  # the checkpoint's layout
    rows = []
    for t in t_list:
        x = torch.randn(t, HID, device=dev, dtype=torch.bfloat16, generator=g)
        ids, wts = torch_ops.moe_route(torch.randn(t, N_EXP, device=dev, generator=g), None, TOPK, 1.5, True)
        base = tmoe.moe_experts(x, ids, wts, w13, s13t, w2, s2t)
        for name, sa, sb, cfg in (
            ("checkpoint", s13, s2, {}),
            ("checkpoint", s13, s2, {"scale_ahead": False}),
            ("rows-contiguous", s13t, s2t, {}),
            ("rows-contiguous", s13t, s2t, {"scale_ahead": False}),
        ):
            ms, same = _bitwise_trial(
                lambda sa=sa, sb=sb, cfg=cfg: tmoe.moe_experts(x, ids, wts, w13, sa, w2, sb, config=cfg), base
            )
            rows.append(dict(T=t, scales=name, config=cfg, us=ms and ms * 1e3, bits=same))
            txt = f"{ms * 1e3:9.1f} us" if ms else f"{'-':>12}"
            print(f"moe_scale_layout T={t:5d} {name:16s} {str(cfg):24s} {txt}  {same}", flush=True)
    return {"moe_scale_layout": rows}


def _sweep_moe_variants(dev, g, name, variants, t_list, experts=None):
    """Each config override in ``variants`` at each T against the engine's default launch: µs and bits
    (``experts``: the (w13, s13, w2, s2) to run, else new random ones)."""
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import moe as tmoe

    w13, s13, w2, s2 = experts if experts is not None else random_fp4_experts(dev, g)
    rows = []
    for t in t_list:
        x = torch.randn(t, HID, device=dev, dtype=torch.bfloat16, generator=g)
        ids, wts = torch_ops.moe_route(torch.randn(t, N_EXP, device=dev, generator=g), None, TOPK, 1.5, True)
        base = tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2)
        for cap in ({},) + tuple(variants):
            ms, same = _bitwise_trial(lambda cap=cap: tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=cap), base)
            rows.append(dict(T=t, config=cap, us=ms and ms * 1e3, bits=same))
            txt = f"{ms * 1e3:9.1f} us" if ms else f"{'-':>12}"
            print(f"{name} T={t:5d} {str(cap):60s} {txt}  {same}", flush=True)
    return rows


def sweep_moe_split_probe(dev, g, splits=(2, 4)):
    """Whether the batch-1 grouped MXFP4 kernels would gain from K split over programs, before the kernels
    change: one token over 6 experts at Flash's shapes (C) against one token over 6·s experts whose hidden size
    is H / s (each up program's K loop 1/s as long, s times the programs, the same weight bytes: the up kernel of
    a split by s; its down kernel is C's) and whose intermediate size is I / s (the down kernel of a split by s;
    its up kernel is C's). CUDA-graph µs of the whole op (weights cold: 256 experts a stack): C − A is what a
    split up kernel saves before its partials' sum, C − B the down kernel's."""
    from dsv4.ops.triton import moe as tmoe

    def time_op(h, i, k):
        w13, s13, w2, s2 = random_fp4_experts(dev, g, h, i)
        x = torch.randn(1, h, device=dev, dtype=torch.bfloat16, generator=g)
        ids = torch.arange(k, device=dev, dtype=torch.long).view(1, k) * (N_EXP // k)
        wts = torch.full((1, k), 1.0 / k, device=dev)
        return bench_graph(lambda: tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2)) * 1e3

    base = time_op(HID, INTER, TOPK)
    rows = [dict(variant="C: 6 experts, H, I", us=base)]
    print(f"moe_split_probe C: 6 experts H={HID} I={INTER}: {base:8.1f} us", flush=True)
    for s in splits:
        a = time_op(HID // s, INTER, TOPK * s)
        b = time_op(HID, INTER // s, TOPK * s)
        rows += [dict(variant=f"A{s}: up split by {s}", us=a), dict(variant=f"B{s}: down split by {s}", us=b)]
        print(f"moe_split_probe s={s}: A (up K/{s}, {TOPK * s} experts) {a:8.1f} us: up saves {base - a:6.1f} us; "
              f"B (down K/{s}) {b:8.1f} us: down saves {base - b:6.1f} us", flush=True)
    return {"moe_split_probe": rows}


def sweep_moe_waves(dev, g, used=(1, 2, 3, 4, 5, 6, 8, 12)):
    """One token whose top-k holds 1..12 distinct experts: the grouped kernels' decode tile launches 32 up and
    32 down programs an expert (more than 4 experts: more programs than the H200's 132 SMs). CUDA-graph µs of
    the whole op and its bits against the default's, at the default tile, at 32 and 128 up columns (twice /
    half the programs, half / twice the rows each; 128 also at 8 warps) and a 256-column down tile: whether a
    batch-1 step's MoE time follows its waves of programs or each program's K loop."""
    from dsv4.ops.triton import moe as tmoe

    w13, s13, w2, s2 = random_fp4_experts(dev, g)
    x = torch.randn(1, HID, device=dev, dtype=torch.bfloat16, generator=g)
    rows = []
    for k in used:
        ids = torch.arange(k, device=dev, dtype=torch.long).view(1, k) * (N_EXP // max(used))
        wts = torch.full((1, k), 1.0 / k, device=dev)
        base = tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2)
        for cap in ({}, {"BLOCK_N": 32}, {"BLOCK_N": 128}, {"BLOCK_N": 128, "num_warps": 8}, {"down_BLOCK_N": 256}):
            ms, same = _bitwise_trial(lambda cap=cap: tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=cap), base)
            rows.append(dict(experts=k, config=cap, us=ms and ms * 1e3, bits=same))
            txt = f"{ms * 1e3:8.1f} us  ({ms * 1e3 / k:6.1f} us an expert)" if ms else "-"
            print(f"moe_waves experts={k:2d} {str(cap):36s} {txt}  {same}", flush=True)
    return {"moe_waves": rows}


def sweep_moe_decode(dev, g, w13, s13, w2, s2, narrow: bool = False):
    """The batch-invariant decode tile of the grouped MoE kernels (``pick_moe_config``: one tile for
    every T ≤ DECODE_MAX_ROWS, so a token's rows are computed the same way in any batch): each
    candidate timed at T = 1, 8, 64 and checked against the current tile's output (bf16 rounding)."""
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import moe as tmoe

    base = dict(direct=False, BLOCK_M=16)
    cands = [
        dict(base, BLOCK_N=bn, BLOCK_K=bk, num_warps=wp, num_stages=st)
        for bn in (32, 64, 128)
        for bk in (128, 256)
        for wp in (2, 4, 8)
        for st in (2, 3, 4, 5)
    ]
    if narrow:  # the second sweep, around the first one's winner (32 columns, 2 warps)
        cands = [
            dict(base, BLOCK_N=bn, BLOCK_K=128, num_warps=wp, num_stages=st)
            for bn in (16, 32)
            for wp in (1, 2, 4)
            for st in (3, 4)
        ]
    cases = []
    for t in (1, 8, 64):
        x = torch.randn(t, HID, device=dev, dtype=torch.bfloat16, generator=g)
        ids, wts = torch_ops.moe_route(torch.randn(t, N_EXP, device=dev, generator=g), None, TOPK, 1.5, True)
        ref = tmoe.moe_experts(
            x, ids, wts, w13, s13, w2, s2, config=dict(base, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
        )
        cases.append((t, x, ids, wts, ref))
    rows = []
    for c in cands:
        times, check = [], "ok"
        for t, x, ids, wts, ref in cases:
            try:
                y = tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=c)
                r = check_close(y, ref)
                check = r if r != "ok" else check
                times.append(bench_graph(lambda: tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=c), 30))
            except Exception as e:  # noqa: BLE001
                check = f"{type(e).__name__}"
                break
        if len(times) == len(cases):
            rows.append((times, c, check))
    rows.sort(key=lambda r: r[0][2])  # by T=64: the batch the decode throughput target is about
    for times, c, check in rows[:12]:
        print(
            "sweep moe_decode "
            + " ".join(f"T={t}:{ms * 1e3:.1f}us" for (t, *_), ms in zip(cases, times))
            + f" {c} {check}",
            flush=True,
        )
    return {"moe_decode": [([round(ms * 1e3, 1) for ms in times], str(c), check) for times, c, check in rows]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    ap.add_argument(
        "--only",
        default="linear,route,group,pick,moe,attention,indexer,mhc",
        help="comma list of: linear, route, group, pick, moe (this file), attention, indexer, mhc "
        "(bench/kernels_attention.py, kernels_indexer.py, kernels_mhc.py)",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="time candidate tile configurations instead "
        "(--only linear,linear_decode,linear_act_quant,mhc_decode,mhc_norm,dense_decode,mma_rate,persistent,route,"
        "moe,moe_decode,"
        "moe_decode_narrow,"
        "moe_waves,"
        "moe_prefill,linear_prefill,moe_block_k,"
        "moe_maxnreg,moe_scale_ahead,moe_scale_layout,moe_kperm,moe_fold,moe_tiles,moe_tail,moe_merge,moe_one_dot)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a GPU (torch.cuda.is_available() is False)")
    dev = torch.device("cuda")
    import triton

    from dsv4.ops.platform import detect_platform

    t0 = time.time()
    if args.sweep:
        res = sweep(dev, set(args.only.split(",")))
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))
        print(f"sweep done in {time.time() - t0:.0f} s")
        return 0
    plat = detect_platform()
    bw, peak = measure_bandwidth(dev), measure_peak(dev)
    print(f"{plat.describe()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"measured: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul peak {peak / 1e12:.0f} TFLOP/s\n")
    print(
        f"{'kernel':<12} {'shape':<28} {'backend':<10} {'do_bench median':>21}  {'CUDA-graph median':>21}  "
        f"{'bound':>25}  check"
    )
    tab = Table(bw, peak)
    only = set(args.only.split(","))
    if "linear" in only:
        bench_linears(tab, dev, (1, 64, 8192) if args.quick else LINEAR_M)
    if "route" in only:
        bench_route(tab, dev)
    if "group" in only:
        bench_group(tab, dev)
    if "pick" in only:
        bench_pick(tab, dev)
    if "moe" in only:
        bench_moe(tab, dev, (1, 64) if args.quick else MOE_T)
    extra = {}
    for part in ("attention", "indexer", "mhc"):  # the issue-8 kernels, each with its own table
        if part in only:
            import importlib

            rows: list = []
            try:
                importlib.import_module(f"kernels_{part}").run(dev, rows)
            except Exception as e:  # one suite failing must not hide the others' numbers
                rows.append({"error": f"{type(e).__name__}: {e}"[:400]})
                print(f"kernels_{part}: {rows[-1]['error']}")
            extra[part] = rows
    res = dict(
        platform=plat.describe(),
        torch=torch.__version__,
        triton=triton.__version__,
        bandwidth_Bps=bw,
        bf16_peak_flops=peak,
        rows=tab.rows,
        seconds=time.time() - t0,
        **extra,
    )
    fails = [r for r in tab.rows if str(r["check"]).startswith("FAIL")]
    print(f"\n{len(tab.rows)} rows, {len(fails)} failed checks, {res['seconds']:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
