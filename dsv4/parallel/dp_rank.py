"""One data-parallel rank: an engine core of its own, stepped in lockstep with the other ranks.

Each rank runs a whole :class:`~dsv4.engine.engine.LLMEngine` — its own scheduler, KV cache,
requests, sampler and tokenizer — over its model (every weight but the other ranks' routed
experts, ``dsv4.parallel.expert``). Rank 0's lives in the front end's process
(``dsv4.parallel.dp_engine``); ranks 1 … N−1 are spawned processes running :func:`worker_main`:
receive a :class:`Command` from rank 0 (pickled, on the gloo control group), do it, send the reply
back (a gather to rank 0), repeat.

Lockstep: every MoE layer of every forward is an exchange all ranks join, so on every ``step``
command each rank runs exactly one forward — its engine's step, or, when its engine had nothing
to compute, a dummy forward with no tokens (:func:`~dsv4.parallel.expert.idle_forward`). With
decode CUDA graphs the ranks first agree whether the step replays one bucket's graph everywhere
(a rank without requests then replays it with spare lanes) or runs eagerly everywhere
(``dsv4.parallel.dp_graphs``).
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("dsv4.parallel")


@dataclass
class Command:
    """What rank 0 broadcasts: ``kind`` "add" (``rank`` takes the request ``add``: the arguments of
    ``LLMEngine.add_request``), "step" (every rank steps once), "abort" (only the aborts) or
    "shutdown". ``aborts`` (rank → request ids) are applied first, whatever the kind."""

    kind: str  # (also "graphs": every rank captures its decode graphs, the tests' way in on CPU)
    rank: int | None = None
    add: tuple | None = None
    aborts: dict[int, list[str]] = field(default_factory=dict)


class EPModel:
    """A data-parallel rank's model as its engine sees it: every forward keeps the exchanges
    matched — one that raises between exchanges joins the remaining ones empty (then its requests
    fail alone); one that breaks an exchange makes the engine dead."""

    def __init__(self, inner, ep):
        self.inner, self.ep = inner, ep
        self.cfg, self.device, self.dtype, self.ops = inner.cfg, inner.device, inner.dtype, inner.ops

    def __getattr__(self, name):  # read-only attributes (w, numerics, blocks, …) of the rank's model
        if name in ("prefill", "greedy", "hidden", "mtp_forward", "new_cache"):
            raise AttributeError(f"{name}() is not available with data_parallel_size > 1: only the engine's steps "
                                 "run the expert-parallel model (its MoE layers need every rank)")
        return getattr(self.inner, name)

    def forward(self, token_ids, chunks, logits_rows=None, tables=None, **kw):
        from ..engine.errors import EngineDeadError

        if kw:
            raise TypeError(f"the data-parallel forward does not take {sorted(kw)}")
        self.ep.begin_forward()
        try:
            return self.inner.forward(token_ids, chunks, logits_rows=logits_rows, tables=tables)
        except EngineDeadError:
            raise
        except Exception:
            self.ep.finish_forward(self.inner)
            raise


class EPExecutor:
    """What a data-parallel rank's LLMEngine runs through (its ``executor``): the rank's model, and
    its decode graphs. The cache is the rank's own (nothing to mirror); the front end starts and
    stops the processes. ``agree``: the gloo group the ranks agree on each step's graph in."""

    def __init__(self, model, ep, agree):
        self.model, self.ep, self.agree = EPModel(model, ep), ep, agree
        self.device = model.device

    def start_caches(self, budget, numerics, kv) -> None:
        pass

    def capture_graphs(self, kvc, max_num_seqs: int, max_model_len: int):
        from .dp_graphs import DPDecodeGraphs

        return DPDecodeGraphs.capture(self.model.inner, kvc, max_num_seqs, max_model_len, self.ep, self.agree)

    def shutdown(self) -> None:
        pass


def agreement_group(timeout_s: float):
    """The gloo group data-parallel ranks agree on each step's decode graph in (every rank makes it
    right after joining the process group, so the groups line up)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def build_rank_engine(config, rank: int, world_size: int, device, agree, tokenizer=None):
    """This rank's engine over its share of the model; returns (engine, its startup report)."""
    import torch

    from ..checkpoint.reader import Checkpoint
    from ..engine.engine import LLMEngine
    from ..model.model import ReferenceModel
    from ..ops.selection import resolve_op_set
    from .expert import EPGroup
    from .group import peak_memory

    t0 = time.monotonic()
    ckpt = Checkpoint(config.model)
    ep = EPGroup(rank, world_size, ckpt.config.n_routed_experts, device)
    model = ReferenceModel(config.model, dtype=config.torch_dtype(device), device=device, act_quant=config.act_quant,
                           ops=resolve_op_set(config.backend, config.attention, device), ep=ep)
    engine = LLMEngine(config, tokenizer=tokenizer, executor=EPExecutor(model, ep, agree))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    budget = engine.kv_cache.budget
    report = {"rank": rank, "pid": os.getpid(), "device": str(device), "load_s": round(time.monotonic() - t0, 2),
              "experts": list(ep.expert_range(ckpt.config.n_routed_experts)),
              "weights_mib": round(ep.checkpoint_bytes(ckpt) / 2**20, 1), "kv_tokens": budget.capacity_tokens,
              "kv_blocks": budget.num_blocks, "kv_cache_mib": round(budget.total_bytes / 2**20, 1),
              **peak_memory(device), **rank_state(engine)}
    return engine, report


def rank_step(engine) -> list:
    """One lockstep step of this rank: its engine's step, or a dummy forward if that ran none."""
    from .expert import idle_forward

    ep = engine.executor.ep
    ep.forwards = 0
    outs = engine.step()
    if ep.forwards == 0:
        graphs = engine.runner.graphs
        if graphs is None or not graphs.idle():
            idle_forward(engine.executor.model.inner)
    return outs


def rank_state(engine) -> dict:
    """What the front end keeps of a rank after each command (its load, /metrics, the tests)."""
    from ..engine.request import Status

    s, kv, g = engine.scheduler, engine.kv, engine.runner.graphs
    queued = [rid for rid, group in engine.requests.items() if all(r.status is Status.WAITING for r in group)]
    return {"waiting": len(s.waiting), "running": len(s.running), "kv_cache_usage": kv.usage(),
            "waiting_ids": queued,  # requests none of whose sequences has been scheduled yet (serve's queue time)
            "prefix_cache_hits": kv.hits, "prefix_cache_queries": kv.queries, "preemptions": s.num_preemptions,
            "graph_replays": getattr(g, "replays", 0), "spare_replays": getattr(g, "spare_replays", 0)}


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (the reply crosses processes), else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


def handle(engine, rank: int, cmd: Command):
    """Do ``cmd`` on this rank's engine; returns the reply for rank 0."""
    for rid in cmd.aborts.get(rank, ()):
        engine.abort_request(rid)
    if cmd.kind == "step":
        outs = rank_step(engine)
        for o in outs:
            if o.exception is not None:
                o.exception = _portable(o.exception)
        return {"outputs": outs, "state": rank_state(engine)}
    if cmd.kind == "graphs":
        engine.capture_decode_graphs()
    if cmd.kind == "add" and cmd.rank == rank:
        try:
            engine.add_request(*cmd.add)
        except Exception as e:  # noqa: BLE001 - the caller's error (a bad request), raised on rank 0
            return {"error": _portable(e), "state": rank_state(engine)}
    return {"state": rank_state(engine)}


def worker_main(config, spec, rank: int, port: int, parent_pid: int) -> None:
    """Entry point of a spawned data-parallel rank."""
    from .worker import watch_parent

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[dp rank {rank}]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole process group: rank 0 decides
    watch_parent(parent_pid)
    try:
        _serve(config, spec, rank, port)
    except BaseException:  # noqa: BLE001 - any failure ends this rank; rank 0 reports it
        log.exception("data-parallel rank %d failed", rank)
        sys.stderr.flush()
        os._exit(1)


def _serve(config, spec, rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from .group import init_distributed
    from .worker import rank_device

    device = rank_device(config, rank)
    ctrl, startup = init_distributed(spec, rank, device, port)
    agree = agreement_group(spec.timeout_s)
    box = [None]
    dist.broadcast_object_list(box, src=0, group=startup)  # rank 0's resolved EngineConfig
    engine, report = build_rank_engine(box[0], rank, spec.world_size, device, agree)
    log.info("data-parallel rank %d started in %.1f s", rank, report["load_s"])
    dist.gather_object(report, None, dst=0, group=startup)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        cmd = box[0]
        if cmd.kind == "shutdown":
            break
        dist.gather_object(handle(engine, rank, cmd), None, dst=0, group=ctrl)
    engine.shutdown()  # its graphs' NCCL launches go before the communicator they use
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.destroy_process_group()
