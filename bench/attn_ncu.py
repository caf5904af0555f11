"""One launch of the paged sparse attention per case, for Nsight Compute (stall reasons, occupancy).

The cases are ``bench/kernels_attention.py``'s: a whole 8K prompt of one sequence (``csa-prefill``,
``hca-prefill``; the engine's 8K prefill step) and decode batches (``csa-decode1``: T = 1 at 8K,
``csa-decode64``: T = 64 at 64K), bf16 q, 64 heads, OCP ``fp8_ds_mla`` pages, the engine's tile
unless ``--config`` (JSON) overrides it. Each case compiles first (a warm-up call outside the
profiled range), then launches once inside ``cudaProfilerStart``/``Stop``.

    ncu --clock-control none --profile-from-start off -k regex:_sparse_attn_kernel \\
        --section WarpStateStats python3 bench/attn_ncu.py --cases csa-prefill,csa-decode64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_attention import make_case, make_prefill_seq  # noqa: E402

CASES = {
    "csa-prefill": lambda dev, g: make_prefill_seq("csa", 8192, dev, g)[0],
    "hca-prefill": lambda dev, g: make_prefill_seq("hca", 8192, dev, g)[0],
    "csa-decode1": lambda dev, g: make_case("csa", 1, 8192, dev, g)[0],
    "csa-decode64": lambda dev, g: make_case("csa", 64, 65536, dev, g)[0],
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="csa-prefill,csa-decode64", help=f"comma-separated, of {sorted(CASES)}")
    ap.add_argument("--config", default=None, help="JSON tile overrides for paged_sparse_attention")
    a = ap.parse_args(argv)
    from dsv4.ops.triton import sparse_attention as tsa

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    cfg = json.loads(a.config) if a.config else None
    for name in a.cases.split(","):
        if name not in CASES:
            raise SystemExit(f"--cases: unknown case {name!r}; known: {sorted(CASES)}")
        args = CASES[name](dev, g)
        tsa.paged_sparse_attention(*args, config=cfg)  # compile, outside the profiled range
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        tsa.paged_sparse_attention(*args, config=cfg)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"case {name}: T={args[0].shape[0]} config {tsa.pick_config(args[0].shape[1], dev, cfg)}", flush=True)
        del args


if __name__ == "__main__":
    main()
