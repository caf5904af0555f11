"""The tensor cores' rate at decode-sized MMAs (``bench/kernels.py --sweep --only mma_rate``).

The decode GEMMs (FP8 linear, MXFP4 experts) multiply a decoded 64-row weight tile (registers) by a few
token rows (shared memory): one ``wgmma m64nNk16`` per 16 k with N = 16 at batch 1. This loop issues only
those MMAs (the weight tile changed every iteration by one XOR, as a decoded tile is new every K step),
so its time per MMA and SM, at 1-8 programs per SM, is the floor such a kernel cannot go below whatever
its memory does; SS (both operands in shared memory) and mma.sync (2 warps) beside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mma_loop(a_ptr, b_ptr, out_ptr, iters, N: tl.constexpr, K: tl.constexpr, RS: tl.constexpr):
    m = tl.arange(0, 64)
    k = tl.arange(0, K)
    n = tl.arange(0, N)
    b = tl.load(b_ptr + n[:, None] * K + k[None, :])  # [N, K] bf16, used transposed as the real kernels do
    acc = tl.zeros((64, N), tl.float32)
    for i in range(iters):  # one of 4 L1-resident tiles per step (the real kernels stream theirs from HBM)
        a_bits = tl.load(a_ptr + (i % 4) * 64 * K + m[:, None] * K + k[None, :])  # int16: bf16 bits
        if RS:  # a register tile (one XOR of the low mantissa bit), as a decoded weight is
            a = (a_bits ^ 1).to(tl.bfloat16, bitcast=True)
        else:  # a_ptr is the bf16 view: the tile goes from shared memory to the MMA as it is
            a = a_bits
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(out_ptr + tl.program_id(0) * 64 * N + m[:, None] * N + n[None, :], acc)


def sweep_mma_rate(dev, bench_graph) -> dict:
    """ns per m64nNk16 MMA per SM for N = 16 / 32 / 64, RS and SS, 1-8 programs per SM (4 warps = one
    warpgroup; 2 warps: Triton's mma.sync path, m16n8k16 MMAs, reported per 64 × N × 16 of work)."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    iters, k = 512, 64
    rows = []
    for n in (16, 32, 64):
        for rs, warps, label in ((True, 4, "RS wgmma"), (False, 4, "SS wgmma"), (True, 2, "RS mma.sync")):
            for per_sm in (1, 2, 4, 8):
                grid = sms * per_sm
                a = torch.randint(-2000, 2000, (4, 64, k), device=dev, dtype=torch.int16)
                b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                out = torch.empty(grid, 64, n, device=dev, dtype=torch.float32)
                a_in = a if rs else a.view(torch.bfloat16)
                ms = bench_graph(lambda: _mma_loop[(grid,)](a_in, b, out, iters, N=n, K=k, RS=rs, num_warps=warps), 40)
                mmas = per_sm * iters * k // 16  # 64 x N x 16 MMAs per SM
                ns = ms * 1e6 / mmas
                rows.append(dict(N=n, kind=label, per_sm=per_sm, us=round(ms * 1e3, 2), ns_per_mma_sm=round(ns, 2),
                                 tflops=round(2 * 64 * n * 16 * mmas * sms / (ms * 1e-3) / 1e12, 1)))
                print(f"mma_rate N={n:3d} {label:12s} {per_sm} per SM: {ms * 1e3:8.2f} us  "
                      f"{ns:6.2f} ns per MMA per SM  {rows[-1]['tflops']:7.1f} TFLOP/s", flush=True)
    return {"mma_rate": rows}
