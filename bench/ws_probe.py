"""Does Triton warp-specialize a Hopper GEMM whose B operand is decoded in registers? Compiled offline (no GPU).

The MXFP4 MoE kernels decode the 4-bit weights in registers before each wgmma; overlapping that decode with
the MMAs is the kind of work warp specialization does (a producer partition loading, consumers computing).
This compiles a minimal TMA GEMM for sm_90 with ``tl.range(..., warp_specialize=True)`` twice — B loaded as
bf16, and B loaded as packed nibbles and unpacked to bf16 in registers (the MoE kernels' shape of work) — and
prints, per form, whether it compiled and how many partitions, async tasks, wgmmas and TMA loads it got.

    PYTHONPATH=<a Triton 3.6 site-packages>:. python bench/ws_probe.py --warps 4,8

Nineteenth session, Triton 3.6 (the H200's): at 4 warps the bf16 form got 2 partitions and the decoded form
failed in the ``NVGPUWarpSpecialization`` pass (which prints its MLIR reproducer on stderr); at 8 warps neither
was partitioned (docs/perf.md).
"""

from __future__ import annotations

import argparse
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _gemm(a_desc, b_desc, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          DECODE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K, BK, warp_specialize=True, num_stages=3):
        a = a_desc.load([pid_m * BM, k])
        if DECODE:  # two 4-bit codes per byte, unpacked and converted in registers
            bb = b_desc.load([pid_n * BN, k // 2])
            b = tl.join((bb & 0xF).to(tl.float16), (bb >> 4).to(tl.float16)).reshape(BN, BK).to(tl.bfloat16)
        else:
            b = b_desc.load([pid_n * BN, k])
        acc = tl.dot(a, b.T, acc)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc)


def probe(decode: bool, warps: int, bm: int = 128, bn: int = 128, bk: int = 64) -> str:
    sig = {"a_desc": f"tensordesc<bf16[{bm}, {bk}]>",
           "b_desc": f"tensordesc<u8[{bn}, {bk // 2}]>" if decode else f"tensordesc<bf16[{bn}, {bk}]>",
           "c_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "DECODE": "constexpr"}
    names = list(sig)
    consts = {(names.index(n),): v for n, v in (("BM", bm), ("BN", bn), ("BK", bk), ("DECODE", decode))}
    try:
        k = triton.compile(ASTSource(_gemm, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps))
    except Exception as e:  # noqa: BLE001 - a failing pass is the answer
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    parts = len(set(re.findall(r"partition\d+", ttgir)))
    return (f"compiled: {parts} partitions, {ttgir.count('async_task')} async_task attrs, "
            f"{ptx.count('wgmma.mma_async')} wgmma, {ptx.count('cp.async.bulk.tensor')} TMA loads")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warps", default="4,8", help="comma-separated num_warps values")
    a = ap.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90")
    for w in (int(x) for x in a.warps.split(",")):
        for decode in (False, True):
            print(f"num_warps {w}, B {'decoded in registers' if decode else 'bf16 via TMA'}: {probe(decode, w)}",
                  flush=True)


if __name__ == "__main__":
    main()
