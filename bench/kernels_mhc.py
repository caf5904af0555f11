"""Microbenchmark of the fused mHC and batch-invariant dense kernels: torch oracle vs Triton.

Cases (DeepSeek-V4-Flash widths): hc_pre and hc_post at T = 1, 64, 8192 with H = 4096, n = 4;
dense_linear vs torch.nn.functional.linear at M = 1, 64, 8192 for the head (129280×4096, bf16)
and a compressor-like weight (1024×4096, bf16). Every case is first checked (Triton vs torch on
the same inputs, and batch invariance: row 0 of the T/M-row launch == the row launched alone),
then timed: median of CUDA-graph replays (no launch overhead) and of plain launches
(``triton.testing.do_bench``). Copy bandwidth and the bf16 matmul peak are measured in the same
run; bound = max(bytes / bandwidth, FLOPs / peak), "of bound" = bound / Triton graph time. The
mHC mixes GEMM of bf16 streams is three bf16 tensor-core dots (an exact split of the fp32 fn); of
fp32 streams IEEE fp32 (CUDA-core FMA, ~1/10 of the bf16 peak), whose real ceiling at T = 8192 is
below the bf16-peak bound shown.

    PYTHONPATH=. python3 bench/kernels_mhc.py [--out mhc.json]   # on the GPU
    PYTHONPATH=. python3 bench/kernels_mhc.py --small             # CPU interpreter smoke test

``run(device, results)`` appends one dict per (case, backend) to ``results`` (for bench drivers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N_HC, ITERS, HC_EPS, RMS_EPS = 4, 20, 1e-6, 1e-6
FULL = dict(hidden=4096, tokens=(1, 64, 8192), linears={"head": (129280, 4096), "compressor": (1024, 4096)},
            rows=(1, 64, 8192))
SMALL = dict(hidden=256, tokens=(1, 8), linears={"head": (520, 256), "compressor": (128, 256)}, rows=(1, 8))


def _timers(dev):
    """(plain, graph) timers returning ms; CPU: one perf_counter run each (interpreter smoke)."""
    if dev.type != "cuda":
        def once(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return once, lambda fn: None
    import triton.testing

    def plain(fn):
        return float(triton.testing.do_bench(fn, warmup=15, rep=60, return_mode="median"))

    def graph(fn):
        try:
            return float(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median"))
        except Exception:  # noqa: BLE001 - not capturable (host sync)
            torch.cuda.synchronize()
            return None
    return plain, graph


def measure_bandwidth(dev) -> float:
    """Device-to-device copy of 4 GiB: bytes read + written per second."""
    import triton.testing

    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = float(triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median"))
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


def measure_peak(dev) -> float:
    """bf16 torch.matmul 8192³ on random data, FLOP/s."""
    import triton.testing

    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = float(triton.testing.do_bench(lambda: torch.matmul(a, b), warmup=25, rep=300, return_mode="median"))
    return 2 * 8192 ** 3 / (ms * 1e-3)


def _row(results, op, shape, backend, plain, graph, nbytes, flops, bw, peak, check):
    bound = max(nbytes / bw, flops / peak) * 1e3 if bw else None
    t = graph if graph is not None else plain
    r = dict(kernel=op, shape=shape, backend=backend, ms=plain, graph_ms=graph, bytes=nbytes, flops=flops,
             bound_ms=bound, bound=None if not bw else ("memory" if nbytes / bw >= flops / peak else "compute"),
             fraction=bound / t if bound and t else None, check=check)
    results.append(r)
    g = f"{graph * 1e3:10.1f}" if graph is not None else f"{'-':>10}"
    b = f"{bound * 1e3:8.1f} ({r['bound'][:3]})" if bound else f"{'-':>14}"
    f = f"{100 * r['fraction']:5.1f}%" if r["fraction"] else f"{'-':>6}"
    print(f"{op:<12} {shape:<30} {backend:<8} {plain * 1e3:10.1f} {g} {b} {f}  {check}", flush=True)


def _hc_inputs(t, h, g, dev):
    nmix = 2 * N_HC + N_HC * N_HC
    s = (torch.randn(t, N_HC, h, device=dev, generator=g) * 3).to(torch.bfloat16)
    fn = torch.randn(nmix, N_HC * h, device=dev, generator=g) / math.sqrt(N_HC * h)
    base = torch.randn(nmix, device=dev, generator=g) * 0.5
    scale = torch.rand(3, device=dev, generator=g) * 0.5 + 0.5
    return s, fn, base, scale


def bench_mhc(results, dev, shapes, bw, peak):
    from dsv4.model import mhc as ref
    from dsv4.ops.triton import mhc as tm

    plain, graph = _timers(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    h = shapes["hidden"]
    for t in shapes["tokens"]:
        s, fn, base, scale = _hc_inputs(t, h, g, dev)
        args = (s, fn, base, scale, ITERS, HC_EPS, RMS_EPS)
        a, o = tm.hc_pre(*args), ref.hc_pre(*args)
        d_gate = max((a[1] - o[1]).abs().max().item(), (a[2] - o[2]).abs().max().item())
        d_col = ((a[0].float() - o[0].float()).abs() / (o[0].float().abs() + 1e-3)).max().item()
        alone = tm.hc_pre(s[:1], fn, base, scale, ITERS, HC_EPS, RMS_EPS)
        inv = all(torch.equal(x[0], y[0]) for x, y in zip(a, alone))
        chk = f"gates {d_gate:.1e} col rel {d_col:.1e} inv {'ok' if inv else 'FAIL'}"
        if d_gate > 1e-5 or d_col > 2 ** -7 or not inv:
            chk = "FAIL " + chk
        # minimal traffic: streams and fn read once, collapsed/post/comb written
        nbytes = s.numel() * 2 + fn.numel() * 4 + t * h * 2 + t * (N_HC + N_HC * N_HC) * 4
        flops = 2 * t * fn.shape[0] * fn.shape[1] + 2 * t * N_HC * h
        shape = f"T={t} H={h} n={N_HC}"
        _row(results, "hc_pre", shape, "torch", plain(lambda: ref.hc_pre(*args)), graph(lambda: ref.hc_pre(*args)),
             nbytes, flops, bw, peak, chk)
        _row(results, "hc_pre", shape, "triton", plain(lambda: tm.hc_pre(*args)), graph(lambda: tm.hc_pre(*args)),
             nbytes, flops, bw, peak, chk)
        out = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
        pargs = (s, out, o[1], o[2])
        y, yo = tm.hc_post(*pargs), ref.hc_post(*pargs)
        # relative to the output's scale: near-zero outputs come from cancellation, where one bf16
        # rounding of an O(1) term is already a large relative error
        d = ((y.float() - yo.float()).abs().max() / yo.float().abs().max()).item()
        chk = f"rel {d:.1e}" if d <= 2 ** -7 else f"FAIL rel {d:.1e}"
        nbytes = (2 * N_HC + 1) * t * h * 2 + t * (N_HC + N_HC * N_HC) * 4
        flops = 2 * t * N_HC * (N_HC + 1) * h
        _row(results, "hc_post", shape, "torch", plain(lambda: ref.hc_post(*pargs)),
             graph(lambda: ref.hc_post(*pargs)), nbytes, flops, bw, peak, chk)
        _row(results, "hc_post", shape, "triton", plain(lambda: tm.hc_post(*pargs)),
             graph(lambda: tm.hc_post(*pargs)), nbytes, flops, bw, peak, chk)
        del s, out, a, o, y, yo


def bench_dense(results, dev, shapes, bw, peak):
    from dsv4.ops.triton import dense as td

    plain, graph = _timers(dev)
    g = torch.Generator(device=dev).manual_seed(1)
    F = torch.nn.functional
    for name, (n, k) in shapes["linears"].items():
        w = (torch.randn(n, k, device=dev, generator=g) / math.sqrt(k)).to(torch.bfloat16)
        for m in shapes["rows"]:
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            y, ref = td.dense_linear(x, w), F.linear(x, w)
            rows = slice(0, min(m, 256))  # the check on a row subset keeps the M = 8192 head cheap
            ap = x[rows].float().abs() @ w.float().abs().T
            d = (y[rows].float() - ref[rows].float()).abs()
            worst = (d / (2 ** -7 * ref[rows].float().abs() + 1e-5 * ap + 1e-30)).max().item()
            inv = torch.equal(td.dense_linear(x[:1], w)[0], y[0])
            chk = f"x{worst:.2f} of tol, inv {'ok' if inv else 'FAIL'}"
            if worst > 1 or not inv:
                chk = "FAIL " + chk
            del ap, d, ref, y
            nbytes = 2 * (n * k + m * k + m * n)
            flops = 2 * m * n * k
            shape = f"{name} M={m} N={n} K={k}"
            _row(results, "dense_linear", shape, "torch", plain(lambda: F.linear(x, w)), graph(lambda: F.linear(x, w)),
                 nbytes, flops, bw, peak, chk)
            _row(results, "dense_linear", shape, "triton", plain(lambda: td.dense_linear(x, w)),
                 graph(lambda: td.dense_linear(x, w)), nbytes, flops, bw, peak, chk)
        del w
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# hc_pre's mixes-GEMM tiles (each a constant for every T: it sets a token's summation order).
# At decode the default (32 programs of 32 serial 16-column steps) is latency-bound.
MIX_SWEEP = [dict(SPLIT=sp, MIX_BLOCK_T=bt, MIX_BLOCK_K=bk)
             for sp, bt, bk in ((512, 64, 16), (256, 64, 16), (128, 64, 16), (512, 64, 32), (256, 32, 32),
                                (128, 32, 32), (128, 16, 32), (64, 16, 32), (256, 16, 64))]
MIX_SWEEP += [dict(MIX_BF16X3=False)]  # the fp32 FMA mixes, against the default tensor-core ones


def sweep_mix(results, dev, shapes):
    """hc_pre per MIX_SWEEP config (tile constants, or the gate kernel's GATE_BLOCK_T / GATE_WARPS / H_SLICE):
    CUDA-graph µs at each T, gates' max |Δ| vs the oracle, batch invariance (row 0 of the T-row launch ==
    row 0 launched alone) and whether every output has the default config's bits. A config's ``iters``
    (a diagnostic, not a setting: the Sinkhorn's iteration count) times the op with fewer iterations."""
    from dsv4.model import mhc as ref
    from dsv4.ops.triton import mhc as tm

    _, graph = _timers(dev)
    g = torch.Generator(device=dev).manual_seed(1)
    cases = [(t, _hc_inputs(t, shapes["hidden"], g, dev)) for t in shapes["tokens"]]
    # the oracle's and the default config's outputs per (T, iters): computed once, not per config (the float64
    # oracle at T = 8192 dominated the sweep's time)
    wanted: dict = {}
    for cfg in MIX_SWEEP:
        row = dict(op="hc_pre sweep", config=cfg)
        cfg = dict(cfg)
        iters = cfg.pop("iters", ITERS)
        for t, (s, fn, base, scale) in cases:
            args = (s, fn, base, scale, iters, HC_EPS, RMS_EPS)
            try:
                a = tm.hc_pre(*args, config=cfg)
                if (t, iters) not in wanted:
                    wanted[t, iters] = (ref.hc_pre(*args), tm.hc_pre(*args))
                o, default = wanted[t, iters]
                alone = tm.hc_pre(s[:1], fn, base, scale, iters, HC_EPS, RMS_EPS, config=cfg)
                d = max((a[1] - o[1]).abs().max().item(), (a[2] - o[2]).abs().max().item())
                inv = all(torch.equal(x[0], y[0]) for x, y in zip(a, alone))
                same = all(torch.equal(x, y) for x, y in zip(a, default))
                ms = graph(lambda: tm.hc_pre(*args, config=cfg))
                row[f"T={t}"] = dict(us=None if ms is None else ms * 1e3, gates_dmax=d, invariant=inv,
                                     same_bits=same)
            except Exception as e:  # noqa: BLE001 - e.g. out of resources: report, go on
                row[f"T={t}"] = dict(error=f"{type(e).__name__}: {str(e)[:100]}")
        results.append(row)
        print("sweep", row["config"], " ".join(f"{k}: " + (f"{v['us']:.1f}us d{v['gates_dmax']:.1e}"
                                               f"{'' if v['invariant'] else ' NOT-INVARIANT'}"
                                               f"{'' if v['same_bits'] else ' other-bits'}"
                                               if "us" in v and v["us"] is not None else str(v))
                                     for k, v in row.items() if k.startswith("T=")), flush=True)


POST_MIX_SWEEP = [dict(MIX_BLOCK_T=bt, MIX_WARPS=w, POST_MIX_WARPS_PREFILL=w) for bt in (16, 32, 64, 128) for w in (1, 2, 4, 8)]
# the fp32 FMA mixes (other bits: timed against the default's tensor-core mixes in the same run)
POST_MIX_SWEEP += [dict(MIX_BF16X3=False), dict(MIX_BF16X3=False, MIX_WARPS=4, POST_MIX_WARPS_PREFILL=4)]


def sweep_post_mix(results, dev, shapes):
    """mhc_post_pre (the fused post + next pre, one launch pair per sub-layer) per POST_MIX_SWEEP
    launch shape: tokens per mixes program, warps, the mixes dot. Every output is compared bitwise with the
    default config's (warps up to 4 at the default tile keep the bits; ``MIX_BF16X3=False``, the fp32 FMA
    mixes, changes them and is timed as the baseline); CUDA-graph µs at each T."""
    from dsv4.ops.triton import mhc as tm

    _, graph = _timers(dev)
    g = torch.Generator(device=dev).manual_seed(2)
    cases = []
    for t in sorted(set(shapes["tokens"]) | ({1024} if shapes["hidden"] >= 1024 else set())):
        s, fn, base, scale = _hc_inputs(t, shapes["hidden"], g, dev)
        out = (torch.randn(t, shapes["hidden"], device=dev, generator=g) * 2).to(torch.bfloat16)
        post = torch.rand(t, N_HC, device=dev, generator=g) * 2
        comb = torch.rand(t, N_HC, N_HC, device=dev, generator=g)
        args = (s, out, post, comb, fn, base, scale, ITERS, HC_EPS, RMS_EPS)
        cases.append((t, args, tm.mhc_post_pre(*args)))
    for cfg in POST_MIX_SWEEP:
        row = dict(op="mhc_post_pre sweep", config=cfg)
        for t, args, ref in cases:
            try:
                got = tm.mhc_post_pre(*args, config=cfg)
                same = all(torch.equal(a, b) for a, b in zip(got, ref))
                ms = graph(lambda: tm.mhc_post_pre(*args, config=cfg))
                row[f"T={t}"] = dict(us=None if ms is None else ms * 1e3, same_bits=same)
            except Exception as e:  # noqa: BLE001 - e.g. out of resources: report, go on
                row[f"T={t}"] = dict(error=f"{type(e).__name__}: {str(e)[:100]}")
        results.append(row)
        print("sweep post_mix", cfg, " ".join(
            f"{k}: " + (f"{v['us']:.1f}us{'' if v['same_bits'] else ' DIFFERENT-BITS'}"
                        if v.get("us") is not None else str(v)) for k, v in row.items() if k.startswith("T=")),
              flush=True)


DENSE_PREFILL_TILES = [None] + [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st) for bm, bn, w, st in
                               ((128, 128, 8, 3), (256, 128, 8, 3), (256, 64, 8, 3), (128, 64, 4, 3),
                                (128, 256, 8, 3), (128, 128, 8, 4), (256, 128, 8, 4))]


def sweep_dense_prefill(results, dev, shapes, m=8192):
    """dense_linear's fused-mode prefill tile (``config["prefill"]``) on the model's 16-bit dense
    weights: each candidate's first 64 rows must equal an M = 64 launch's bitwise (the decode tile,
    the same K chunks); CUDA-graph µs and TFLOP/s at M = 8192. None = the base tile."""
    from dsv4.ops.triton import dense as td

    _, graph = _timers(dev)
    g = torch.Generator(device=dev).manual_seed(3)
    h = shapes["hidden"]
    weights = {"gate": (256, h), "compressor_csa": (2048, h), "compressor_hca": (1024, h),
               "indexer_compressor": (512, h), "weights_proj": (64, h)}
    for name, (n, k) in weights.items():
        w = (torch.randn(n, k, device=dev, generator=g) / math.sqrt(k)).to(torch.bfloat16)
        x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
        ref = td.dense_linear(x[:64], w)
        for tile in DENSE_PREFILL_TILES:
            cfg = {"prefill": tile}
            try:
                y = td.dense_linear(x, w, config=cfg)
                same = torch.equal(y[:64], ref)
                ms = graph(lambda: td.dense_linear(x, w, config=cfg))
                row = dict(op="dense_linear prefill sweep", weight=name, shape=[m, n, k], tile=tile,
                           us=None if ms is None else ms * 1e3, same_bits=same)
            except Exception as e:  # noqa: BLE001
                row = dict(op="dense_linear prefill sweep", weight=name, tile=tile, error=f"{type(e).__name__}: {e}"[:120])
            results.append(row)
            us = row.get("us")
            print(f"sweep dense_prefill {name} [{n}x{k}] M={m} {tile}: "
                  + (f"{us:.1f} us {2 * m * n * k / (us * 1e-6) / 1e12:.1f} TFLOP/s"
                     f"{'' if row['same_bits'] else ' DIFFERENT-BITS'}" if us else str(row.get("error"))), flush=True)


def run(device, results: list, small: bool = False) -> list:
    """Run every case on ``device`` (CUDA: full shapes; ``small``: interpreter-sized shapes)."""
    dev = torch.device(device)
    shapes = SMALL if small else FULL
    bw = peak = None
    if dev.type == "cuda":
        bw, peak = measure_bandwidth(dev), measure_peak(dev)
        print(f"measured: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul peak {peak / 1e12:.0f} TFLOP/s")
        results.append(dict(kernel="ceilings", bandwidth_Bps=bw, bf16_peak_flops=peak))
    print(f"{'op':<12} {'shape':<30} {'backend':<8} {'plain us':>10} {'graph us':>10} {'bound us':>14} "
          f"{'of bnd':>6}  check")
    bench_mhc(results, dev, shapes, bw, peak)
    bench_dense(results, dev, shapes, bw, peak)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU: Triton interpreter smoke test)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--sweep-mix", action="store_true", help="time hc_pre's mixes tiles (MIX_SWEEP) instead")
    ap.add_argument("--sweep-post-mix", action="store_true",
                    help="time mhc_post_pre's launch shapes (POST_MIX_SWEEP, same bits) instead")
    ap.add_argument("--configs", default=None,
                    help="JSON list of configs: replaces the swept list (MIX_SWEEP / POST_MIX_SWEEP / DENSE_PREFILL_TILES)")
    ap.add_argument("--sweep-dense-prefill", action="store_true",
                    help="time dense_linear's prefill tiles (DENSE_PREFILL_TILES, same bits) instead")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.small:
            sys.exit("bench/kernels_mhc.py needs a GPU (or --small for the interpreter smoke test)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import triton

    t0 = time.time()
    print(f"torch {torch.__version__}  triton {triton.__version__}  "
          f"{torch.cuda.get_device_name() if cuda else 'CPU (interpreter)'}")
    sweeps = [f for on, f in ((args.sweep_mix, sweep_mix), (args.sweep_post_mix, sweep_post_mix),
                              (args.sweep_dense_prefill, sweep_dense_prefill)) if on]
    if args.configs:
        global MIX_SWEEP, POST_MIX_SWEEP, DENSE_PREFILL_TILES
        MIX_SWEEP = POST_MIX_SWEEP = DENSE_PREFILL_TILES = json.loads(args.configs)
    if sweeps:  # the asked sweeps, one after the other
        results: list = []
        for sweep in sweeps:
            sweep(results, torch.device("cuda" if cuda else "cpu"), SMALL if args.small else FULL)
    else:
        results = run("cuda" if cuda else "cpu", [], small=args.small)
    fails = [r for r in results if str(r.get("check", "")).startswith("FAIL")]
    print(f"\n{len(results)} rows, {len(fails)} failed checks, {time.time() - t0:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
