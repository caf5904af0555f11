"""Host time of an eager engine step: a prompt's prefill chunk beside running decodes, as a server sees it.

``--running`` requests decode (CUDA graphs where the engine has them) when a ``--prompt``-token prompt
arrives; the step that prefills it runs eagerly. For each variant (no speculation, MTP with each
``--spec-k``; each in a process of its own) this prints the eager step's wall time, the GPU's busy
time in it (the sum of its kernels, torch profiler; with speculation the running requests' verify
graph replays in the same step and its kernels count too) and its kernel count, the decode step's
wall time around it, and where the
eager step's host time goes (cProfile, grouped: Triton's launcher, torch ops, the model's Python, the
engine's). A step whose wall time is far above its GPU time is bound by the host.

    python bench/host_step.py --model dsv4/assets/canary --running 15 --prompt 256 --spec-k 0,2
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time

import torch

from dsv4.engine.sampling_params import SamplingParams
from dsv4.llm import LLM

AREAS = (  # (area, test on a cProfile entry's (file, function)), first match wins
    ("triton launch", lambda f, fn: "triton" in f and "dsv4" not in f),
    ("torch ops", lambda f, fn: f == "~" or "torch" in f),
    ("dsv4 ops", lambda f, fn: "dsv4/ops" in f),
    ("dsv4 model", lambda f, fn: "dsv4/model" in f),
    ("dsv4 cache", lambda f, fn: "dsv4/cache" in f),
    ("dsv4 engine", lambda f, fn: "dsv4/engine" in f),
)


def areas(stats: pstats.Stats) -> dict[str, float]:
    """Self time (ms) by area."""
    out: dict[str, float] = {}
    for (f, _line, fn), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
        name = next((a for a, test in AREAS if test(f, fn)), "other")
        out[name] = out.get(name, 0.0) + tt * 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Scenario:
    """``running`` requests decoding; ``mixed()`` adds a prompt, runs the step that prefills it, aborts it."""

    def __init__(self, engine, running: int, prompt: int, vocab: int, seed: int = 0):
        self.engine, self.prompt, self.vocab = engine, prompt, vocab
        self.rng = random.Random(seed)
        self.params = SamplingParams(max_tokens=1024, temperature=0, ignore_eos=True)
        self.n = 0
        for _ in range(running):
            self._add()
        for _ in range(4):  # every running request decoding (and drafting)
            engine.step()

    def _add(self) -> str:
        self.n += 1
        rid = f"r{self.n}"
        ids = [self.rng.randrange(2, self.vocab) for _ in range(self.prompt)]
        self.engine.add_request(ids, self.params, request_id=rid)
        return rid

    def decode(self) -> float:
        _sync()
        t = time.perf_counter()
        self.engine.step()
        _sync()
        return time.perf_counter() - t

    def mixed(self, wrap=None) -> float:
        rid = self._add()
        _sync()
        t = time.perf_counter()
        with wrap or contextlib.nullcontext():
            self.engine.step()
        _sync()
        t = time.perf_counter() - t
        self.engine.abort_request(rid)
        for _ in range(3):  # back to steady decoding
            self.engine.step()
        return t


class GcPauses:
    """Seconds the garbage collector ran (all generations) while active."""

    def __init__(self):
        self.total, self._t0, self.active = 0.0, 0.0, False
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if not self.active:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._t0


def measure(model: str, k: int, running: int, prompt: int, reps: int, top: int, kv_mib: int) -> dict:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(model, max_num_seqs=64, max_model_len=2048, speculative_config=spec, async_scheduling=False,
              kv_cache_memory=kv_mib << 20)
    eng = llm.engine
    sc = Scenario(eng, running, prompt, eng.model_config.vocab_size)
    sc.mixed()  # every eager specialization built
    pauses = GcPauses()
    pauses.active = True
    walls = sorted(sc.mixed() for _ in range(reps))
    pauses.active = False
    gc.callbacks.remove(pauses._cb)
    decodes = sorted(sc.decode() for _ in range(reps))
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    sc.mixed(prof)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / 1e3
    names: dict[str, int] = {}
    for e in kernels:
        names[e.name[:60]] = names.get(e.name[:60], 0) + 1
    cp = cProfile.Profile()  # (a context manager: enabled inside the step only)
    sc.mixed(cp)
    st = pstats.Stats(cp)
    by_area = areas(st)
    launches = sum(nc for (f, _l, fn), (_cc, nc, *_r) in st.stats.items() if fn == "run" and "triton" in f
                   and "jit" in f)
    st.sort_stats("tottime")
    hot = [(f"{f.split('site-packages/')[-1].split('/work/')[-1]}:{fn}", nc, round(tt * 1e3, 2))
           for (f, _l, fn), (_cc, nc, tt, _ct, _c) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]]
    cum = [(f"{f.split('/work/')[-1]}:{fn}", nc, round(ct * 1e3, 2))
           for (f, _l, fn), (_cc, nc, _tt, ct, _c) in sorted(st.stats.items(), key=lambda kv: -kv[1][3])
           if "dsv4" in f][:top]
    llm.shutdown()
    del llm, eng, sc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"spec_k": k, "mixed_ms": walls[len(walls) // 2] * 1e3, "decode_ms": decodes[len(decodes) // 2] * 1e3,
            "gc_ms_per_mixed": pauses.total / reps * 1e3,
            "gpu_busy_ms": gpu_ms, "kernels": len(kernels), "triton_launches": launches,
            "python_calls": st.total_calls, "profiled_ms": st.total_tt * 1e3, "areas_ms": by_area, "hot": hot,
            "cumulative": cum, "kernel_names": sorted(names.items(), key=lambda kv: -kv[1])[:top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dsv4/assets/canary")
    p.add_argument("--running", type=int, default=15)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--spec-k", default="0,2", help="comma-separated: 0 = no speculation, k = MTP with k drafts")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="hottest functions (self time) to print")
    p.add_argument("--kv-cache-memory", type=int, default=2048, help="MiB (each variant's engine in turn)")
    p.add_argument("--out")
    a = p.parse_args()
    ks = a.spec_k.split(",")
    if len(ks) == 1:
        rows = [measure(a.model, int(ks[0]), a.running, a.prompt, a.reps, a.top, a.kv_cache_memory)]
    else:  # each variant in a process of its own: a second engine in one process measured up to 1.8x slower
        rows = []
        for k in ks:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "row.json")
                subprocess.run([sys.executable, __file__, "--model", a.model, "--running", str(a.running), "--prompt",
                                str(a.prompt), "--reps", str(a.reps), "--top", str(a.top), "--kv-cache-memory",
                                str(a.kv_cache_memory), "--spec-k", k, "--out", out],
                               check=True, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    rows += json.load(f)["rows"]
    print(f"{'spec k':>6} {'mixed ms':>9} {'GPU busy':>9} {'kernels':>8} {'launches':>9} {'py calls':>9} "
          f"{'decode ms':>10} {'GC ms':>6}")
    for r in rows:
        print(f"{r['spec_k']:>6} {r['mixed_ms']:>9.2f} {r['gpu_busy_ms']:>9.2f} {r['kernels']:>8} "
              f"{r['triton_launches']:>9} {r['python_calls']:>9} {r['decode_ms']:>10.2f} {r['gc_ms_per_mixed']:>6.2f}")
    for r in rows:
        print(f"\nspec k={r['spec_k']}: profiled {r['profiled_ms']:.1f} ms, self time by area:",
              ", ".join(f"{k} {v:.1f}" for k, v in r["areas_ms"].items()))
        for name, nc, ms in r["hot"]:
            print(f"  {ms:8.2f} ms {nc:6d}  {name}")
        print("  cumulative (dsv4 functions):")
        for name, nc, ms in r["cumulative"]:
            print(f"  {ms:8.2f} ms {nc:6d}  {name}")
        print("  GPU kernels by name:", "; ".join(f"{n} ×{c}" for n, c in r["kernel_names"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
