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

from dsv4.model.branches import resolve  # noqa: E402  (a decode graph's mHC pre hands post / comb over pending)

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
    a = b = None  # freed (a timed closure above refers to them)
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
    from dsv4.model.opset import reference_ops
    from dsv4.ops.triton import mhc as tm

    oracle = reference_ops()  # the torch op set: the oracle's functions (mhc_pre needs its GEMM and norm)

    plain, graph = _timers(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    h = shapes["hidden"]
    for t in shapes["tokens"]:
        s, fn, base, scale = _hc_inputs(t, h, g, dev)
        args = (s, fn, base, scale, ITERS, HC_EPS, RMS_EPS)
        a, o = tm.hc_pre(*args), oracle.mhc_pre(*args)
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
        _row(results, "hc_pre", shape, "torch", plain(lambda: oracle.mhc_pre(*args)),
             graph(lambda: oracle.mhc_pre(*args)), nbytes, flops, bw, peak, chk)
        _row(results, "hc_pre", shape, "triton", plain(lambda: tm.hc_pre(*args)),
             graph(lambda: [resolve(v) for v in tm.hc_pre(*args)]), nbytes, flops, bw, peak, chk)
        out = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
        pargs = (s, out, o[1], o[2])
        y, yo = tm.hc_post(*pargs), oracle.mhc_post(*pargs)
        # relative to the output's scale: near-zero outputs come from cancellation, where one bf16
        # rounding of an O(1) term is already a large relative error
        d = ((y.float() - yo.float()).abs().max() / yo.float().abs().max()).item()
        chk = f"rel {d:.1e}" if d <= 2 ** -7 else f"FAIL rel {d:.1e}"
        nbytes = (2 * N_HC + 1) * t * h * 2 + t * (N_HC + N_HC * N_HC) * 4
        flops = 2 * t * N_HC * (N_HC + 1) * h
        _row(results, "hc_post", shape, "torch", plain(lambda: oracle.mhc_post(*pargs)),
             graph(lambda: oracle.mhc_post(*pargs)), nbytes, flops, bw, peak, chk)
        _row(results, "hc_post", shape, "triton", plain(lambda: tm.hc_post(*pargs)),
             graph(lambda: tm.hc_post(*pargs)), nbytes, flops, bw, peak, chk)
        s = out = a = o = y = yo = None  # freed (a timed closure above refers to them)
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
            ap = d = ref = y = None  # freed (a timed closure above refers to them)
            nbytes = 2 * (n * k + m * k + m * n)
            flops = 2 * m * n * k
            shape = f"{name} M={m} N={n} K={k}"
            _row(results, "dense_linear", shape, "torch", plain(lambda: F.linear(x, w)), graph(lambda: F.linear(x, w)),
                 nbytes, flops, bw, peak, chk)
            _row(results, "dense_linear", shape, "triton", plain(lambda: td.dense_linear(x, w)),
                 graph(lambda: td.dense_linear(x, w)), nbytes, flops, bw, peak, chk)
        w = None  # freed (a timed closure above refers to them)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# hc_pre's mixes-GEMM tiles (each a constant for every T: it sets a token's summation order).
# At decode the default (32 programs of 32 serial 16-column steps) is latency-bound.
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
    results = run("cuda" if cuda else "cpu", [], small=args.small)
    fails = [r for r in results if str(r.get("check", "")).startswith("FAIL")]
    print(f"\n{len(results)} rows, {len(fails)} failed checks, {time.time() - t0:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
