"""Microbenchmark of the Lightning Indexer over the paged FP8 cache (``dsv4.ops.triton.indexer``).

Times the logits kernel, the sync-free top-k and both together at DeepSeek-V4-Flash shapes
(Hi = 64 heads × 128 dims, top-512, 64 entries per page), T ∈ {1, 8, 64} query tokens, contexts of
8K and 64K tokens (n = ctx/4 entries):

- ``decode``: T sequences, one query each, every query sees its own n entries (keys read T times);
- ``shared``: one sequence, T queries at its end (keys read once from HBM, then from L2);
- ``padded``: decode with n_cols fixed by a 64K max_model_len while the context is 8K (the cost of a
  data-independent launch width).

Bound = max(bytes / copy bandwidth, FLOPs / bf16 matmul peak), both measured in the same run
(copy: read + write of a large buffer; peak: bf16 matmul). Bytes = key records of the visible
entries (132 B each) + q + weights + the logits written (logits kernel), + the logits read and the
indices written (top-k). FLOPs = 2·T·n·Hi·128 (+ ReLU, weight, head sum). Every case is first
checked against the torch op (logits within the summation-order tolerance, top-k identical to a
stable sort of the same logits). Times are CUDA-graph replay medians where capture works, else
``do_bench`` medians. ``--small`` runs tiny shapes on the CPU interpreter (a smoke test).

    PYTHONPATH=. python3 bench/kernels_indexer.py [--out indexer.json]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/kernels_indexer.py --small
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, DIM, TOPK, EPB = 64, 128, 512, 64
RECORD = 132


def _time_ms(fn, cuda: bool, rep_ms: int = 60) -> tuple[float, str]:
    """(median ms, how): CUDA-graph replay if ``fn`` can be captured, else do_bench; CPU: wall time."""
    if not cuda:
        fn()
        t0 = time.perf_counter()
        n = 2
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e3, "wall"
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")), "graph"
    except Exception:  # noqa: BLE001 - not capturable
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=15, rep=rep_ms, return_mode="median")), "eager"


def measure_bandwidth(dev: torch.device, small: bool) -> float:
    """Bytes/s of a device-to-device copy (read + write), past L2 on the GPU."""
    n = (16 << 20) if small else (4 << 30)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms, _ = _time_ms(lambda: b.copy_(a), dev.type == "cuda", 200)
    a = b = None  # freed (a timed closure above refers to them)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


def measure_peak(dev: torch.device, small: bool) -> float:
    """FLOP/s of a square bf16 matmul (8192³ on the GPU)."""
    n = 512 if small else 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms, _ = _time_ms(lambda: torch.matmul(a, b), dev.type == "cuda", 300)
    return 2 * n ** 3 / (ms * 1e-3)


def _pages(n_pages: int, dev, g, fmt):
    """Block-packed FP8 indexer pages: random non-NaN codes, power-of-two fp32 scales."""
    from dsv4.formats import alloc_indexer_pages

    pages = alloc_indexer_pages(n_pages, EPB, dev)
    codes = torch.randint(0, 256, (n_pages, EPB * DIM), device=dev, dtype=torch.uint8, generator=g)
    if fmt.name == "ocp":
        codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes)
    else:
        codes = torch.where(codes == 0x80, torch.zeros_like(codes), codes)
    pages[:, : EPB * DIM] = codes
    exps = torch.randint(-10, -3, (n_pages, EPB), device=dev, generator=g).float()
    pages.view(torch.float32)[:, EPB * DIM // 4: EPB * DIM // 4 + EPB] = torch.exp2(exps)
    return pages


def _abs_pages(pages):
    """The same records with every code's sign bit cleared: |k| (for the tolerance)."""
    p = pages.clone()
    p[:, : EPB * DIM] &= 0x7F
    return p


def _case(mode: str, t: int, ctx: int, dev, g, fmt, heads: int, max_len: int | None = None):
    from dsv4.formats import fake_quant_fp8_pow2

    n = ctx // 4
    blocks = -(-n // EPB)
    seqs = t if mode in ("decode", "padded") else 1
    n_pages = seqs * blocks + 1
    pages = _pages(n_pages, dev, g, fmt)
    table = torch.randperm(n_pages, device=dev, generator=g)[: seqs * blocks].view(seqs, blocks)
    if mode == "shared":
        seq_ids = torch.zeros(t, dtype=torch.long, device=dev)
        pos = torch.arange(ctx - t, ctx, device=dev)  # the last t tokens of the context
        n_vis = (pos + 1) // 4
    else:
        seq_ids = torch.arange(t, device=dev)
        n_vis = torch.full((t,), n, dtype=torch.long, device=dev)
    q = torch.randn(t, heads, DIM, device=dev, generator=g)
    q = fake_quant_fp8_pow2(q.to(torch.bfloat16).float(), DIM, fmt)
    w = torch.randn(t, heads, device=dev, generator=g) * heads ** -0.5 * DIM ** -0.5
    n_cols = (max_len // 4) if max_len else -(-n // 64) * 64
    return (q, w, seq_ids, n_vis, pages, table, EPB, n_cols), n


def _check(args, fmt, k) -> str:
    """'ok' if the logits are within (129 + Hi)·2^-22·Σ|terms| of the torch op and the top-k equals
    a stable sort of the same logits; else what failed."""
    from dsv4.model.linear import stable_topk
    from dsv4.ops import torch_indexer as ref
    from dsv4.ops.triton import indexer as tri

    q, w, seq_ids, n_vis, pages, table, epb, n_cols = args
    y = tri.indexer_logits(*args, fmt)
    r = ref.indexer_logits(*args, fmt)
    absum = ref.indexer_logits(q.abs(), w.abs(), seq_ids, n_vis, _abs_pages(pages), table, epb, n_cols, fmt)
    tol = (129 + q.shape[1]) * 2.0 ** -22 * absum.clamp(min=0)
    fin = torch.isfinite(r)
    if not torch.equal(fin, torch.isfinite(y)):
        return "FAIL mask"
    worst = ((y - r).abs()[fin] / (tol[fin] + 1e-30)).max().item() if bool(fin.any()) else 0.0
    idx = tri.indexer_topk(y, k)
    kk = min(k, n_cols)
    want = stable_topk(torch.where(y == 0, torch.zeros_like(y), y), kk)
    want = torch.where(torch.gather(y, 1, want) == float("-inf"), -1, want)
    if not torch.equal(idx[:, :kk], want):
        return "FAIL top-k"
    return "ok" if worst <= 1.0 else f"FAIL x{worst:.3g}"


def run(device, results: list, small: bool = False) -> list:
    """Time every case on ``device``; append one dict per (case, stage) to ``results``."""
    import triton

    from dsv4.formats import OCP
    from dsv4.ops.torch_indexer import ascending_picks
    from dsv4.ops.triton import indexer as tri

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    fmt = OCP
    heads = 16 if small else HEADS
    k = 32 if small else TOPK
    g = torch.Generator(device=dev).manual_seed(0)
    bw, peak = measure_bandwidth(dev, small), measure_peak(dev, small)
    print(f"{torch.cuda.get_device_name(dev) if cuda else 'cpu (interpreter)'}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    print(f"measured: copy bandwidth {bw / 1e12:.3f} TB/s, bf16 matmul peak {peak / 1e12:.1f} TFLOP/s")
    if small:
        cases = [("decode", t, 1024, None) for t in (1, 4)] + [("shared", 4, 1024, None), ("padded", 2, 512, 1024)]
    else:
        cases = [(m, t, c, None) for m in ("decode", "shared") for c in (8192, 65536) for t in (1, 8, 64)]
        cases += [("padded", t, 8192, 65536) for t in (1, 64)]
    hdr = (f"{'case':<8} {'T':>3} {'ctx':>6} {'n_cols':>6} {'stage':<7} {'us':>9} {'how':<5} {'MB':>8} "
           f"{'GFLOP':>7} {'bound us':>9} {'of bound':>8}  check")
    print(hdr)
    for mode, t, ctx, max_len in cases:
        args, n = _case(mode, t, ctx, dev, g, fmt, heads, max_len)
        q, w, seq_ids, n_vis, pages, table, epb, n_cols = args
        check = _check(args, fmt, k)
        logits = tri.indexer_logits(*args, fmt)
        keys_read = (t if mode != "shared" else 1) * n * RECORD
        io = q.numel() * 4 + w.numel() * 4
        flops = 2 * t * n * heads * DIM + 3 * t * n * heads
        stages = {
            "logits": (lambda: tri.indexer_logits(*args, fmt), keys_read + io + t * n_cols * 4, flops),
            "topk": (lambda: tri.indexer_topk(logits, k), t * n_cols * 4 + t * k * 8, 0),
            "total": (lambda: tri.paged_indexer_topk(*args, k, fmt), keys_read + io + 2 * t * n_cols * 4 + t * k * 8,
                      flops),
            "sort": (lambda: torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :k],
                     t * n_cols * 4 + t * k * 8, 0),  # the reference's stable sort, for comparison
            # what the batched attention reads: the picks in ascending order (topk + a second sort before)
            "topk+asc": (lambda: ascending_picks(tri.indexer_topk(logits, k), n_cols), t * n_cols * 4 + t * k * 8, 0),
            "select": (lambda: tri.select_topk_ascending(logits, k), t * n_cols * 4 + t * k * 8, 0),
        }
        if not torch.equal(tri.select_topk_ascending(logits, k), ascending_picks(tri.indexer_topk(logits, k), n_cols)):
            check = "FAIL: select_topk_ascending differs from topk + sort"
        for stage, (fn, nbytes, fl) in stages.items():
            ms, how = _time_ms(fn, cuda)
            bound_ms = max(nbytes / bw, fl / peak) * 1e3
            row = dict(kernel="indexer", case=mode, T=t, ctx=ctx, n_entries=n, n_cols=n_cols, heads=heads, k=k,
                       stage=stage, us=ms * 1e3, timing=how, bytes=nbytes, flops=fl, bound_us=bound_ms * 1e3,
                       bound="memory" if nbytes / bw >= fl / peak else "compute",
                       fraction=bound_ms / ms if ms > 0 else None, check=check)
            results.append(row)
            print(f"{mode:<8} {t:>3} {ctx:>6} {n_cols:>6} {stage:<7} {ms * 1e3:>9.1f} {how:<5} {nbytes / 1e6:>8.2f} "
                  f"{fl / 1e9:>7.2f} {bound_ms * 1e3:>9.2f} {100 * row['fraction']:>7.1f}%  {check}", flush=True)
        args = logits = None  # freed (a timed closure above refers to them)
        if cuda:
            torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--small", action="store_true", help="tiny shapes; on a CPU this needs TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    if not cuda and not args.small:
        sys.exit("bench/kernels_indexer.py needs a GPU (or --small with TRITON_INTERPRET=1 on a CPU)")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    t0 = time.time()
    rows: list = []
    run("cuda" if cuda else "cpu", rows, small=args.small)
    fails = [r for r in rows if str(r["check"]).startswith("FAIL")]
    print(f"{len(rows)} rows, {len(fails)} failed checks, {time.time() - t0:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
