"""Microbenchmark of the paged sparse attention (and KV insert) Triton kernels at H200 decode shapes.

Decode batches of T ∈ {1, 8, 64} tokens, each its own sequence at position N-1, H = 64 bf16 query
heads, fp8_ds_mla pages (OCP) in shuffled page order:

* CSA: window 128 + 512 compressed entries (a random ascending top-512 of the N/4 visible, −1 padded to 512
  columns where fewer are visible), 64 a page;
* HCA: window 128 + all N/128 entries, 2 a page; N = 8K and 64K.

Each row: µs per call from CUDA-graph replay (after warm-up), bytes moved (KV records read once +
q + out + index lists), and the bound = bytes / device-to-device copy bandwidth measured in the same
run (1 GiB copy, read + write). A few tile configurations are swept at two shapes; correctness is
checked once against the torch backend (fp32 and bf16 q).

Part of ``bench/kernels.py`` (``--only attention``); alone:

    PYTHONPATH=. python3 bench/kernels_attention.py [--out attn.json]   # on the GPU
    PYTHONPATH=. python3 bench/kernels_attention.py --chunks            # the decode launches' key chunkings
    python3 bench/kernels_attention.py --small                          # CPU interpreter, tiny shapes
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

H, D, WINDOW, SWA_B, RECORD = 64, 512, 128, 64, 584
SWEEP = [dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=w, num_stages=st)
         for bh, bn, w, st in ((16, 32, 4, 1), (16, 32, 4, 2), (16, 64, 8, 2), (32, 32, 8, 2),
                               (64, 32, 8, 1), (64, 32, 8, 2), (64, 64, 8, 2))]


def _fill_pages(n_pages, per, dev, g):
    """fp8_ds_mla pages of random records: codes without NaNs, scale bytes 118..123, normal bf16 rope."""
    from dsv4.formats import alloc_kv_pages

    pages = alloc_kv_pages(n_pages, per, dev)
    data = pages[:, : per * 576].view(n_pages, per, 576)
    codes = torch.randint(0, 256, (n_pages, per, 448), device=dev, dtype=torch.uint8, generator=g)
    data[:, :, :448] = torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes)
    rope = torch.randn(n_pages, per, 64, device=dev, generator=g).to(torch.bfloat16)
    data[:, :, 448:] = rope.view(torch.uint8)
    scale = pages[:, per * 576: per * 584].view(n_pages, per, 8)
    scale[:, :, :7] = torch.randint(118, 124, (n_pages, per, 7), device=dev, dtype=torch.uint8, generator=g)
    scale[:, :, 7] = 0
    return pages


def make_case(kind: str, T: int, N: int, dev, g, heads: int = H, qdtype=torch.bfloat16):
    """Arguments of paged_sparse_attention for T decode tokens (one sequence each) at position N-1."""
    from dsv4.formats import OCP

    per, n_ent = (64, N // 4) if kind == "csa" else (2, N // 128)
    n_blk = max(1, -(-n_ent // per))
    n_swa = -(-N // SWA_B)
    comp_pages = _fill_pages(T * n_blk + 1, per, dev, g)
    block_table = torch.randperm(T * n_blk, device=dev, generator=g).view(T, n_blk)
    live = min(-(-WINDOW // SWA_B) + 1, n_swa)  # pages the window of position N-1 can touch
    swa_pages = _fill_pages(T * live + 1, SWA_B, dev, g)
    swa_table = torch.full((T, n_swa), -1, dtype=torch.long, device=dev)
    swa_table[:, n_swa - live:] = torch.randperm(T * live, device=dev, generator=g).view(T, live)
    if kind == "csa":
        k = min(512, n_ent)
        comp_idx = torch.rand(T, n_ent, device=dev, generator=g).topk(k, dim=1).indices.sort(dim=1).values
        # the indexer's rows are 512 wide whatever the context: short ones padded with -1
        comp_idx = torch.cat([comp_idx, comp_idx.new_full((T, 512 - k), -1)], dim=1)
    else:
        comp_idx = torch.arange(n_ent, device=dev).expand(T, n_ent).contiguous()
    positions = torch.full((T,), N - 1, dtype=torch.long, device=dev)
    seq_ids = torch.arange(T, device=dev)
    q = torch.randn(T, heads, D, device=dev, generator=g).to(qdtype)
    sink = torch.randn(heads, device=dev, generator=g)
    args = (q, positions, seq_ids, swa_pages, swa_table, comp_pages, block_table, per, comp_idx, sink,
            D ** -0.5, WINDOW, OCP)
    keys = (k if kind == "csa" else n_ent) + min(WINDOW, N)  # the records read (not the -1 padding)
    nbytes = T * (keys * RECORD + 2 * heads * D * q.element_size() + comp_idx.shape[1] * 8)
    return args, nbytes


def _name(c):
    """The tile's four keys, then any other override (e.g. a patched kernel's knob) as key=value."""
    extra = "".join(f" {k}={v}" for k, v in c.items() if k not in ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages"))
    return "h{BLOCK_H} n{BLOCK_N} w{num_warps} s{num_stages}".format(**c) + extra


def time_call(fn, dev, graph: bool = True, iters: int = 20, per_graph: int = 10) -> tuple[float, str]:
    """(µs per call, method): CUDA-graph replay when it can be captured, else plain launches."""
    fn()
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6, "cpu-interpreter"
    torch.cuda.synchronize()
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for _ in range(per_graph):
                    fn()
            gr.replay()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                gr.replay()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) * 1e3 / (iters * per_graph), "graph"
        except Exception as e:  # noqa: BLE001 - report, then time plain launches
            print(f"  (graph capture failed: {type(e).__name__}: {e})", flush=True)
            torch.cuda.synchronize()
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters * per_graph):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / (iters * per_graph), "launch"


def copy_bandwidth(dev, nbytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    if dev.type != "cuda":
        t0 = time.perf_counter()
        b.copy_(a)
        return 2 * nbytes / (time.perf_counter() - t0)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    e.synchronize()
    bw = 2 * nbytes * 10 / (s.elapsed_time(e) * 1e-3)
    a = b = None  # freed (a timed closure above refers to them)
    torch.cuda.empty_cache()
    return bw


def check_vs_torch(dev, g, N: int, T: int, heads: int, config: dict | None = None) -> str:
    """Triton vs the torch backend on one CSA shape, max |Δ| / max |ref| for fp32 q (fp32 accumulation:
    ≲ 1e-5) and bf16 q (outputs rounded to bf16 on both sides, so a value whose fp32 results differ
    in summation order can round one bf16 step apart: ≤ ulp(max |ref|) ≤ 2^-7 of it)."""
    from dsv4.ops import torch_attention
    from dsv4.ops.triton.sparse_attention import paged_sparse_attention

    args, _ = make_case("csa", T, N, dev, g, heads, torch.float32)
    errs = []
    for dt in (torch.float32, torch.bfloat16):
        a = (args[0].to(dt),) + args[1:]
        y = paged_sparse_attention(*a, config=config).float()
        ref = torch_attention.paged_sparse_attention(*a).float()
        errs.append(((y - ref).abs().max() / ref.abs().max()).item())
    ok = errs[0] < 1e-5 and errs[1] <= 2.0 ** -7
    return f"{'ok' if ok else 'FAIL'} (max|Δ|/max|ref|: fp32 {errs[0]:.2e}, bf16 {errs[1]:.2e})"


# prefill at H = 64: the head block and key block (the choice must stay a function of H only:
# batch invariance)
PREFILL_SWEEP = [dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=w, num_stages=st)
                 for bh, bn, w, st in ((16, 32, 4, 1), (16, 32, 4, 2), (16, 16, 4, 1), (16, 64, 4, 1),
                                       (32, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 1))]


# decode-sized launches with the query's keys in other chunkings (``chunks`` runs of ≥ ``chunk_min`` blocks; each
# its own bits) and the default chunks joined in one program (``split=False``: the default's bits)
CHUNK_SWEEP = [dict(chunks=c, chunk_min=m) for c in (1, 2, 4, 8) for m in (1, 2, 4) if c > 1 or m == 1] + \
    [dict(split=False)]


def run(device, results: list, small: bool = False, prefill_only: bool = False, chunks_only: bool = False) -> list:
    """Time the kernels on ``device``; append one dict per row to ``results`` (and print a table)."""
    from dsv4.formats import OCP
    from dsv4.ops.triton.kv_insert import kv_insert
    from dsv4.ops.triton.sparse_attention import paged_sparse_attention, pick_config

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    heads = 16 if small else H
    ts, ns = ((1, 2), (1024,)) if small else ((1, 8, 64), (8192, 65536))
    bw = copy_bandwidth(dev, (64 << 20) if small else (1 << 30))
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; default config {pick_config(heads, dev)}", flush=True)
    check = check_vs_torch(dev, g, 1024 if small else 8192, 2 if small else 8, heads)
    print(f"correctness vs torch backend: {check}", flush=True)
    results.append(dict(kernel="sparse_attention", check=check, bandwidth_gbs=bw / 1e9))
    print(f"{'kernel':<17} {'case':<24} {'config':<28} {'us':>9} {'bytes':>11} {'bound us':>9} {'of bound':>8}")

    def row(kernel, case, cfg_txt, fn, nbytes, graph=True):
        try:
            us, how = time_call(fn, dev, graph)
        except Exception as e:  # noqa: BLE001 - e.g. out of resources for a swept config
            print(f"{kernel:<17} {case:<24} {cfg_txt:<28} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
            results.append(dict(kernel=kernel, case=case, config=cfg_txt, error=f"{type(e).__name__}: {e}"))
            return
        bound = nbytes / bw * 1e6
        results.append(dict(kernel=kernel, case=case, config=cfg_txt, us=us, timing=how, bytes=nbytes,
                            bound_us=bound, fraction=bound / us))
        print(f"{kernel:<17} {case:<24} {cfg_txt:<28} {us:>9.1f} {nbytes:>11,d} {bound:>9.2f} "
              f"{100 * bound / us:>7.1f}%", flush=True)

    if chunks_only:  # and a 64-token context, as bench/e2e.py's decode steps (its 32-token prompts)
        for kind in (() if prefill_only else ("csa", "hca")):
            for n in (64,) + ns:
                for t in ts:
                    args, nbytes = make_case(kind, t, n, dev, g, heads)
                    case = f"{kind} N={n // 1024}K T={t}" if n >= 1024 else f"{kind} N={n} T={t}"
                    row("sparse_attention", case, "default", lambda: paged_sparse_attention(*args), nbytes)
                    for cfg in CHUNK_SWEEP[:2] if small else CHUNK_SWEEP:
                        txt = " ".join(f"{k}={v}" for k, v in cfg.items())
                        row("sparse_attention", case, txt, lambda cfg=cfg: paged_sparse_attention(*args, config=cfg),
                            nbytes)
                    args = None
        # a prefill-sized launch (predecoded keys, one program joining its chunks): its tile's warps, each against
        # the default's bits, and one chunk (the kernel before the chunks) for the cost of the joins
        t_pre = 16 if small else 2048
        args, nbytes = make_case("csa", t_pre, ns[0], dev, g, heads)
        case = f"csa N={ns[0] // 1024}K T={t_pre} (prefill)"
        want = paged_sparse_attention(*args)
        for cfg in ({}, {"num_warps": 8}, {"chunks": 1}, {"chunks": 1, "num_warps": 8}):
            got = paged_sparse_attention(*args, config=cfg or None)
            same = "" if "chunks" in cfg else (" same bits" if torch.equal(got, want) else " BITS DIFFER")
            row("sparse_attention", case, (" ".join(f"{k}={v}" for k, v in cfg.items()) or "default") + same,
                lambda cfg=cfg: paged_sparse_attention(*args, config=cfg or None), nbytes)
        return results
    sweep_at = {("csa", ns[0], ts[0])} if small else {("csa", ns[0], ts[0]), ("csa", ns[-1], ts[-1])}
    for kind in (() if prefill_only else ("csa", "hca")):
        for n in ns:
            for t in ts:
                args, nbytes = make_case(kind, t, n, dev, g, heads)
                case = f"{kind} N={n // 1024}K T={t}"
                row("sparse_attention", case, "default", lambda: paged_sparse_attention(*args), nbytes)
                if (kind, n, t) in sweep_at:
                    for cfg in (SWEEP[4:5] if small else SWEEP):
                        txt = "h{BLOCK_H} n{BLOCK_N} w{num_warps} s{num_stages}".format(**cfg)
                        row("sparse_attention", case, txt,
                            lambda cfg=cfg: paged_sparse_attention(*args, config=cfg), nbytes)
                args = None  # freed (a timed closure above refers to them)
    # prefill-sized launches (T tokens, here each its own sequence): H = 64 falls back from
    # BLOCK_H=64 with 2 stages (too much shared memory) to 1 stage; the sweep shows whether
    # another head block is faster there (the choice must stay a function of H: batch invariance)
    t_pre = 16 if small else 2048
    args, nbytes = make_case("csa", t_pre, ns[0], dev, g, heads)
    case = f"csa N={ns[0] // 1024}K T={t_pre} (prefill)"
    row("sparse_attention", case, "default", lambda: paged_sparse_attention(*args), nbytes)
    for cfg in (SWEEP[4:5] + PREFILL_SWEEP[2:3] if small else PREFILL_SWEEP if prefill_only else
                SWEEP + [c for c in PREFILL_SWEEP if c not in SWEEP]):
        txt = "h{BLOCK_H} n{BLOCK_N} w{num_warps} s{num_stages}".format(**cfg)
        if prefill_only:
            try:
                print(f"  {txt} vs torch: {check_vs_torch(dev, g, ns[0], 2 if small else 8, heads, cfg)}", flush=True)
            except Exception as e:  # noqa: BLE001 - e.g. out of resources: the timing row says so too
                print(f"  {txt} vs torch: {type(e).__name__}", flush=True)
        row("sparse_attention", case, txt, lambda cfg=cfg: paged_sparse_attention(*args, config=cfg), nbytes)
    args = None  # freed (a timed closure above refers to them)
    for t in (() if prefill_only else (1, 8) if small else (1, 64, 8192)):
        pages = _fill_pages(-(-t // SWA_B) + 1, SWA_B, dev, g)
        x = torch.randn(t, D, device=dev, generator=g)
        page_ids = torch.arange(t, device=dev) // SWA_B
        offs = torch.arange(t, device=dev) % SWA_B
        row("kv_insert", f"T={t}", "-", lambda: kv_insert(pages, page_ids, offs, x, OCP, SWA_B),
            t * (D * 4 + RECORD + 16))
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU: Triton interpreter)")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill-sized launch and its tile sweep")
    ap.add_argument("--chunks", action="store_true", help="only the decode launches' key chunkings (CHUNK_SWEEP) and "
                    "the prefill launch's joins (with --prefill-only: only those)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        if not a.small:
            ap.error("no CUDA device: use --small (Triton interpreter on CPU)")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    results: list = []
    run("cuda" if torch.cuda.is_available() else "cpu", results, small=a.small, prefill_only=a.prefill_only,
        chunks_only=a.chunks)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
