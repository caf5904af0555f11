"""Where a decode step's small kernels come from: the torch ops one engine step launches, counted
by the dsv4 source line that called them (a TorchDispatchMode over one eager step).

The CUDA-graph profile (bench/e2e.py) names kernels but not their callers, and ~400 launches of a
batch-1 step on the H200 are torch elementwise/copy/index kernels. This runs the engine eagerly
on the fast path (``backend=triton``: on a CPU under TRITON_INTERPRET=1, where the Triton kernels
run in the interpreter and launch no torch ops) and counts every torch op that computes (views
and allocations excluded) by its innermost ``dsv4/`` frame — the fusion candidates, by file:line.

    TRITON_INTERPRET=1 python bench/decode_sources.py --ckpt /tmp/tiny --batch 1
    python bench/decode_sources.py --ckpt /tmp/fw4 --batch 64 --out sources.json   # on the GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# ops that only make views, metadata or uninitialised memory: no kernel on the device
FREE = {"empty", "empty_strided", "view", "_unsafe_view", "as_strided", "_reshape_alias", "reshape", "detach",
        "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze", "squeeze", "alias", "split",
        "split_with_sizes", "unbind", "lift_fresh", "_to_copy_noop", "unfold", "diagonal", "chunk", "narrow",
        "view_as_real", "view_as_complex", "_local_scalar_dense", "is_pinned", "set_", "resize_", "size", "stride",
        "sym_size", "sym_stride", "sym_numel", "numel", "dim", "record_stream", "_pin_memory", "pin_memory"}


# ops whose result the host must wait for (a device→host synchronisation on the GPU)
SYNC = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "unique", "_unique2", "equal"}


def _caller() -> str:
    for fr in reversed(traceback.extract_stack(limit=40)):
        if "/dsv4/" in fr.filename and "/triton/" not in fr.filename.split("/dsv4/", 1)[1][:10]:
            return f"{fr.filename.split('/dsv4/', 1)[1]}:{fr.lineno} {fr.name}"
    return "?"


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by: dict = defaultdict(Counter)
        self.syncs: dict = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC:
            self.syncs[_caller()][name] += 1
        if name not in FREE:
            self.by[_caller()][name] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--out", default=None)
    ap.add_argument("--prefill", type=int, default=0, help="count one prefill step of a prompt this long instead")
    ap.add_argument("--backend", default="triton", help="triton (the fast path; TRITON_INTERPRET=1 on a CPU) or torch "
                    "(the same engine glue around the torch ops: quick on a CPU)")
    a = ap.parse_args()
    from dsv4 import LLM, SamplingParams

    gpu = torch.cuda.is_available()
    llm = LLM(a.ckpt, dtype="bfloat16" if gpu else "float32", kv_cache_dtype="fp8_ds_mla",
              max_model_len=max(1024, a.prefill + 64), max_num_seqs=max(a.batch, 1),
              max_num_batched_tokens=max(4096, 300 * a.batch, a.prefill),
              kv_cache_memory=(4 << 30) if gpu else None, enable_prefix_caching=False, enforce_eager=True,
              backend=a.backend)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    for _ in range(0 if a.prefill else a.batch):
        eng.add_request(prompt_token_ids=torch.randint(3, 500, (300,), generator=g).tolist(),
                        params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for _ in range(0 if a.prefill else 2):  # the prefill (every prompt in one step) and one decode step
        eng.step()
    if a.prefill:
        eng.add_request(prompt_token_ids=torch.randint(3, 500, (a.prefill,), generator=g).tolist(),
                        params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    mode = Count()
    with mode:
        eng.step()
    what = f"prefill of {a.prefill} tokens" if a.prefill else f"batch {a.batch}: decode step"
    rows = sorted(((sum(c.values()), w, dict(c.most_common(5))) for w, c in mode.by.items()), reverse=True)
    total = sum(r[0] for r in rows)
    print(f"{what}: {total} computing torch ops in one eager step (Triton launches not counted)")
    for n, w, ops in rows[:a.top]:
        print(f"{n:5d}  {w[:78]:78s} {' '.join(f'{k}:{v}' for k, v in ops.items())[:90]}")
    syncs = sorted(((sum(c.values()), w, dict(c)) for w, c in mode.syncs.items()), reverse=True)
    print(f"{sum(r[0] for r in syncs)} ops the host waits for (device→host synchronisations on a GPU):")
    for n, w, ops in syncs[:a.top]:
        print(f"{n:5d}  {w[:78]:78s} {' '.join(f'{k}:{v}' for k, v in ops.items())[:90]}")
    if a.out:
        Path(a.out).write_text(json.dumps({"what": what, "total": total, "rows": rows, "syncs": syncs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
