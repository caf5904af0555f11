"""Programmatic dependent launch (``dsv4.ops.triton._common.PDL``) gives the same bits as plain launches.

A chain of decode-size launches in which every op reads the one before it (RMSNorm → stacked FP8 GEMM →
RMSNorm → bf16 GEMM + split-K → FP8 GEMM → mhc_post_pre → RMSNorm), captured in a CUDA graph with PDL on:
each PDL program lets the next launch start, prefetches its weights and waits for the previous launch's
results, so a wait in the wrong place reads a stale input. Several replays on fresh inputs, each compared
bitwise with the same chain launched plainly (eager, PDL off) on the same inputs.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs a CUDA GPU of sm_90 or later")


def _fp8(n, k, g):
    from dsv4.formats import OCP, quantize_block_fp8

    wq, s = quantize_block_fp8(torch.randn(n, k, generator=g) * 0.05, scale_fmt="ue8m0", fmt=OCP)
    return wq.cuda(), s.cuda()


def _chain(x, p):
    from dsv4.ops.triton import dense, fp8_linear, mhc

    h = dense.rms_norm(x, p["n1"], 1e-6)
    qkv = fp8_linear.fp8_linear(h, *p["w1"])  # [1536 rows]: split-K at M ≤ 8
    q = dense.rms_norm(qkv[:, :1024], p["n2"], 1e-6)
    z = dense.dense_linear(q, p["w2"])  # bf16 [2048, 1024]: split mode at decode sizes
    o = fp8_linear.fp8_linear(z, *p["w3"])  # [4096, 2048]
    streams, col, post, comb = mhc.mhc_post_pre(p["streams"], o, p["post"], p["comb"], p["fn"], p["base"],
                                                p["scale"], 20, 1e-6, 1e-6)
    return qkv, z, o, streams, dense.rms_norm(col, p["n3"], 1e-6), post, comb


@pytest.mark.parametrize("t", [1, 5])
def test_pdl_chain_is_bitwise_the_plain_launches(t):
    from dsv4.ops.triton import _common

    g = torch.Generator().manual_seed(7 + t)
    h, n = 4096, 4
    p = {"n1": torch.rand(h, generator=g).cuda().bfloat16() + 0.5,
         "n2": torch.rand(1024, generator=g).cuda().bfloat16(), "n3": torch.rand(h, generator=g).cuda().bfloat16(),
         "w1": _fp8(1536, h, g),
         "w2": (torch.randn(2048, 1024, generator=g) * 0.03).bfloat16().cuda(), "w3": _fp8(h, 2048, g),
         "streams": (torch.randn(t, n, h, generator=g) * 3).bfloat16().cuda(),
         "post": (torch.rand(t, n, generator=g) * 2).cuda(),
         "comb": torch.softmax(torch.randn(t, n, n, generator=g), -1).cuda(),
         "fn": (torch.randn(2 * n + n * n, n * h, generator=g) / math.sqrt(n * h)).cuda(),
         "base": (torch.randn(2 * n + n * n, generator=g) * 0.5).cuda(),
         "scale": (torch.rand(3, generator=g) * 0.5 + 0.5).cuda()}
    x = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")
    before = _common.PDL
    try:
        _common.PDL = True
        assert _common.pdl_launch(x.device, t)
        x.copy_(torch.randn(t, h, generator=g))
        for _ in range(2):  # warm-up: compiles, split-K counters
            _chain(x, p)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(x, p)
        for rep in range(4):
            x.copy_(torch.randn(t, h, generator=g) * (1 + rep))
            graph.replay()
            torch.cuda.synchronize()
            _common.PDL = False
            want = _chain(x, p)
            _common.PDL = True
            for i, (a, b) in enumerate(zip(out, want)):
                assert torch.equal(a, b), (rep, i)
    finally:
        _common.PDL = before
