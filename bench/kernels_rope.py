"""The RoPE kernels at the engine's shapes, against the HBM bound.

Cases (DeepSeek-V4-Flash widths, 64 heads × 512, rope over the last 64 channels): the attention output's
inverse rotation in place (``apply_rope(..., inverse=True, in_place=True)``: only the rope channels move)
and the query's ``unit_norm_rope`` (every channel read and written), at T = 1, 64, 1024 and 8192 tokens.
Each is checked bitwise against the torch reference first, then timed as the median of CUDA-graph replays.
Bound = bytes moved / the copy bandwidth measured in the same run.

    PYTHONPATH=. python3 bench/kernels_rope.py [--out rope.json]     # on the GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import bench_graph, measure_bandwidth  # noqa: E402  (bench/kernels.py)

HEADS, DIM, RD, EPS = 64, 512, 64, 1e-6


def main() -> None:
    from dsv4.config import RopeParams
    from dsv4.model import kernels
    from dsv4.model import rope as mrope
    from dsv4.ops.triton import dense as td
    from dsv4.ops.triton import rope as tr

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,64,1024,8192")
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device("cuda")
    bw = measure_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for t in [int(v) for v in a.tokens.split(",")]:
        x = torch.randn(t, HEADS, DIM, device=dev, generator=g).to(torch.bfloat16)
        pos = torch.randint(0, 1 << 16, (t,), device=dev, generator=g)
        cos, sin = mrope.cos_sin(RopeParams(theta=10000.0, dim=RD), pos)
        ref_inv = mrope.apply_rope(x, cos, sin, inverse=True)
        with kernels.active({"unit_rms_norm": td.unit_rms_norm}):
            ref_unr = mrope.unit_norm_rope(x, cos, sin, EPS)
        cases = (
            ("inverse rope, in place", 2 * t * HEADS * RD * 2, ref_inv,
             lambda buf: tr.apply_rope(buf, cos, sin, inverse=True, in_place=True)),
            ("unit_norm_rope", 2 * t * HEADS * DIM * 2, ref_unr,
             lambda buf: tr.unit_norm_rope(buf, cos, sin, EPS)),
        )
        for name, nbytes, ref, op in cases:
            bound_us = nbytes / bw * 1e6
            buf = x.clone()
            same = torch.equal(op(buf), ref)
            buf = x.clone()  # in place: the timed replays rotate the copy again and again (same work)
            ms = bench_graph(lambda: op(buf))
            us = ms * 1e3 if ms else None
            txt = f"{us:9.1f} us ({bound_us / us:6.1%} of {bound_us:.1f})" if us else f"{'-':>28}"
            print(f"rope T={t:5d} {name:24s} {txt}  {'same bits' if same else 'DIFFERENT BITS'}", flush=True)
            rows_out.append(dict(T=t, case=name, us=us, bound_us=bound_us, same_bits=same))
    if a.out:
        Path(a.out).write_text(json.dumps(dict(bandwidth_Bps=bw, rows=rows_out), indent=1))


if __name__ == "__main__":
    main()
