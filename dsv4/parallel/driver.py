"""Rank 0 of a tensor-parallel engine: start the workers, hold shard 0, broadcast each step's plan.

The engine process is rank 0 (like vLLM's multiproc executor, kept small): it runs the scheduler
and the sampler as at TP=1, and its model is a :class:`TPModel` whose ``forward`` first
broadcasts the step plan on the control group, then runs the local shard (the collectives inside
line up with the workers'). Local workers are spawned processes; on a multi-node run the other
nodes' ranks are started there (``dsv4 serve --node-rank K``) and meet at the same rendezvous.

Failure handling: before every step the driver checks its workers' liveness; a collective that
fails (gloo: the peer's socket closed) or times out (``distributed_timeout``) makes the engine
dead: workers are stopped and :class:`~dsv4.engine.errors.EngineDeadError` names the rank and its
exit code. A dead engine never runs another step (the ranks' collectives cannot be re-matched).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from ..model.step import PagedStep
from .group import DistSpec, TPGroup, init_distributed
from .plan import StepPlan, plan_mtp, plan_step
from .ranks import RankProcesses, free_port
from .worker import load_shard, rank_device, worker_main

log = logging.getLogger("dsv4.parallel")


class TPDriver:
    """The engine's executor at TP > 1 (``dsv4.engine.executor.Executor``)."""

    one_process = False
    takes_host_inputs = True  # TPModel.forward builds the plan from the runner's HostInputs

    def __init__(self, config, device: torch.device):
        from ..config import load_config

        self.spec = spec = DistSpec.from_config(config)
        if spec.node_rank != 0:
            raise ValueError(f"node_rank={spec.node_rank}: only node 0 runs the engine; start other nodes with "
                             "`dsv4 serve ... --node-rank K` (headless workers)")
        self.config = config
        self.device = rank_device(config, 0) if device.type == "cuda" else device
        TPGroup(spec, 0, self.device).shard_plan(load_config(config.model))  # a layout error before any spawn
        self.port = spec.master_port or free_port(spec.master_addr)
        self.ranks = RankProcesses("tensor-parallel", "worker rank", spec.timeout_s)
        self.restores: list = []  # cache writes outside a forward, for the plan (plan.StepPlan.restores)
        try:
            for lr in range(1, spec.local_world):
                self.ranks.spawn(spec.global_rank(lr), worker_main, (config, spec, lr, self.port, os.getpid()))
            self._start(config)
        except BaseException:
            self.ranks.abandon()
            raise

    @classmethod
    def for_group(cls, config, tp: TPGroup, inner, ranks: RankProcesses) -> "TPDriver":
        """Rank 0 of a tensor-parallel group inside a data-parallel rank (``dsv4.parallel.dp_rank``):
        its processes were started, and are watched and stopped, by the data-parallel front end
        (``ranks``); this driver only sends its group's step plans."""
        self = cls.__new__(cls)
        self.spec, self.config, self.device, self.tp, self.ranks = tp.spec, config, inner.device, tp, ranks
        self.restores, self.owns_processes = [], False
        self.model = TPModel(self, inner)
        return self

    owns_processes = True  # (False: a group inside a data-parallel rank, see for_group)

    @property
    def worker_pids(self) -> dict[int, int]:
        return self.ranks.pids

    @property
    def dead(self) -> str | None:
        return self.ranks.dead

    def _start(self, config) -> None:
        import torch.distributed as dist

        spec = self.spec
        t0 = time.monotonic()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        groups = self.ranks.rendezvous(lambda: init_distributed(spec, 0, self.device, self.port))
        self.tp = TPGroup(spec, 0, self.device, groups)
        mode = "expert" if spec.ep else "tensor"
        log.info("dsv4 parallel: %d ranks (%d node(s)), routed experts split by %s, %s backend, rendezvous at %s:%d",
                 spec.world_size, spec.nnodes, mode, dist.get_backend(), spec.master_addr, self.port)
        # every rank loads with this process's resolved config (flags given on other nodes do not matter)
        self._collective(lambda: dist.broadcast_object_list([config], src=0, group=self.tp.startup), "startup")
        inner, mine = load_shard(config, self.tp, self.device)
        mine["load_s"] = round(time.monotonic() - t0, 2)  # rank 0's includes waiting for the rendezvous
        stats = [None] * spec.world_size
        self._collective(lambda: dist.gather_object(mine, stats, dst=0, group=self.tp.startup), "startup report")
        self.rank_stats = stats
        for s in stats:
            dev = "" if s["device_peak_mib"] is None else f", peak device memory {s['device_peak_mib']:.0f} MiB"
            log.info("dsv4 parallel: rank %d (node %d, pid %d, %s) loaded its shard in %.1f s: peak host RSS "
                     "%.0f MiB%s", s["rank"], s["node"], s["pid"], s["device"], s["load_s"], s["host_peak_mib"], dev)
        self.model = TPModel(self, inner)
        if self.device.type == "cuda":
            self.ranks.watch_cuda(self.device)

    # ---- what the engine calls (its executor interface) ----------------------------------------
    def start_caches(self, budget, numerics, kv) -> None:
        """Every worker allocates the same paged cache (the engine's budget and numerics) and host
        tier (as many slots); prefix-cache restores and host-tier transfers get recorded, in the order
        rank 0 makes them."""
        host = kv.host
        self.send(StepPlan("cache", budget=budget, numerics=numerics,
                           host_slots=0 if host is None else host.num_slots))
        kv.add_listener(self.restores.append)  # each rank replays them on its own cache and host slots

    def capture_graphs(self, kvc, max_num_seqs: int, max_model_len: int) -> "TPDecodeGraphs":
        """Every rank captures the decode CUDA graphs of its shard at once (the all-reduces inside
        are matched bucket by bucket, in the same order); returns rank 0's replayer."""
        from ..engine.cuda_graphs import DecodeGraphs

        self.ensure_alive()
        graphs = DecodeGraphs(self.model.inner, kvc, max_num_seqs, max_model_len)
        self.lockstep(StepPlan("graphs", graph_sizes=(max_num_seqs, max_model_len)), graphs.capture,
                      "decode graph capture")
        return TPDecodeGraphs(self, graphs)

    def lockstep(self, plan: StepPlan, run, what: str):
        """Send ``plan``, then ``run()`` rank 0's share of the same step while the workers run theirs;
        returns its result. The prefix-cache restores the plan carries are then done with. A failure
        makes the engine dead: the workers are mid-step and nothing can be re-matched.

        On CUDA a step waits for its device work here, where a dead peer is watched for
        (``RankProcesses.watch_cuda``), except a deferred step of async scheduling (``keep_picks``):
        its work stays queued, and the watchdog keeps watching it through an event."""
        self.send(plan)
        del self.restores[:len(plan.restores)]
        ranks = self.ranks
        ranks.in_step = True
        try:
            out = run()
            if self.device.type == "cuda":
                if plan.keep_picks:
                    ranks.queued(torch.cuda.Event())
                else:
                    torch.cuda.synchronize(self.device)
            return out
        except Exception as e:  # noqa: BLE001
            raise self.fatal(e, what) from e
        finally:
            ranks.in_step = False

    def send(self, plan: StepPlan) -> None:
        import torch.distributed as dist

        self._collective(lambda: dist.broadcast_object_list([plan], src=self.tp.leader, group=self.tp.ctrl),
                         "step plan")

    def shutdown(self) -> None:
        """Stop the workers (a 'shutdown' plan, then terminate stragglers) and leave the group."""
        from ..engine.errors import EngineDeadError

        if self.ranks.closed:
            return
        clean = self.dead is None
        if clean:
            try:
                self.send(StepPlan("shutdown"))
            except EngineDeadError:
                clean = False
        if self.owns_processes:
            self.ranks.stop(clean)

    def idle_forward(self) -> None:
        """A data-parallel rank's dummy forward, on every rank of its group (their MoE exchanges
        span every process)."""
        from .expert import idle_forward

        self.ensure_alive()
        self.lockstep(StepPlan("idle"), lambda: idle_forward(self.model.inner), "dummy forward")

    # ---- liveness (dsv4/parallel/ranks.py) ------------------------------------------------------
    def ensure_alive(self) -> None:
        self.ranks.ensure_alive()

    def _collective(self, fn, what: str):
        return self.ranks.collective(fn, what)

    def fatal(self, e: BaseException, what: str):
        return self.ranks.fatal(e, what)


class TPModel:
    """The engine's model at TP > 1: broadcasts the plan, then runs shard 0 (collectives inside)."""

    def __init__(self, driver: TPDriver, inner):
        self.driver, self.inner = driver, inner
        self.cfg, self.device, self.dtype, self.ops = inner.cfg, inner.device, inner.dtype, inner.ops

    def __getattr__(self, name):  # read-only attributes (w, numerics, blocks, …) of the shard-0 model
        if name in ("prefill", "greedy", "hidden", "new_cache", "dspark_context", "dspark_block"):
            raise AttributeError(
                f"{name}() is not available at tensor_parallel_size > 1: only the engine's steps "
                "run the sharded model (use a separate single-process model as an oracle)"
            )
        return getattr(self.inner, name)

    def forward(self, token_ids, step, logits_rows=None, host=None, advance: bool = True, **kw):
        """``advance=False`` (a speculative verify step) leaves rank 0's views for the engine to commit
        with the accepted count; a worker's views are rebuilt from the next plan, so it commits every
        row (the state rings are sized for rejected drafts' rows: ``model.step.ring_rows``)."""
        if kw:
            raise TypeError(f"the tensor-parallel forward does not take {sorted(kw)}")
        d = self.driver
        d.ensure_alive()
        plan = plan_step(token_ids, step.chunks, logits_rows, d.restores, isinstance(step, PagedStep), host=host)
        return d.lockstep(plan, lambda: self.inner.forward(token_ids, step, logits_rows=logits_rows, advance=advance),
                          "forward")

    def mtp_forward(self, next_ids, streams, step, m: int = 0, logits_rows=None):
        """A speculative MTP pass on every rank: the plan, then rank 0's input streams broadcast."""
        d = self.driver
        d.ensure_alive()
        plan = plan_mtp(next_ids, streams, step, m, logits_rows)

        def run():
            s = d.tp.broadcast(streams.contiguous())
            return self.inner.mtp_forward(next_ids, s, step, m, logits_rows=logits_rows)

        return d.lockstep(plan, run, "MTP pass")


class TPDecodeGraphs:
    """Rank 0's decode graphs at TP > 1 (the runner's ``graphs``): a replay first broadcasts the
    step plan flagged ``graph``, so every worker loads the same static inputs and replays its own
    graph. While the all-reduces are being timed (``tp.timed``) steps run eagerly instead: a
    collective inside a graph cannot be timed."""

    def __init__(self, driver: TPDriver, graphs):
        self.driver, self.graphs = driver, graphs
        self.buckets, self.capture_seconds = graphs.buckets, graphs.capture_seconds

    def bucket(self, n: int) -> int | None:
        return self.graphs.bucket(n)

    def release(self) -> None:
        self.graphs.release()
        self.buckets = []

    def can_run(self, batch) -> bool:
        return not self.driver.tp.timed and self.graphs.can_run(batch)

    def staging_target(self, n: int, max_end: int):
        return self.graphs.staging_target(n, max_end)

    def run(self, batch, bucket: int | None = None) -> torch.Tensor:
        """``bucket``: the one the data-parallel ranks agreed on (TP inside DP), else the batch's."""
        d = self.driver
        d.ensure_alive()
        plan = plan_step(batch.token_ids, batch.step.chunks, batch.logits_rows, d.restores, True, graph=True,
                         host=getattr(batch, "host", None), bucket=bucket)
        return d.lockstep(plan, lambda: self.graphs.run(batch, bucket=bucket), "decode graph replay")

    def replay_spare(self, b: int) -> None:
        """Bucket ``b`` with every lane spare, on every rank of the group (TP inside DP: a rank
        without requests while the others replay ``b``)."""
        d = self.driver
        d.ensure_alive()
        d.lockstep(StepPlan("spare", bucket=b), lambda: self.graphs.replay_spare(b), "spare decode graph replay")
