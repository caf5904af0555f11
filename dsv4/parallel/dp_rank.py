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

With tensor parallelism inside the ranks (``-tp T -dp D``, :class:`Layout`) a rank is a group of
``T`` processes: its leader runs the engine core above and drives the group as a tensor-parallel
rank 0 does (``TPDriver.for_group``: a step plan before every forward, dummy and graph ones
included); the others run ``worker.serve_plans``. The routed experts are split over all ``T × D``
processes.
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

    def __init__(self, inner, ep, driver=None):
        self.inner, self.ep = inner, ep
        self.cfg, self.device, self.dtype, self.ops = inner.cfg, inner.device, inner.dtype, inner.ops
        self._forward = inner.forward if driver is None else driver.model.forward  # (TP: the plan goes first)

    def __getattr__(self, name):  # read-only attributes (w, numerics, blocks, …) of the rank's model
        if name in ("prefill", "greedy", "hidden", "mtp_forward", "new_cache"):
            raise AttributeError(f"{name}() is not available with data_parallel_size > 1: only the engine's steps "
                                 "run the expert-parallel model (its MoE layers need every rank)")
        return getattr(self.inner, name)

    def forward(self, token_ids, step, logits_rows=None, **kw):
        from ..engine.errors import EngineDeadError

        if kw:
            raise TypeError(f"the data-parallel forward does not take {sorted(kw)}")
        self.ep.begin_forward()
        try:
            return self._forward(token_ids, step, logits_rows=logits_rows)
        except EngineDeadError:
            raise
        except Exception:
            self.ep.finish_forward(self.inner)
            raise


class EPExecutor:
    """What a data-parallel rank's LLMEngine runs through (its ``executor``): the rank's model, and
    its decode graphs. The front end starts and stops the processes. ``agree``: the gloo group the
    ranks agree on each step's graph in. ``driver``: with tensor parallelism inside the rank, rank
    0 of its group (``TPDriver.for_group``): every forward (the dummy one too) is first sent to the
    group's other ranks as a step plan, and their caches mirror this one's; else the cache is the
    rank's own and nothing is mirrored. (``dsv4.engine.executor.Executor``; its forward takes no host
    inputs: a plan sent from here reads the step's tensors.)"""

    one_process = False
    takes_host_inputs = False

    def __init__(self, model, ep, agree, driver=None):
        self.model, self.ep, self.agree, self.driver = EPModel(model, ep, driver), ep, agree, driver
        self.device = model.device

    def start_caches(self, budget, numerics, kv) -> None:
        if self.driver is not None:
            self.driver.start_caches(budget, numerics, kv)

    def capture_graphs(self, kvc, max_num_seqs: int, max_model_len: int):
        from .dp_graphs import DPDecodeGraphs

        if self.driver is not None:  # every rank of the group captures at once, with the dense exchange
            with self.ep.dense_mode():
                return DPDecodeGraphs(self.driver.capture_graphs(kvc, max_num_seqs, max_model_len), self.ep,
                                      self.agree)
        return DPDecodeGraphs.capture(self.model.inner, kvc, max_num_seqs, max_model_len, self.ep, self.agree)

    def idle_forward(self) -> None:
        """This rank's dummy forward (on every rank of its tensor-parallel group)."""
        from .expert import idle_forward

        if self.driver is not None:
            self.driver.idle_forward()
        else:
            idle_forward(self.model.inner)

    def shutdown(self) -> None:
        if self.driver is not None:  # the group's other ranks leave their plan loop
            self.driver.shutdown()


@dataclass(frozen=True)
class Layout:
    """``dp`` data-parallel ranks of ``tp`` processes each: process ``g`` is rank ``g % tp`` of
    data-parallel rank ``g // tp``'s tensor-parallel group, whose rank 0 (its *leader*) runs the
    rank's engine core; the routed experts are split over all ``tp × dp`` processes (vLLM's
    ``EP_SIZE = TP_SIZE × DP_SIZE``)."""

    dp: int
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp

    def leader_of(self, g: int) -> int:
        """The global rank of process ``g``'s leader."""
        return g - g % self.tp


@dataclass
class Groups:
    """The process groups beyond ``init_distributed``'s: ``agree`` (graph agreement), ``commands``
    (the front end's commands to the leaders; None: the control group of every process) and this
    process's tensor-parallel ``tp_compute`` / ``tp_ctrl`` (None without tensor parallelism)."""

    agree: object
    commands: object = None
    tp_compute: object = None
    tp_ctrl: object = None


def make_groups(layout: Layout, g: int, timeout_s: float) -> Groups:
    """Every process makes every group, in the same order, right after joining the process group
    (``new_group`` is collective over all of them). A control group's timeout is local: its
    sender waits at most ``timeout_s``, its receivers as long as the engine stays idle."""
    from datetime import timedelta

    import torch.distributed as dist

    from .group import IDLE_TIMEOUT

    timeout = timedelta(seconds=timeout_s)
    if layout.tp == 1:
        return Groups(dist.new_group(backend="gloo", timeout=timeout))
    leaders = list(range(0, layout.world, layout.tp))
    out = Groups(dist.new_group(leaders, backend="gloo", timeout=timeout))  # (the leaders agree on graphs)
    for d in range(layout.dp):
        ranks = list(range(d * layout.tp, (d + 1) * layout.tp))
        compute = dist.new_group(ranks)
        ctrl = dist.new_group(ranks, backend="gloo", timeout=timeout if g == ranks[0] else IDLE_TIMEOUT)
        if g in ranks:
            out.tp_compute, out.tp_ctrl = compute, ctrl
    out.commands = dist.new_group(leaders, backend="gloo", timeout=timeout if g == 0 else IDLE_TIMEOUT)
    return out


def rank_model(config, layout: Layout, g: int, device, groups: Groups, timeout_s: float):
    """Process ``g``'s share of the model: every weight but the other processes' routed experts, and
    with tensor parallelism only its tensor-parallel shard of those; returns (model, its EPGroup)."""
    from ..checkpoint.reader import Checkpoint
    from ..model.model import ReferenceModel
    from ..ops.selection import resolve_op_set
    from .expert import EPGroup
    from .group import DistSpec, TPGroup

    tp = None
    if layout.tp > 1:
        spec = DistSpec(layout.tp, True, timeout_s=timeout_s)
        tp = TPGroup(spec, g % layout.tp, device, (groups.tp_ctrl, None), group=groups.tp_compute,
                     leader=layout.leader_of(g))
    ep = EPGroup(g, layout.world, Checkpoint(config.model).config.n_routed_experts, device, tp=tp)
    model = ReferenceModel(config.model, dtype=config.torch_dtype(device), device=device, act_quant=config.act_quant,
                           ops=resolve_op_set(config.backend, config.attention, device), tp=tp, ep=ep)
    return model, ep


def build_rank_engine(config, layout: Layout, g: int, device, groups: Groups, tokenizer=None, ranks=None):
    """The engine of the data-parallel rank whose leader is process ``g`` (this one), over its share
    of the model; returns (engine, its startup report). ``ranks``: the ``RankProcesses`` that watch
    the group's other processes (rank 0's front end), else none are watched here."""
    import torch

    from ..engine.engine import LLMEngine
    from .driver import TPDriver
    from .plan import StepPlan
    from .ranks import RankProcesses

    t0 = time.monotonic()
    model, ep = rank_model(config, layout, g, device, groups, float(config.distributed_timeout))
    driver = None
    if ep.tp is not None:
        if ranks is None:  # (the front end watches this rank's processes; its messages name this process)
            ranks = RankProcesses("data-parallel", "process", float(config.distributed_timeout)).detach()
        driver = TPDriver.for_group(config, ep.tp, model, ranks)
    engine = LLMEngine(config, tokenizer=tokenizer, executor=EPExecutor(model, ep, groups.agree, driver))
    if driver is not None:  # the group's other ranks join the startup report now (worker.serve_plans)
        driver.send(StepPlan("report"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report = {**process_report(layout, g, device, ep, round(time.monotonic() - t0, 2)),
              "kv_cache_mib": round(engine.kv_cache.budget.total_bytes / 2**20, 1), **rank_state(engine)}
    return engine, report


def process_report(layout: Layout, g: int, device, ep, load_s: float) -> dict:
    """What every process reports at start: where it runs, its experts, the weights it read, its
    load time and peak memory (a leader adds its engine's KV cache)."""
    from .group import peak_memory

    return {"rank": g // layout.tp, "process": g, "pid": os.getpid(), "device": str(device), "load_s": load_s,
            "experts": list(ep.expert_range(ep.n_experts)), "weights_mib": round(ep.read_bytes / 2**20, 1),
            **peak_memory(device)}


def rank_step(engine) -> list:
    """One lockstep step of this rank: its engine's step, or a dummy forward if that ran none."""
    ep = engine.executor.ep
    ep.forwards = 0
    outs = engine.step()
    if ep.forwards == 0:
        graphs = engine.runner.graphs
        if graphs is None or not graphs.idle():
            engine.executor.idle_forward()
    return outs


def rank_state(engine) -> dict:
    """What the front end keeps of a rank after each command (its load, /metrics, the tests): the
    engine's ``EngineStats`` fields (``EngineStats.from_dict`` reads them back) and its graphs' replays."""
    g = engine.runner.graphs
    return {**engine.stats.as_dict(), "graph_replays": getattr(g, "replays", 0),
            "spare_replays": getattr(g, "spare_replays", 0)}


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


def worker_main(config, spec, layout: Layout, g: int, port: int, parent_pid: int) -> None:
    """Entry point of spawned process ``g``: a data-parallel rank's leader (its engine core), or
    another rank of its tensor-parallel group (step plans from the leader)."""
    from .worker import watch_parent

    d, t = divmod(g, layout.tp)
    name = f"dp rank {d}" + (f" tp rank {t}" if layout.tp > 1 else "")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[{name}]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole process group: rank 0 decides
    watch_parent(parent_pid)
    try:
        _serve(config, spec, layout, g, port)
    except BaseException:  # noqa: BLE001 - any failure ends this process; rank 0 reports it
        log.exception("data-parallel process %d (%s) failed", g, name)
        sys.stderr.flush()
        os._exit(1)


def _serve(config, spec, layout: Layout, g: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from .group import init_distributed
    from .worker import rank_device, serve_plans

    t0 = time.monotonic()
    device = rank_device(config, g)
    ctrl, startup = init_distributed(spec, g, device, port)
    groups = make_groups(layout, g, spec.timeout_s)
    box = [None]
    dist.broadcast_object_list(box, src=0, group=startup)  # rank 0's resolved EngineConfig
    config = box[0]
    if layout.leader_of(g) != g:  # a tensor-parallel rank of a data-parallel rank: its leader's plans
        model, ep = rank_model(config, layout, g, device, groups, spec.timeout_s)
        load_s = round(time.monotonic() - t0, 2)

        def report():  # once the leader's engine is built (its cache plan came first)
            dist.gather_object(process_report(layout, g, device, ep, load_s), None, dst=0, group=startup)

        serve_plans(model, ep.tp, device, on_report=report)
        del model, ep
    else:
        rank = g // layout.tp
        engine, report = build_rank_engine(config, layout, g, device, groups)
        log.info("data-parallel rank %d started in %.1f s", rank, report["load_s"])
        dist.gather_object(report, None, dst=0, group=startup)
        commands = groups.commands or ctrl
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=commands)
            cmd = box[0]
            if cmd.kind == "shutdown":
                break
            dist.gather_object(handle(engine, rank, cmd), None, dst=0, group=commands)
        engine.shutdown()  # its graphs' NCCL launches go before the communicator they use; its group's ranks stop
        del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.destroy_process_group()
