"""The prefill FP8 linear over a weight dequantized to bf16 first (``w16``) against the in-register decode.

At prefill sizes the FP8 linear used to decode each weight tile in registers and feed it to the MMA as the
register operand; for a weight whose K is reduced in several chunks (batch invariance), two fp32 tiles are
live and the in-register decode left the large tiles short of registers. Long prefills of such weights now
dequantize the weight once per launch (``dequant_weight``) and run a plain bf16 tile (``W16_TILE``). Per
DeepSeek-V4-Flash weight shape at M = 8192 (``wo_a``: the grouped output projection) this checks that the
rows equal the decode tile's (an M = 64 launch: the batch-invariance requirement) and times, as CUDA-graph
medians with the bf16 matmul peak measured in the same run: the engine's default now (dequantization
included), the in-register decode at the previous default tile and at the w16 tile, and the dequantization
alone.

    PYTHONPATH=. python3 bench/fp8_w16.py [--out w16.json]    # on the GPU
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import bench_graph, measure_peak  # noqa: E402  (bench/kernels.py)

SHAPES = {  # name: (N, K, groups)
    "wq_b": (32768, 1024, 1), "wo_b": (4096, 8192, 1), "wq_a": (1024, 4096, 1), "shared_w1": (2048, 4096, 1),
    "wkv": (512, 4096, 1), "shared_w2": (4096, 2048, 1), "idx_wq_b": (8192, 1024, 1), "wo_a": (8192, 4096, 8),
}


def old_tile(m: int, n: int, k: int, dev) -> dict:
    """The prefill tile the in-register decode took before w16 (pick_config's other branches)."""
    from dsv4.ops.triton import fp8_linear as tfl

    if n <= 2048 and math.ceil(m / 256) * math.ceil(n / 64) >= 96 and \
            tfl.invariant_chunk(n, k, dev) < math.ceil(k / 128) * 128:
        return dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=3)
    if math.ceil(m / 256) * math.ceil(n / 128) >= 96:
        return dict(BLOCK_M=256, BLOCK_N=128, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4)


def main() -> None:
    from dsv4.ops.triton import fp8_linear as tfl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--names", default=",".join(SHAPES))
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device("cuda")
    peak = measure_peak(dev)
    print(f"bf16 matmul peak {peak / 1e12:.1f} TFLOP/s")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name in a.names.split(","):
        n, k, groups = SHAPES[name]
        m = a.m
        w = torch.randint(0, 126, (n, k), device=dev, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        sc = torch.randint(118, 124, (math.ceil(n / 128), math.ceil(k / 128)), device=dev, dtype=torch.uint8,
                           generator=g)
        x = torch.randn(m, groups * k, device=dev, dtype=torch.bfloat16, generator=g)
        flops = 2 * m * n * k
        ref64 = tfl.fp8_linear(x[:64], w, sc, groups=groups)
        default = tfl.pick_config(m, n, k, dev)
        variants = [("default" + (" (w16)" if default.get("w16") else ""), None),
                    ("decode in registers, previous tile", dict(old_tile(m, n, k, dev), w16=False)),
                    ("decode in registers, w16 tile", dict(tfl.W16_TILE, w16=False))]
        for label, cfg in variants:
            try:
                y = tfl.fp8_linear(x, w, sc, groups=groups, config=cfg)
                same = torch.equal(y[:64], ref64)
                t = bench_graph(lambda: tfl.fp8_linear(x, w, sc, groups=groups, config=cfg))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
                print(f"w16 {name}: {label}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            print(f"w16 {name:9s} [{n}x{k}]x{groups} M={m}: {label:36s} {t * 1e3:8.1f} us {flops / t / 1e9:6.1f} "
                  f"TFLOP/s ({flops / t / 1e9 / (peak / 1e12):5.1%} of peak), rows vs decode tile "
                  f"{'same bits' if same else 'DIFFERENT BITS'}", flush=True)
            rows.append(dict(name=name, n=n, k=k, groups=groups, m=m, variant=label, config=str(cfg), us=t * 1e3,
                             same_as_decode_tile=same))
        deq = bench_graph(lambda: tfl.dequant_weight(w, sc, torch.bfloat16))
        print(f"w16 {name:9s} dequant_weight alone {deq * 1e3:.1f} us (bound {n * k * 3 / 4.2e12 * 1e6:.1f} us at 4.2 TB/s)",
              flush=True)
        rows.append(dict(name=name, variant="dequant_weight", us=deq * 1e3))
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(dict(bf16_peak_flops=peak, rows=rows), indent=1))


if __name__ == "__main__":
    main()
