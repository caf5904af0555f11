"""Where a prefill's wall time goes that is not kernel time: the GPU's idle gaps and what the host did in them.

``bench/e2e.py`` reports the 8K prefill's wall time and its kernels' device time; the difference (~7.6 ms of
126 in the sixteenth session) is time the GPU waits on the host. This runs the same engine and prompt under
torch.profiler with the host's Python stack and CUDA runtime calls, then, from the trace:

* the step's wall time, the union of the GPU's busy intervals and the idle remainder;
* the host-to-device synchronisations (stream / event / device synchronize, device-to-host copies), each
  with the innermost dsv4 frame that issued it;
* the largest GPU idle gaps, each with the CUDA runtime calls inside it and the innermost dsv4 frames
  running at its start and middle (what the host was doing while the GPU had nothing to run).

    PYTHONPATH=. python3 bench/prefill_trace.py --ckpt /tmp/fw4 --len 8192 --out $OUT/prefill_trace.json

``--trace FILE`` also writes the Chrome trace. ``--analyze FILE`` reads a saved Chrome trace instead of
running (for reading a device call's trace here).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaStreamWaitEvent")


def busy_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge [start, end) intervals (µs) into disjoint sorted ones."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _frames_at(py: list[dict], starts: list[float], t: float, limit: int = 3) -> list[str]:
    """The innermost dsv4 Python frames (file:line(function)) whose interval holds time t."""
    i = bisect.bisect_right(starts, t)
    hits = [ev for ev in py[max(0, i - 4000):i] if ev["ts"] + ev.get("dur", 0) >= t]
    hits.sort(key=lambda ev: ev.get("dur", 0))  # innermost first
    names = [ev["name"] for ev in hits if "dsv4/" in ev["name"] or "bench/" in ev["name"]]
    return [n.split("dsv4/")[-1] if "dsv4/" in n else n.split("bench/")[-1] for n in names[:limit]]


def analyze(trace: dict, top: int = 15, min_gap_us: float = 20.0) -> dict:
    """Wall / busy / idle, the syncs and the largest idle gaps of a Chrome trace (one profiled prefill)."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    rt = [e for e in evs if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"]
    py = sorted((e for e in evs if e.get("cat") == "python_function"), key=lambda e: e["ts"])
    starts = [e["ts"] for e in py]
    if not gpu:
        raise ValueError("the trace has no GPU kernel events (was it taken with ProfilerActivity.CUDA?)")
    host_lo = min(e["ts"] for e in evs if e.get("cat") in ("cpu_op", "python_function", "cuda_runtime"))
    lo, hi = host_lo, max(e["ts"] + e["dur"] for e in gpu)
    busy = busy_union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    busy_us = sum(e - s for s, e in busy)
    gaps = [(busy[0][0] - lo, lo, busy[0][0])] if busy[0][0] > lo else []
    gaps += [(b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= min_gap_us]
    gaps.sort(reverse=True)
    syncs = []
    for e in rt:
        name = e["name"]
        if any(name.startswith(s) for s in SYNC_CALLS):
            syncs.append(dict(call=name, ts_ms=round((e["ts"] - lo) / 1e3, 3), dur_us=round(e["dur"], 1),
                              frames=_frames_at(py, starts, e["ts"] + e["dur"] / 2)))
    rows = []
    for g_us, s, e in gaps[:top]:
        inside = {}
        for r in rt:
            if s <= r["ts"] < e:
                inside[r["name"]] = inside.get(r["name"], 0) + 1
        rows.append(dict(gap_us=round(g_us, 1), start_ms=round((s - lo) / 1e3, 3), runtime_calls=inside,
                         frames_at_start=_frames_at(py, starts, s + 1), frames_at_middle=_frames_at(py, starts, (s + e) / 2)))
    small = sum(b[0] - a[1] for a, b in zip(busy, busy[1:]) if b[0] - a[1] < min_gap_us)
    return dict(wall_ms=round((hi - lo) / 1e3, 3), gpu_busy_ms=round(busy_us / 1e3, 3),
                gpu_idle_ms=round((hi - lo - busy_us) / 1e3, 3), idle_in_small_gaps_ms=round(small / 1e3, 3),
                idle_before_first_kernel_ms=round((busy[0][0] - lo) / 1e3, 3), kernels=len(gpu),
                syncs=syncs, largest_gaps=rows)


def print_report(rep: dict) -> None:
    print(f"wall {rep['wall_ms']} ms, GPU busy {rep['gpu_busy_ms']} ms, idle {rep['gpu_idle_ms']} ms "
          f"(before the first kernel {rep['idle_before_first_kernel_ms']}, in gaps < 20 us "
          f"{rep['idle_in_small_gaps_ms']}), {rep['kernels']} GPU events")
    print(f"host syncs / copies ({len(rep['syncs'])}):")
    for s in rep["syncs"][:40]:
        print(f"  {s['ts_ms']:9.3f} ms {s['dur_us']:9.1f} us {s['call']:26s} {' < '.join(s['frames'])}")
    print("largest GPU idle gaps:")
    for g in rep["largest_gaps"]:
        calls = ", ".join(f"{k}×{v}" for k, v in sorted(g["runtime_calls"].items(), key=lambda kv: -kv[1])[:4])
        print(f"  {g['gap_us']:9.1f} us at {g['start_ms']:8.3f} ms  [{calls}]")
        print(f"      start:  {' < '.join(g['frames_at_start'])}")
        print(f"      middle: {' < '.join(g['frames_at_middle'])}")


def run(ckpt: str, length: int, trace_path: str | None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dsv4 import LLM, SamplingParams

    # the e2e bench's engine (its prefill runs on the default engine), without decode graphs: a prefill
    # step never replays one, and capturing them takes ~100 s
    llm = LLM(ckpt, dtype="bfloat16", kv_cache_dtype="fp8_ds_mla", max_model_len=length + 64, max_num_seqs=64,
              max_num_batched_tokens=length, kv_cache_memory=16 << 30, enable_prefix_caching=False,
              enforce_eager=True, async_scheduling=True)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)

    def prefill():
        ids = torch.randint(3, 120000, (length,), generator=g).tolist()
        eng.add_request(prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()
        torch.cuda.synchronize()

    walls = []
    for _ in range(3):  # the first compiles this shape's kernels
        torch.cuda.synchronize()
        t = time.perf_counter()
        prefill()
        walls.append((time.perf_counter() - t) * 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        prefill()
    path = trace_path or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        rep = analyze(json.load(f))
    rep["unprofiled_wall_ms"] = [round(w, 2) for w in walls]
    rep["length"] = length
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default="/tmp/fw4")
    ap.add_argument("--len", type=int, default=8192)
    ap.add_argument("--out")
    ap.add_argument("--trace", help="also write the Chrome trace here")
    ap.add_argument("--analyze", help="read this Chrome trace instead of running")
    a = ap.parse_args()
    if a.analyze:
        with open(a.analyze) as f:
            rep = analyze(json.load(f))
    else:
        rep = run(a.ckpt, a.len, a.trace)
        print(f"prefill {a.len}: unprofiled wall ms {rep['unprofiled_wall_ms']} (first run compiles)")
    print_report(rep)
    if a.out:
        Path(a.out).write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
