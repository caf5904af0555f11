"""Where a decode step's small kernels come from: device time and launches per step, grouped by the
dsv4 source line whose torch call launched them (eager steps, torch.profiler with stacks).

The CUDA-graph profile (bench/e2e.py) names kernels but not their callers; ~400 launches of a
batch-1 step are torch elementwise/copy/index kernels. This runs the same engine with
``enforce_eager`` and attributes every kernel to the innermost ``dsv4/`` frame of the CPU op that
launched it, so the fusion candidates are named by file:line.

    python bench/decode_sources.py --ckpt /tmp/fw4 --batch 1 --top 50 --out sources.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def frame_of(stack: list[str]) -> str:
    """The innermost dsv4 frame of a CPU op's stack ('file.py(line): fn')."""
    for fr in stack:
        if "/dsv4/" in fr:
            return fr.split("/dsv4/", 1)[1]
    return stack[0] if stack else "?"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from dsv4 import LLM, SamplingParams

    llm = LLM(a.ckpt, dtype="bfloat16", kv_cache_dtype="fp8_ds_mla", max_model_len=1024, max_num_seqs=max(a.batch, 1),
              max_num_batched_tokens=4096, kv_cache_memory=4 << 30, enable_prefix_caching=False, enforce_eager=True)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    for _ in range(a.batch):
        eng.add_request(prompt_token_ids=torch.randint(3, 1000, (300,), generator=g).tolist(),
                        params=SamplingParams(temperature=0, max_tokens=a.steps + 8, ignore_eos=True))
    for _ in range(4):  # the prefill and warm-up decode steps (every kernel compiled)
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(a.steps):
            eng.step()
        torch.cuda.synchronize()
    # device time of the kernels each CPU op launched, by the op's innermost dsv4 frame
    by: dict = defaultdict(lambda: [0.0, 0, set()])
    total = 0.0
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU or not ev.kernels:
            continue
        where = frame_of(ev.stack or [])
        for k in ev.kernels:
            by[where][0] += k.duration / 1e3 / a.steps
            by[where][1] += 1 / a.steps
            by[where][2].add(ev.name)
            total += k.duration / 1e3 / a.steps
    rows = sorted(([round(v[0], 4), round(v[1], 1), w, sorted(v[2])[:4]] for w, v in by.items()), reverse=True)
    print(f"batch {a.batch}: {total:.3f} ms of kernels per eager step, {sum(r[1] for r in rows):.0f} launches")
    for ms, n, w, ops in rows[:a.top]:
        print(f"{ms:8.4f} ms {n:6.1f}x  {w[:80]:80s} {','.join(ops)[:70]}")
    if a.out:
        Path(a.out).write_text(json.dumps({"batch": a.batch, "total_ms": total, "rows": rows}, indent=1, default=list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
