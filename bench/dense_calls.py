"""Every dense_linear call of one prefill, timed (run on the GPU): which of the batch-invariant
dense GEMMs (compressor states, indexer head weights, router, head) take a prefill's time.

The Triton ``dense_linear`` is wrapped before the engine resolves its ops, so each call is timed
with CUDA events (synchronizing around it) and listed with its shapes, dtypes and caller.

    PYTHONPATH=. python3 bench/dense_calls.py --ckpt /tmp/fw4 --prefill 8192
"""

from __future__ import annotations

import argparse
import collections
import inspect
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--prefill", type=int, default=8192)
    args = ap.parse_args(argv)
    from dsv4 import LLM, SamplingParams
    from dsv4.ops.triton import dense as td

    inner = td.dense_linear
    calls: list = []
    timing = {"on": False}

    def timed(x, w, **kw):
        if not timing["on"]:
            return inner(x, w, **kw)
        fr = next((f for f in inspect.stack()[1:] if Path(f.filename).name != "linear.py"), inspect.stack()[1])
        caller = f"{Path(fr.filename).name}:{fr.lineno} {fr.function}"
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        y = inner(x, w, **kw)
        b.record()
        torch.cuda.synchronize()
        calls.append((a.elapsed_time(b), caller, tuple(x.shape), str(x.dtype), tuple(w.shape), str(w.dtype),
                      {k: str(v) for k, v in kw.items()}))
        return y

    td.dense_linear = timed  # the registry imports "dsv4.ops.triton.dense:dense_linear" lazily
    llm = LLM(args.ckpt, dtype="bfloat16", kv_cache_dtype="fp8_ds_mla", max_model_len=args.prefill + 64,
              max_num_seqs=4, max_num_batched_tokens=args.prefill, kv_cache_memory=8 << 30,
              enable_prefix_caching=False)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    for rep in range(2):  # the first compiles
        ids = torch.randint(3, 120000, (args.prefill,), generator=g).tolist()
        timing["on"] = rep == 1
        t = time.perf_counter()
        eng.add_request(prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()
        torch.cuda.synchronize()
        print(f"prefill {args.prefill} run {rep}: {time.perf_counter() - t:.3f} s", flush=True)
    total = sum(c[0] for c in calls)
    print(f"{len(calls)} dense_linear calls, {total:.3f} ms (each synchronized)")
    for ms, caller, xs, xd, ws, wd, kw in calls:
        print(f"{ms:9.3f} ms  {caller:<40} x{list(xs)} {xd:<15} w{list(ws)} {wd:<15} {kw}")
    agg = collections.defaultdict(float)
    for c in calls:
        agg[c[1]] += c[0]
    print("by caller:", {k: round(v, 3) for k, v in sorted(agg.items(), key=lambda kv: -kv[1])})


if __name__ == "__main__":
    main()
