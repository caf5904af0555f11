"""The decode GEMMs' weights prefetched into L2 while a latency-bound kernel runs (``bench/kernels.py --sweep
--only prefetch``).

Each case is one CUDA graph cycling through copies of the weights that hold 4x the L2 (cold, as in a
decode step): a spin kernel on a few SMs (``SPIN_US``: the attention or the mHC gates the GEMM waits for)
and then the batch-1 GEMM(s), with the weights' L2 prefetch (``dsv4.ops.triton.prefetch``) issued on a
side stream when the spin starts (joined before the GEMM) or not at all. Prints µs per GEMM beyond the
spin (the spin alone measured in the same run), and the same GEMM on one warm copy (its L2 floor).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

SPIN_US = 15.0


@triton.jit
def _spin(out_ptr, ns):
    z = tl.zeros([1], tl.int32)
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [z], dtype=tl.int64, is_pure=False, pack=1)
    t = t0
    while tl.max(t - t0, axis=0) < ns:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [z], dtype=tl.int64, is_pure=False,
                                      pack=1)
    tl.store(out_ptr + tl.program_id(0) + tl.arange(0, 1), (t - t0).to(tl.int32))


CASES = {  # name -> [(weight name, N, K, groups)] read one after the other after the spin
    "wq_a+wkv, wq_b": [("wq_a+wkv", 1536, 4096, 1), ("wq_b", 32768, 1024, 1)],
    "wq_b": [("wq_b", 32768, 1024, 1)],
    "wo_a": [("wo_a", 8192, 4096, 8)],
    "wo_a, wo_b": [("wo_a", 8192, 4096, 8), ("wo_b", 4096, 8192, 1)],
    "wo_b": [("wo_b", 4096, 8192, 1)],
}


def sweep_prefetch(dev, bench_graph, spin_us: float = SPIN_US) -> dict:
    from dsv4.ops.triton import fp8_linear as tfl
    from dsv4.ops.triton import prefetch as pf

    g = torch.Generator(device=dev).manual_seed(5)
    side = torch.cuda.Stream(device=dev)
    spin_out = torch.zeros(4, dtype=torch.int32, device=dev)
    ns = int(spin_us * 1e3)

    def spin():
        _spin[(4,)](spin_out, ns, num_warps=4)

    spin_ms = bench_graph(lambda: [spin() for _ in range(20)], 60) / 20
    print(f"prefetch sweep: spin alone {spin_ms * 1e3:.1f} us", flush=True)
    out = {"spin_us": spin_ms * 1e3}
    for case, mats in CASES.items():
        total = sum(n * k for _, n, k, _ in mats)
        copies = max(2, math.ceil((200 << 20) / total))
        sets = []
        for _ in range(copies):
            sets.append([(torch.randint(0, 126, (n, k), device=dev, dtype=torch.uint8, generator=g)
                          .view(torch.float8_e4m3fn),
                          torch.randint(118, 124, (math.ceil(n / 128), math.ceil(k / 128)), device=dev,
                                        dtype=torch.uint8, generator=g), grp) for _, n, k, grp in mats])
        xs = [torch.randn(1, grp * k, device=dev, dtype=torch.bfloat16, generator=g) for _, n, k, grp in mats]

        def gemms(ws):
            return [tfl.fp8_linear(x, w, s, groups=grp) for x, (w, s, grp) in zip(xs, ws)]

        def plain(ws):
            spin()
            return gemms(ws)

        def fetched(ws, evict_last, ahead="all"):
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            pf.EVICT_LAST = evict_last
            with torch.cuda.stream(side):
                if ahead == "all":
                    pf.prefetch_l2(*[t for w, s, _ in ws for t in (w, s)], launch=True)
                else:  # the first before the spin, the next one when its GEMM starts
                    pf.prefetch_l2(ws[0][0], ws[0][1], launch=True)
            done = torch.cuda.Event()
            done.record(side)
            spin()
            main.wait_event(done)
            ys = []
            for j, (x, (w, s, grp)) in enumerate(zip(xs, ws)):
                if ahead != "all" and j + 1 < len(ws):
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        pf.prefetch_l2(ws[j + 1][0], ws[j + 1][1], launch=True)
                    ev = torch.cuda.Event()
                    ev.record(side)
                ys.append(tfl.fp8_linear(x, w, s, groups=grp))
                if ahead != "all" and j + 1 < len(ws):
                    main.wait_event(ev)
            pf.EVICT_LAST = False
            return ys

        ref = [y.clone() for y in plain(sets[0])]
        got = fetched(sets[0], False)
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(ref, got))
        variants = {
            "cold, no prefetch": lambda: [plain(ws) for ws in sets],
            "cold, prefetch": lambda: [fetched(ws, False) for ws in sets],
            "cold, prefetch evict_last": lambda: [fetched(ws, True) for ws in sets],
            "warm (one copy)": lambda: [plain(sets[0]) for _ in sets],
        }
        if len(mats) > 1:
            variants["cold, prefetch each at the GEMM before"] = lambda: [fetched(ws, False, "each") for ws in sets]
        for vname, fn in variants.items():
            ms = bench_graph(fn, 80)
            us = (ms / copies - spin_ms) * 1e3 if ms else None
            bytes_us = total / 4.3e12 * 1e6
            print(f"prefetch {case:16s} {vname:40s} {us:7.1f} us beyond the spin (bytes at 4.3 TB/s: "
                  f"{bytes_us:.1f}){'' if same else '  VALUES DIFFER'}", flush=True)
            out[f"prefetch {case} {vname}"] = us
        sets = None
        torch.cuda.empty_cache()
    return out
