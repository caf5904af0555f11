"""The engine's host work per decode step, with a stand-in model (no forward, constant logits).

At batch 64 the H200 decode step was 18.7 ms with 14.7 ms of device time (docs/perf.md): the rest
is host work — scheduling, page tables, bookkeeping, sampling. This runs the engine's real
scheduler, runner, paged-table building and sampler around a model that only advances its caches,
so what is timed is the host side; cProfile splits it by function (ms per step, cumulative).

    python bench/host_overhead.py --ckpt /tmp/tiny --context 1024,8192
    python bench/host_overhead.py --ckpt /tmp/tiny --tables --context 1024,8192,65536
    python bench/host_overhead.py --ckpt /tmp/tiny --context 1024 --generated 4096   # output_kind
    python bench/host_overhead.py --ckpt /tmp/tiny --logits-width 1024   # without the CPU greedy pick
    python bench/host_overhead.py --ckpt /tmp/tiny --logits-width 1024 --graphs --repeats 7   # the GPU's path
    python bench/host_overhead.py --ckpt /tmp/tiny --logits-width 1024 --graphs --async-scheduling   # its host cost

Each case prints the ms per step without the profiler first, then under cProfile. On the GPU the
greedy pick is device work (an argmax over [batch, vocab]); on the CPU it is most of the step, so
``--logits-width`` narrows the stand-in's logits rows to leave only the pick's host cost.
``--graphs`` decodes through the (CPU-emulated) CUDA-graph path, as on the GPU: the step's inputs
are staged into the graph's static buffer (``decode_tables``) instead of ``host_tables``. On a
shared CPU the wall time is noisy: ``--repeats`` keeps the best, and the thread CPU time is shown.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

WATCH = ("engine.py:", "overlap.py:", "runner.py:", "paged_attention.py:", "manager.py:", "scheduler.py:", "sampler.py:",
         "request.py:")


class StandIn:
    """Advances the caches like a forward and returns constant logits (no device work)."""

    def __init__(self, cfg, device, width: int | None = None):
        self.cfg, self.device, self.dtype = cfg, device, torch.float32
        self.row = torch.zeros(1, width or cfg.vocab_size, device=device)

    def forward(self, token_ids, chunks, logits_rows=None, paged=None, advance=True, **kw):
        from dsv4.model.model import ForwardOutput

        if advance:  # a decode graph's replay advances the caches itself (``DecodeGraphs.run``)
            for c in chunks:
                c.cache.advance(c.length)
        n = token_ids.shape[0] if logits_rows is None else logits_rows.shape[0]
        return ForwardOutput(self.row.expand(n, -1), None)


def run(ckpt: str, batch: int, context: int, steps: int, top: int, generated: int = 0,
        output_kind: str = "cumulative", width: int | None = None, graphs: bool = False, repeats: int = 1,
        async_scheduling: bool = False) -> None:
    from dsv4 import SamplingParams
    from dsv4.config import load_config
    from dsv4.engine.engine import EngineConfig, LLMEngine

    cfg = load_config(ckpt)
    live = generated + (repeats + 1) * steps  # tokens each request generates (prefill, repeats, profile)
    eng = LLMEngine(EngineConfig(model=ckpt, kv_cache_dtype="fp8_ds_mla", max_model_len=context + live + 64,
                                 max_num_seqs=batch, max_num_batched_tokens=batch * context,
                                 kv_cache_memory=4 << 30, attention="batched", backend="torch", device="cpu",
                                 async_scheduling=async_scheduling),
                    backend=StandIn(cfg, torch.device("cpu"), width))
    if graphs:  # the GPU's decode path: inputs staged into a graph's static buffer (emulated on the CPU)
        eng.capture_decode_graphs()
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=live + 16, ignore_eos=True, output_kind=output_kind)
    for _ in range(batch):
        eng.add_request(prompt_token_ids=torch.randint(3, 1000, (context,), generator=g).tolist(), params=sp)
    for _ in range(6 + generated):  # the prefill, then decode steps (``generated``: a long output so far)
        eng.step()
    times, cpu = [], []  # wall, and this thread's CPU time (less disturbed by other processes)
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            eng.step()
        times.append((time.perf_counter() - t0) / steps * 1e3)
        cpu.append((time.thread_time() - c0) / steps * 1e3)
    plain = min(times)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    ms = (time.perf_counter() - t0) / steps * 1e3
    print(f"\nbatch {batch}, context {context}, {generated} tokens generated, output_kind {output_kind}"
          f"{', decode graphs' if graphs else ''}{', async scheduling' if async_scheduling else ''}: {plain:.3f} ms/step (best of {repeats}: "
          f"{' '.join(f'{t:.3f}' for t in times)}; thread CPU best {min(cpu):.3f}), "
          f"{ms:.2f} under cProfile (host only)")
    rows = []
    for (f, line, name), (_, _, _, cum, _) in pstats.Stats(prof).stats.items():
        key = f"{Path(f).name}:{line}({name})"
        if key.startswith(WATCH) and "dsv4" in f:
            rows.append((cum / steps * 1e3, key))
    for t, key in sorted(rows, reverse=True)[:top]:
        print(f"  {key:<55} {t:8.2f} ms/step")


def tables(batch: int, context: int, reps: int = 200) -> None:
    """``PagedBatch.build`` alone, without the profiler's per-call cost: ``batch`` decode requests
    whose window pages below the watermark are released, as a long decode leaves them."""
    import types

    from dsv4.cache.paged import CacheAllocation
    from dsv4.engine.paged_attention import PagedBatch
    from dsv4.model.attention import SeqChunk

    kvc = types.SimpleNamespace(device=torch.device("cpu"))
    allocs = []
    for i in range(batch):
        n_swa = context // 64 + 1
        rel = max(0, n_swa - 3)
        allocs.append(CacheAllocation(blocks=list(range(i * 1000, i * 1000 + context // 256 + 1)),
                                      swa=[-1] * rel + [i, i + 1, i + 2], slot=i, swa_released=rel))
    chunks = [SeqChunk(None, context, 1) for _ in range(batch)]
    for _ in range(20):
        PagedBatch.build(kvc, chunks, allocs, {})
    t0 = time.perf_counter()
    for _ in range(reps):
        PagedBatch.build(kvc, chunks, allocs, {})
    print(f"PagedBatch.build, batch {batch}, context {context}: {(time.perf_counter() - t0) / reps * 1e3:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="a checkpoint (written with the tiny preset if missing)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", default="1024,8192")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--tables", action="store_true", help="time PagedBatch.build alone (no profiler)")
    p.add_argument("--generated", type=int, default=0, help="decode this many tokens before timing")
    p.add_argument("--logits-width", type=int, default=None,
                   help="columns of the stand-in's logits (default: the vocabulary)")
    p.add_argument("--output-kind", default="cumulative,final_only",
                   help="comma-separated SamplingParams.output_kind values to time")
    p.add_argument("--graphs", action="store_true",
                   help="decode through the (CPU-emulated) CUDA-graph path: inputs staged into the graph's buffer")
    p.add_argument("--repeats", type=int, default=1, help="time the plain steps this many times (best is shown)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="the engine's async scheduling (on the CPU nothing overlaps: this is its host cost)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: the stand-in's tiny ops never wait on a busy second core)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.tables:
        for n in (int(x) for x in a.context.split(",")):
            tables(a.batch, n)
        return
    if not Path(a.ckpt, "config.json").exists():
        from dsv4.checkpoint.synthetic import write_checkpoint

        write_checkpoint(a.ckpt, preset="tiny", progress=False)
    for n in (int(x) for x in a.context.split(",")):
        for kind in a.output_kind.split(","):
            run(a.ckpt, a.batch, n, a.steps, a.top, a.generated, kind, a.logits_width, a.graphs, a.repeats,
                a.async_scheduling)


if __name__ == "__main__":
    main()
