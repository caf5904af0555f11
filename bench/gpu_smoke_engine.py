"""GPU smoke test of the engine's fast path, one variant per process (a device-side assert is
sticky): eager batched attention, CUDA graphs, the 'auto' cache. Prints the first dsv4 frames of
any failure. Run with CUDA_LAUNCH_BLOCKING=1 to get the failing kernel's own frame.

    python bench/gpu_smoke_engine.py            # all variants
    python bench/gpu_smoke_engine.py --variant eager-fp8
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "eager-fp8": dict(enforce_eager=True, kv_cache_dtype="fp8_ds_mla"),
    "graphs-fp8": dict(kv_cache_dtype="fp8_ds_mla"),
    "graphs-auto": dict(kv_cache_dtype="auto"),
}


def one(name: str, ckpt: str) -> int:
    import torch

    from dsv4.engine.sampling_params import SamplingParams
    from dsv4.llm import LLM

    t = time.time()
    try:
        llm = LLM(ckpt, max_model_len=1024, kv_cache_memory=1 << 30, max_num_seqs=8, **VARIANTS[name])
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, 120000, (n,), generator=g).tolist() for n in (5, 300, 257)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        print(f"{name}: ok in {time.time() - t:.1f}s", [o.outputs[0].token_ids[:3] for o in outs], flush=True)
        return 0
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "dsv4" in f.filename or "bench" in f.filename]
        print(f"{name}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        for f in frames[-8:]:
            print(f"   {Path(f.filename).name}:{f.lineno} {f.name}: {f.line}")
        return 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default=None)
    ap.add_argument("--ckpt", default="/tmp/tiny_smoke")
    a = ap.parse_args()
    if not Path(a.ckpt, "config.json").exists():
        subprocess.run([sys.executable, "-m", "dsv4.cli", "make-checkpoint", "--preset", "tiny", "--out", a.ckpt,
                        "--quiet"], check=True, cwd=ROOT)
    if a.variant:
        return one(a.variant, a.ckpt)
    rc = 0
    for name in VARIANTS:
        rc |= subprocess.run([sys.executable, __file__, "--variant", name, "--ckpt", a.ckpt]).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
