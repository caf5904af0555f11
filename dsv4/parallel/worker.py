"""Worker ranks: join the group, load this rank's shard, then run whatever step rank 0 broadcasts.

A worker has no scheduler, tokenizer or sampler: rank 0 decides everything and sends a
:class:`~dsv4.parallel.plan.StepPlan` before each forward; the worker runs the same forward over
its own (identical) paged cache so that every collective inside the model is matched. Any
exception ends the process with a non-zero code (rank 0 then sees a dead worker and stops),
and a worker whose parent (rank 0, or a headless node's launcher) is gone exits too.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("dsv4.parallel")


def rank_device(config, local_rank: int):
    """cuda:<local rank> when the engine runs on CUDA, else the CPU."""
    import torch

    dev = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return torch.device("cuda", local_rank) if dev.type == "cuda" else dev


def load_shard(config, tp, device):
    """Load this rank's shard of the model; returns (model, stats for the startup report)."""
    import torch

    from ..model.model import ReferenceModel
    from ..ops.selection import resolve_op_set
    from .group import peak_memory

    t0 = time.monotonic()
    model = ReferenceModel(config.model, dtype=config.torch_dtype(device), device=device, act_quant=config.act_quant,
                           ops=resolve_op_set(config.backend, config.attention, device), tp=tp)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats = {"rank": tp.rank, "node": tp.spec.node_rank, "pid": os.getpid(), "device": str(device),
             "load_s": round(time.monotonic() - t0, 2), **peak_memory(device)}
    return model, stats


def watch_parent(parent_pid: int) -> None:
    """Exit when the parent process is gone (it was killed and could not stop us)."""
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, name="dsv4-parent-watch", daemon=True).start()


def worker_main(config, spec, local_rank: int, port: int, parent_pid: int) -> None:
    """Entry point of a spawned worker process (rank ``spec.global_rank(local_rank)``)."""
    rank = spec.global_rank(local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole process group: rank 0 decides
    watch_parent(parent_pid)
    try:
        _serve_steps(config, spec, rank, local_rank, port)
    except BaseException:  # noqa: BLE001 - any failure ends this rank; rank 0 reports it
        log.exception("tensor-parallel worker rank %d failed", rank)
        sys.stderr.flush()
        os._exit(1)


def _serve_steps(config, spec, rank: int, local_rank: int, port: int) -> None:
    import torch.distributed as dist

    from .group import TPGroup, init_distributed

    device = rank_device(config, local_rank)
    tp = TPGroup(spec, rank, device, init_distributed(spec, rank, device, port))
    box = [None]
    dist.broadcast_object_list(box, src=0, group=tp.startup)  # rank 0's resolved EngineConfig: every node agrees
    config = box[0]
    model, stats = load_shard(config, tp, device)
    log.info("rank %d loaded its shard in %.1f s: peak host RSS %.0f MiB%s", rank, stats["load_s"],
             stats["host_peak_mib"], "" if stats["device_peak_mib"] is None else
             f", peak device memory {stats['device_peak_mib']:.0f} MiB")
    dist.gather_object(stats, None, dst=0, group=tp.startup)
    serve_plans(model, tp, device)
    dist.destroy_process_group()


def _graph_exchange(model, graph: bool = True):
    """Inside a data-parallel rank a decode graph's MoE layers use the dense exchange
    (``EPGroup.dense_mode``), as on the leader; elsewhere nothing changes."""
    import contextlib

    ep = getattr(model, "ep", None)
    return ep.dense_mode() if graph and ep is not None else contextlib.nullcontext()


def serve_plans(model, tp, device, on_report=None) -> None:
    """Run the step plans of this rank's tensor-parallel group until a "shutdown" plan: rank 0 of
    the group (``tp.leader``) sends them on the group's control group. An "idle" plan is a
    data-parallel rank's dummy forward (its MoE exchanges, which span every process); a "report"
    plan calls ``on_report()`` (its startup report: the leader's engine is built by then)."""
    import torch
    import torch.distributed as dist

    from ..cache.copies import make_copy_engine
    from ..cache.host_tier import HostKVStore
    from ..cache.paged import PagedKVCache
    from .plan import run_mtp, run_step

    kvc = graphs = host = picks = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=tp.leader, group=tp.ctrl)
        plan = box[0]
        if plan.kind == "shutdown":
            break
        if plan.kind == "cache":
            kvc = PagedKVCache(model.cfg, plan.numerics, plan.budget, model.dtype, device)  # rank 0's, as they are
            if plan.host_slots:  # rank 0's slot count: its transfers name the slots
                host = HostKVStore(kvc, plan.host_slots, make_copy_engine(device), pin_memory=device.type == "cuda")
        elif plan.kind == "graphs":  # rank 0 captures at the same time: the collectives inside pair up
            from ..engine.cuda_graphs import DecodeGraphs

            graphs = DecodeGraphs(model, kvc, *plan.graph_sizes)
            with _graph_exchange(model):
                graphs.capture()
        elif plan.kind == "step":
            with _graph_exchange(model, plan.graph):
                picks = run_step(plan, model, kvc, device, graphs, host, picks)
        elif plan.kind == "mtp":
            run_mtp(plan, model, kvc, device, tp)
        elif plan.kind == "spare":
            with _graph_exchange(model):
                graphs.replay_spare(plan.bucket)
        elif plan.kind == "idle":
            from .expert import idle_forward

            idle_forward(model)
        elif plan.kind == "report" and on_report is not None:
            on_report()
        else:
            raise RuntimeError(f"unknown step plan kind {plan.kind!r}")
    if graphs is not None:  # the captured NCCL launches go before the communicator they use
        graphs.release()
    graphs = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_worker_node(config) -> int:
    """A headless node of a multi-node run (``dsv4 serve ... --node-rank K``, K > 0): start this
    node's ranks as workers and wait; returns the first non-zero exit code (0 if all end cleanly)."""
    import multiprocessing.connection

    import torch.multiprocessing as mp

    from .group import DistSpec

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = DistSpec.from_config(config)
    if spec.node_rank == 0:
        raise ValueError("node 0 runs the engine (dsv4 serve without --node-rank); headless nodes have node_rank > 0")
    ctx = mp.get_context("spawn")
    procs = []
    for lr in range(spec.local_world):
        p = ctx.Process(target=worker_main, args=(config, spec, lr, spec.master_port, os.getpid()),
                        name=f"dsv4-tp-rank{spec.global_rank(lr)}", daemon=True)
        p.start()
        procs.append(p)
        log.info("node %d: started tensor-parallel worker rank %d, pid %d", spec.node_rank, spec.global_rank(lr), p.pid)

    def stop(*_):
        for p in procs:
            if p.is_alive():
                p.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    live = list(procs)
    while live:
        multiprocessing.connection.wait([p.sentinel for p in live])
        for p in [p for p in live if not p.is_alive()]:
            live.remove(p)
            if p.exitcode and not code:
                code = p.exitcode if p.exitcode > 0 else 128 - p.exitcode
                log.error("node %d: worker %s exited with code %s; stopping this node", spec.node_rank, p.name,
                          p.exitcode)
                stop()
    return code
