"""Build the start-up's kernel specializations in parallel, before the graphs and the warm-up run them.

The decode-graph capture and the warm-up (``warmup.py``) meet every specialization a request can
need, but one after another: on an empty kernel cache each is compiled where it is first launched
(the 4-layer checkpoint's 201 took 330 s of a 343 s start on the H200). Compiling is CPU work
(Triton's front end, LLVM, ptxas) that needs no data, only the launch's specialization, so:

1. **list** — the capture's forwards and the warm-up plan run once with no kernel launched
   (``compiles.recording(launch=GREEDY)``: only the greedy sampler's two small kernels run, so the
   steps sample, finish and free as they will for real). Allocations in that pass are zeroed, so the
   host logic and the torch ops between kernels see finite values and in-range indices; the caches
   are left as the warm-up leaves them (prefix cache dropped, counters reset);
2. **build** — worker processes compile the listed specializations (``compiles.build``: Triton's
   ``warmup`` with stand-in arguments of the same dtypes and alignment, no launch) into the on-disk
   kernel cache, as many at once as there are workers;
3. the capture and the warm-up proper then load them from that cache.

A start whose plan (engine settings, model config, kernel sources, Triton version, device) was built
before skips 1-2 (``dsv4-precompiled.txt`` in the kernel cache lists the plans built): a warm start
costs what it did. A specialization a worker could not build is left to the warm-up, which builds it
as before; nothing here changes what runs, only when it is compiled.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from multiprocessing import get_context

import torch

from .. import env

log = logging.getLogger("dsv4.engine")

MANIFEST = "dsv4-precompiled.txt"


def default_workers() -> int:
    """One build process per CPU core but one (the serving process), at most 16."""
    return max(1, min(16, (os.cpu_count() or 2) - 1))


@contextmanager
def zeroed_allocations():
    """``torch.empty`` / ``empty_like`` / ``Tensor.new_empty`` allocate zeroed memory: the listing pass's
    kernels write nothing, and what the steps read back must still be finite and in range."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def zeros(*a, **k):
        return empty(*a, **k).zero_()

    torch.empty = zeros
    torch.empty_like = lambda *a, **k: empty_like(*a, **k).zero_()
    torch.Tensor.new_empty = lambda self, *a, **k: new_empty(self, *a, **k).zero_()
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = empty, empty_like, new_empty


def plan_digest(engine) -> str:
    """What fixes the start-up's specializations: the engine's settings, the model's config, every
    kernel's source, Triton's version and the device."""
    import triton

    from ..ops import compiles

    dev = engine.kv_cache.device
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else ()
    sources = sorted(getattr(k, "cache_key", k.fn.__name__) for k in compiles.jit_kernels())
    text = repr((engine.config, engine.model_config, sources, triton.__version__, str(dev.type), cap))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _manifest_has(digest: str) -> bool:
    path = env.kernel_cache_dir() / MANIFEST
    return path.exists() and digest in path.read_text().split()


def record_built(digest: str) -> None:
    """Note in the kernel cache that this plan's specializations are all there (after the warm-up)."""
    path = env.kernel_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    with open(path / MANIFEST, "a") as f:
        f.write(digest + "\n")


def list_launches(engine, graphs) -> "compiles.Launches":  # noqa: F821 - (imported lazily)
    """Step 1: every launch of the capture (``graphs``: a DecodeGraphs, or None) and of the warm-up
    plan, with no kernel run but the greedy sampler's."""
    from ..ops import compiles
    from ..ops.triton import greedy
    from .warmup import run_warm_up

    with compiles.recording(launch=(greedy._chunk_kernel, greedy._row_kernel)) as rec, zeroed_allocations(), \
            torch.no_grad():
        if graphs is not None:
            graphs.forward_once()
        run_warm_up(engine, dry=True)
    return rec


def _on_device(index: int | None) -> None:
    """A build process's initializer: Triton compiles for the current CUDA device (each process holds a
    context there while it builds)."""
    if index is not None:
        torch.cuda.set_device(index)


def build_parallel(recipes: list, workers: int, device_index: int | None = None) -> tuple[dict, list]:
    """Step 2: compile ``recipes`` (``compiles.recipe``) in ``workers`` processes on CUDA device
    ``device_index`` (None: the default); returns (counts, the launch keys the workers built)."""
    from ..ops import compiles

    env.use_kernel_cache_dir()  # (the workers inherit it)
    failed, built = [], []
    t = time.perf_counter()
    if recipes:
        try:
            with ProcessPoolExecutor(max_workers=min(workers, len(recipes)), mp_context=get_context("spawn"),
                                     initializer=_on_device, initargs=(device_index,)) as pool:
                futures = {pool.submit(compiles.build, r): r for r in recipes}
                for f in as_completed(futures):
                    if f.exception() is not None:
                        failed.append(f"{futures[f][1]}: {f.exception()}")
                    else:
                        built.append(f.result())
        except (BrokenProcessPool, OSError) as e:  # the pool itself: what was not built is the warm-up's
            failed.append(f"the build processes stopped ({e}); {len(recipes) - len(built)} specializations left")
    for line in failed:
        log.warning("precompile: %s (left to the warm-up)", line)
    counts = {"built": len(built), "failed": len(recipes) - len(built), "seconds": round(time.perf_counter() - t, 2)}
    return counts, built


def precompile(engine, graphs, workers: int, digest: str) -> dict | None:
    """Steps 1-2 for ``engine`` before its capture (``graphs``) and warm-up; None when its plan
    (``digest``: ``plan_digest``) was built before (the kernel cache has it all)."""
    if _manifest_has(digest):
        return None
    t = time.perf_counter()
    try:
        rec = list_launches(engine, graphs)
    except Exception as e:
        raise RuntimeError(f"precompile: the listing pass failed ({type(e).__name__}: {e}); "
                           "--compile-workers 0 starts without it") from e
    listed = time.perf_counter() - t
    report = {"digest": digest, "specializations": len(rec.recipes), "list_seconds": round(listed, 2)}
    counts, _ = build_parallel(list(rec.recipes.values()), workers, engine.kv_cache.device.index)
    report.update(counts)
    log.info("precompile: %d specializations listed in %.1f s, built by %d processes in %.1f s (%d failed)",
             report["specializations"], listed, workers, report["seconds"], report["failed"])
    return report
