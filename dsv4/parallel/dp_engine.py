"""The front end of a data-parallel engine: one engine object over N data-parallel ranks.

:class:`DPEngine` is what ``LLM`` and ``dsv4 serve`` drive when ``data_parallel_size`` N > 1. It
presents ``LLMEngine``'s interface (``add_request``, ``abort_request``, ``step``,
``has_unfinished_requests``, ``run_to_completion``, ``requests``, ``tokenizer``, ``model_config``,
``max_model_len``, ``config``, ``shutdown`` and ``stats``: its ranks' ``EngineStats`` summed), and behind it:

- rank 0's engine core lives in this process; ranks 1 … N−1 are spawned processes
  (``dsv4.parallel.dp_rank``), every rank on its own device (``cuda:<rank>``, or the CPU);
- a new request goes to the least-loaded rank (prefix-cache affinity breaks ties,
  ``dsv4.parallel.balance``) and stays there: that rank's scheduler, KV cache and sampler own it;
- ``step()`` steps every rank once, in lockstep — a rank with nothing to compute runs a dummy
  forward, so the MoE layers' all-to-alls always pair up — and returns all ranks' outputs;
- a rank that exits, a collective that fails or times out makes the engine dead
  (``EngineDeadError`` naming the rank, as for tensor parallelism: ``dsv4.parallel.ranks``).

Commands to the other ranks are pickled broadcasts on a gloo control group, their replies a
gather; the model's collectives run on the compute group (NCCL on CUDA, gloo on CPU).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import weakref

import torch

from ..engine.stats import EngineStats
from .balance import RankBalancer
from .dp_rank import Command, Layout, build_rank_engine, handle, make_groups, rank_state, worker_main
from .group import DistSpec, TPGroup, init_distributed
from .ranks import RankProcesses, free_port

log = logging.getLogger("dsv4.parallel")


class DPEngine:
    proposer = None  # (LLMEngine's speculative proposer: the settings refuse speculation with data parallelism)

    def __init__(self, config, tokenizer=None):
        from ..config import load_config
        from .expert import EPGroup

        n = config.data_parallel_size
        self.layout = layout = Layout(n, config.tensor_parallel_size)
        self.config = config
        dev = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        w = layout.world
        if dev.type == "cuda" and torch.cuda.device_count() < w:
            raise ValueError(f"data_parallel_size={n} × tensor_parallel_size={layout.tp} needs {w} GPUs, "
                             f"{torch.cuda.device_count()} visible")
        self.device = torch.device("cuda", 0) if dev.type == "cuda" else dev
        cfg = load_config(config.model)  # a layout error before any spawn
        EPGroup(0, w, cfg.n_routed_experts, self.device)
        if layout.tp > 1:
            TPGroup(DistSpec(layout.tp, True), 0, self.device).shard_plan(cfg)
        self.spec = spec = DistSpec(w, True, 1, 0, config.master_addr or "127.0.0.1", config.master_port,
                                    float(config.distributed_timeout))
        self.port = spec.master_port or free_port(spec.master_addr)
        # (with tensor parallelism inside the ranks, messages name processes by global rank)
        self.ranks = RankProcesses("data-parallel", "rank" if layout.tp == 1 else "process", spec.timeout_s)
        self.balancer = RankBalancer(n)
        self.requests: dict[str, int] = {}  # request id → the rank that holds it
        self._aborts: dict[int, list[str]] = {}  # rank → aborted requests not yet told to it
        self._held: set[str] = set()  # requests added after the engine died (the next step raises)
        self._ids = itertools.count()
        try:
            for g in range(1, w):
                self.ranks.spawn(g, worker_main, (config, spec, layout, g, self.port, os.getpid()))
            self._start(config, tokenizer)
        except BaseException:
            self.ranks.abandon()
            raise

    def _start(self, config, tokenizer) -> None:
        import torch.distributed as dist

        t0 = time.monotonic()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.ctrl, self.startup = self.ranks.rendezvous(lambda: init_distributed(self.spec, 0, self.device, self.port))
        layout = self.layout
        groups = make_groups(layout, 0, self.spec.timeout_s)
        self.commands = groups.commands or self.ctrl
        n, w = layout.dp, layout.world
        log.info("dsv4 parallel: %d data-parallel ranks%s, routed experts split by expert over %d processes, %s "
                 "backend, rendezvous at %s:%d", n, f" of {layout.tp} tensor-parallel ranks" if layout.tp > 1 else "",
                 w, dist.get_backend(), self.spec.master_addr, self.port)
        self.ranks.rendezvous(lambda: dist.broadcast_object_list([config], src=0, group=self.startup))
        if self.device.type == "cuda":
            self.ranks.watch_cuda(self.device)
        self.ranks.in_step = True  # a warm-up (on a GPU) runs forwards, whose exchanges need every rank
        try:
            self.engine0, mine = build_rank_engine(config, layout, 0, self.device, groups, tokenizer, self.ranks)
        finally:
            self.ranks.in_step = False
        # rank 0's decode graphs are reset before the group goes (a live graph hangs its teardown),
        # also when this engine is dropped without shutdown(): this runs before the ranks' finalizer
        self._release = weakref.finalize(self, self.engine0.shutdown)
        mine["load_s"] = round(time.monotonic() - t0, 2)  # rank 0's includes waiting for the rendezvous
        reports = [None] * w  # every process's: the leaders' carry their rank's engine
        self.ranks.rendezvous(lambda: dist.gather_object(mine, reports, dst=0, group=self.startup))
        self.startup_reports = reports
        self.rank_stats = [{**s, "requests": 0} for s in reports[::layout.tp]]  # then updated by every reply
        for s in reports:
            dev = "" if s["device_peak_mib"] is None else f", peak device memory {s['device_peak_mib']:.0f} MiB"
            who = (f"data-parallel rank {s['rank']}" if layout.tp == 1 else
                   f"data-parallel rank {s['rank']} tensor-parallel rank {s['process'] % layout.tp}")
            kv = (f", KV cache {s['kv_capacity_tokens']} tokens ({s['kv_cache_mib']:.0f} MiB)"
                  if "kv_cache_mib" in s else " (its KV cache mirrors its leader's)")
            log.info("dsv4 parallel: %s (pid %d, %s, experts [%d, %d)) started in %.1f s: weights %.0f MiB%s, peak "
                     "host RSS %.0f MiB%s", who, s["pid"], s["device"], *s["experts"], s["load_s"], s["weights_mib"],
                     kv, s["host_peak_mib"], dev)
        e = self.engine0
        self.config, self.model_config, self.max_model_len, self.tokenizer = (e.config, e.model_config,
                                                                            e.max_model_len, e.tokenizer)

    # ---- what the server and tools read -------------------------------------------------------
    @property
    def worker_pids(self) -> dict[int, int]:
        return self.ranks.pids

    @property
    def dead(self) -> str | None:
        return self.ranks.dead

    @property
    def model(self):
        raise AttributeError("a data-parallel engine has one model per rank, each in its own process; only the "
                             "engine's steps run them (rank 0's engine core: DPEngine.engine0)")

    @property
    def stats(self) -> EngineStats:
        """The ranks' snapshots as of their last replies, summed (each rank's in ``ranks``)."""
        return EngineStats.total([EngineStats.from_dict(s) for s in self.rank_stats])

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt=None, params=None, request_id: str | None = None,
                    prompt_token_ids: list[int] | None = None) -> str:
        """As ``LLMEngine.add_request``; the request goes to the least-loaded rank. A bad request
        raises here, as the rank's engine raised it. A dead engine takes the request and the next
        ``step()`` raises ``EngineDeadError``, as with one process (the server fails every request
        in flight then, and stops)."""
        from ..engine.errors import EngineDeadError

        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif prompt is not None:
                prompt_token_ids, prompt = list(prompt), None
            else:
                raise ValueError("a request needs a prompt or prompt_token_ids")
        ids = list(map(int, prompt_token_ids))
        if request_id is None:
            request_id = next(str(i) for i in self._ids if str(i) not in self.requests)
        elif request_id in self.requests or request_id in self._held:
            raise ValueError(f"request id {request_id!r} is already in use")
        rank = self.balancer.pick(ids)
        args = (prompt, params, request_id, ids)
        try:
            self.ranks.ensure_alive()
            if rank == 0:
                self.engine0.add_request(*args)
                self.rank_stats[0].update(rank_state(self.engine0))
            else:
                reply = self._command(Command("add", rank=rank, add=args, aborts=self._take_aborts()))[rank]
                if "error" in reply:
                    raise reply["error"]
        except EngineDeadError:
            self._held.add(request_id)
            return request_id
        self.requests[request_id] = rank
        self.balancer.added(rank, ids)
        self.rank_stats[rank]["requests"] += 1
        return request_id

    def abort_request(self, request_id: str) -> None:
        self._held.discard(request_id)
        rank = self.requests.pop(request_id, None)
        if rank is None:
            return
        self.balancer.removed(rank)
        self.rank_stats[rank]["requests"] -= 1
        if rank == 0:
            self.engine0.abort_request(request_id)
        else:  # told with the next command (before that rank steps again)
            self._aborts.setdefault(rank, []).append(request_id)

    def _take_aborts(self) -> dict[int, list[str]]:
        out, self._aborts = self._aborts, {}
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborts) or bool(self._held)

    # ---- steps ---------------------------------------------------------------------------------
    def step(self) -> list:
        """Every rank steps once (in lockstep); the outputs of all of them, rank by rank."""
        if self._held:
            self.ranks.ensure_alive()  # raises: the engine died before those requests reached a rank
        if not self.requests:
            if self._aborts:  # nothing to run: just free the aborted requests' pages
                self._command(Command("abort", aborts=self._take_aborts()))
            return []
        replies = self._command(Command("step", aborts=self._take_aborts()))
        outs = []
        for r, reply in enumerate(replies):
            for o in reply["outputs"]:
                if self.requests.get(o.request_id) != r:  # aborted since (told before the step: not expected)
                    continue
                if o.finished:
                    del self.requests[o.request_id]
                    self.balancer.removed(r)
                    self.rank_stats[r]["requests"] -= 1
                outs.append(o)
        return outs

    def _command(self, cmd: Command) -> list[dict]:
        """Broadcast ``cmd``, do rank 0's share, gather every rank's reply (rank order)."""
        import torch.distributed as dist

        ranks = self.ranks
        ranks.ensure_alive()
        what = "step" if cmd.kind == "step" else f"'{cmd.kind}' command"
        ranks.collective(lambda: dist.broadcast_object_list([cmd], src=0, group=self.commands), what)
        ranks.in_step = True
        try:
            mine = handle(self.engine0, 0, cmd)
            if self.device.type == "cuda":  # wait here, where a dead peer is watched for
                torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - the other ranks are mid-command: nothing can be re-matched
            raise ranks.fatal(e, what) from e
        finally:
            ranks.in_step = False
        replies = [None] * self.layout.dp
        ranks.collective(lambda: dist.gather_object(mine, replies, dst=0, group=self.commands), f"{what} replies")
        for r, reply in enumerate(replies):
            self.rank_stats[r].update(reply["state"])
        return replies

    def capture_decode_graphs(self) -> None:
        """Every rank captures its decode graphs at once (on a GPU each rank's engine does it at
        start; on the CPU the graphs are emulated, and this is how the tests reach them)."""
        if self.requests:
            raise RuntimeError("capture_decode_graphs() needs an idle engine")
        self._command(Command("graphs", aborts=self._take_aborts()))

    def run_to_completion(self, request_ids: list[str]) -> dict:
        done: dict = {}
        pending = set(request_ids)
        while pending and self.has_unfinished_requests():
            for out in self.step():
                if out.finished and out.request_id in pending:
                    done[out.request_id] = out
                    pending.discard(out.request_id)
        return done

    # ---- shutdown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the other ranks (a 'shutdown' command, then terminate stragglers) and leave the group."""
        import torch.distributed as dist

        from ..engine.errors import EngineDeadError

        if self.ranks.closed:
            return
        clean = self.dead is None
        if clean:
            try:
                self.ranks.collective(
                    lambda: dist.broadcast_object_list([Command("shutdown")], src=0, group=self.commands),
                    "shutdown")
            except EngineDeadError:
                clean = False
        self._release()
        self.engine0 = None
        self.ranks.stop(clean)
