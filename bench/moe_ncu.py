"""One launch of the grouped MXFP4 MoE kernels per T, for Nsight Compute (stall reasons, occupancy).

The CUDA-graph timings (``bench/kernels.py``) say how long the kernels take, not why; ``ncu``
reads the hardware counters on the H200 (Firecracker machines; ``--clock-control none``, the
clocks left alone). Each T compiles first (a warm-up call outside the profiled range, marked by
``cudaProfilerStart``/``Stop``), then launches once inside it. Flash's shapes, the engine's tiles
(``pick_moe_config``) unless ``--config`` (JSON) overrides them.

    ncu --clock-control none --profile-from-start off -k regex:_moe_ --section WarpStateStats \\
        python3 bench/moe_ncu.py --t 1,64,8192
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import HID, N_EXP, TOPK, random_fp4_experts  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--t", default="1,64,8192", help="token counts, one profiled launch each")
    ap.add_argument("--config", default=None, help="JSON config overrides for moe_experts")
    ap.add_argument("--scales", choices=("checkpoint", "rows-contiguous"), default="rows-contiguous",
                    help="the MXFP4 scales' memory layout: the checkpoint's, or groups-major as the engine stacks "
                         "them (bench/kernels.py rows_contiguous)")
    a = ap.parse_args(argv)
    from dsv4.ops import torch_ops
    from dsv4.ops.triton import moe as tmoe

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w13, s13, w2, s2 = random_fp4_experts(dev, g)
    if a.scales == "checkpoint":
        s13, s2 = s13.contiguous(), s2.contiguous()
    cfg = json.loads(a.config) if a.config else None
    for t in (int(v) for v in a.t.split(",")):
        x = torch.randn(t, HID, device=dev, dtype=torch.bfloat16, generator=g)
        ids, wts = torch_ops.moe_route(torch.randn(t, N_EXP, device=dev, generator=g), None, TOPK, 1.5, True)
        tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=cfg)  # compile, outside the profiled range
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        tmoe.moe_experts(x, ids, wts, w13, s13, w2, s2, config=cfg)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"T={t}: config {tmoe.pick_moe_config(t, TOPK, N_EXP, 'fp4', cfg)}", flush=True)


if __name__ == "__main__":
    main()
