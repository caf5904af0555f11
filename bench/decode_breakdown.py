"""Where one decode step's time goes (GPU): wall time per op, with a device sync around each op.

    python bench/decode_breakdown.py --ckpt /tmp/fw4 --make-preset flash-width --batches 1,64

Syncing around every op inflates the total a little (the sum is printed next to the unsynced
step time), but it attributes time honestly when most of it is launch and host overhead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TIMES: dict[str, float] = defaultdict(float)  # exclusive (self) time per label
COUNTS: dict[str, int] = defaultdict(int)
_STACK: list[float] = []  # child time accumulated by each open timed op


def timed(owner, attr: str, label: str) -> None:
    fn = getattr(owner, attr)

    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        _STACK.append(0.0)
        try:
            return fn(*a, **k)
        finally:
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            children = _STACK.pop()
            TIMES[label] += dt - children
            COUNTS[label] += 1
            if _STACK:
                _STACK[-1] += dt

    setattr(owner, attr, wrapper)


def instrument() -> None:
    import dsv4.model.attention as A
    import dsv4.model.model as M
    import dsv4.model.moe as MO
    from dsv4.engine import engine as E
    from dsv4.engine import runner as R
    from dsv4.engine import sampler as S
    from dsv4.engine import scheduler as SC

    timed(A.Compressor, "run", "attn: compressor (state save + pooling + cache insert)")
    timed(A.Attention, "indexer_topk", "attn: lightning indexer (q, scores, top-k)")
    timed(A, "sparse_attention", "attn: sparse attention (gather + softmax)")
    timed(A.Attention, "_attend", "attn: window KV write/read, index lists (rest of per-seq)")
    timed(MO.MoE, "forward", "moe: routing + experts + shared expert")
    timed(M, "hc_pre", "mHC pre (mixes GEMM + Sinkhorn)")
    timed(M, "hc_post", "mHC post")
    timed(M.ReferenceModel, "logits_from_streams", "hc_head + norm + lm head")
    timed(S.Sampler, "sample", "sampler")
    timed(SC.Scheduler, "schedule", "scheduler")
    timed(R.ModelRunner, "build", "runner: batch metadata")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--make-preset", default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.make_preset and not Path(a.ckpt, "config.json").exists():
        subprocess.run([sys.executable, "-m", "dsv4.cli", "make-checkpoint", "--preset", a.make_preset, "--layers",
                        str(a.layers), "--out", a.ckpt, "--device", "cuda", "--quiet"], check=True, cwd=ROOT)
    from dsv4 import LLM, SamplingParams

    batches = [int(x) for x in a.batches.split(",")]
    llm = LLM(a.ckpt, dtype="bfloat16", max_model_len=1024, max_num_seqs=max(batches), max_num_batched_tokens=4096,
              kv_cache_memory=16 << 30, enable_prefix_caching=False)
    eng = llm.engine
    results = {}
    g = torch.Generator().manual_seed(0)
    for B in batches:
        for _ in range(B):
            eng.add_request(prompt_token_ids=torch.randint(3, 120000, (200,), generator=g).tolist(),
                            params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        for _ in range(4):
            eng.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        steps = 5
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        plain = (time.perf_counter() - t) / steps * 1e3
        if B == batches[0]:
            instrument()
        TIMES.clear()
        COUNTS.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        synced = (time.perf_counter() - t) / steps * 1e3
        rows = sorted(((k, v / steps * 1e3, COUNTS[k] / steps) for k, v in TIMES.items()), key=lambda r: -r[1])
        accounted = sum(r[1] for r in rows)
        print(f"\nbatch {B}: decode step {plain:.2f} ms unsynced, {synced:.2f} ms with per-op syncs")
        print(f"{'op':60s} {'ms/step':>9s} {'share':>7s} {'calls/step':>10s}")
        for k, ms, c in rows:
            print(f"{k:60s} {ms:9.2f} {ms / synced * 100:6.1f}% {c:10.0f}")
        print(f"{'other (linears outside the above, embedding, Python)':60s} {synced - accounted:9.2f} "
              f"{(synced - accounted) / synced * 100:6.1f}%")
        results[B] = {"step_ms": plain, "synced_ms": synced, "ops": {k: ms for k, ms, _ in rows}}
        while eng.has_unfinished_requests():
            eng.step()
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
