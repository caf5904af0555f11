"""The tensor-parallel group as the model sees it: rank, world size and the few collectives it calls.

Collectives go through ``torch.distributed``: NCCL on CUDA (RCCL on ROCm, where torch's "nccl"
backend is RCCL), gloo on CPU. Step plans travel on a separate gloo *control* group so that a
small pickled message never queues behind (or gets mixed into) the compute collectives, and so
that its timeout can differ: the driver waits at most ``timeout_s`` for anything, a worker waits
for the next plan as long as the engine stays idle.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("dsv4.parallel")

IDLE_TIMEOUT = timedelta(days=30)  # a worker waiting for the next step plan: the engine may sit idle
STARTUP_TIMEOUT = timedelta(minutes=10)  # every rank must reach the rendezvous within this


@dataclass(frozen=True)
class DistSpec:
    """The parallel layout of an engine, from its EngineConfig (validated here, before any process starts)."""

    world_size: int
    ep: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    timeout_s: float = 300.0

    @classmethod
    def from_config(cls, c) -> "DistSpec":
        n, nn = int(c.tensor_parallel_size), int(getattr(c, "nnodes", 1))
        if n < 1:
            raise ValueError(f"tensor_parallel_size must be ≥ 1, got {n}")
        if nn < 1 or n % nn:
            raise ValueError(f"nnodes={nn} must divide tensor_parallel_size={n} (the same number of ranks per node)")
        nr = int(getattr(c, "node_rank", 0))
        if not 0 <= nr < nn:
            raise ValueError(f"node_rank={nr} must be in [0, nnodes={nn})")
        port = getattr(c, "master_port", None)
        if nn > 1 and port is None:
            raise ValueError("a multi-node run needs --master-port (the same on every node)")
        timeout = float(getattr(c, "distributed_timeout", 300.0))
        if timeout <= 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {timeout}")
        return cls(n, bool(getattr(c, "enable_expert_parallel", False)), nn, nr,
                   str(getattr(c, "master_addr", None) or "127.0.0.1"), port, timeout)

    @property
    def local_world(self) -> int:
        return self.world_size // self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.local_world + local_rank


def init_distributed(spec: DistSpec, rank: int, device: torch.device, port: int):
    """Join the default (compute) group; returns (control group, startup group), both gloo.

    The startup group carries the config and the load reports: loading a shard may take far
    longer than a step's collective is allowed to (``STARTUP_TIMEOUT``, at least)."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; "
                           "a tensor-parallel engine starts its own")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=spec.timeout_s)
    # the rendezvous waits for slow starters (imports, other nodes) longer than a collective may take
    store = dist.TCPStore(spec.master_addr, port, spec.world_size, is_master=rank == 0,
                          timeout=max(timeout, STARTUP_TIMEOUT))
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.world_size, timeout=timeout)
    # a group's timeout is local to each process: rank 0 never waits long, workers may idle
    ctrl = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else IDLE_TIMEOUT)
    startup = dist.new_group(backend="gloo", timeout=max(timeout, STARTUP_TIMEOUT))
    return ctrl, startup


class CommTimer:
    """``timed`` makes every collective synchronise and add its wall time to ``comm_s`` (the
    benchmark's collective share); off by default because the synchronisation costs overlap."""

    device: torch.device

    def __init__(self):
        self.timed = False
        self.comm_s, self.comm_calls = 0.0, 0

    def _tick(self) -> float | None:
        if not self.timed:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _tock(self, t0: float | None) -> None:
        if t0 is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.comm_s += time.perf_counter() - t0
        self.comm_calls += 1


class TPGroup(CommTimer):
    """One rank of a tensor(-and-expert)-parallel model: what the sharded layers call (collectives
    timed as ``CommTimer`` says).

    ``rank`` and ``spec.world_size`` are within the tensor-parallel group. Inside a data-parallel
    rank (``dsv4.parallel.dp_rank``) that group is a sub-group of the processes: ``group`` its compute
    group, ``groups[0]`` its control group and ``leader`` the global rank of its rank 0 (the one
    that sends the step plans); None / 0 when the group is all the processes."""

    def __init__(self, spec: DistSpec, rank: int, device: torch.device, groups=(None, None), group=None,
                 leader: int = 0):
        super().__init__()
        self.spec, self.rank, self.world_size, self.ep = spec, rank, spec.world_size, spec.ep
        self.device = torch.device(device)
        self.ctrl, self.startup = groups  # gloo groups of init_distributed (None: no process group yet)
        self.group, self.leader = group, leader
        self._plan = None

    # ---- ranges --------------------------------------------------------------------------
    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's equal share [lo, hi) of ``n`` items; ``what`` names them in the error."""
        if n % self.world_size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={self.world_size}")
        k = n // self.world_size
        return self.rank * k, (self.rank + 1) * k

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """Vocab-parallel rows: equal shares of ceil(V/N) (the last one may be short)."""
        per = -(-vocab // self.world_size)
        return min(vocab, self.rank * per), min(vocab, (self.rank + 1) * per)

    def shard_plan(self, cfg):
        from .shard import ShardPlan

        if self._plan is None:
            self._plan = ShardPlan(cfg, self)
        return self._plan

    def check(self, cfg) -> None:
        """A model of ``cfg`` can be split this way (the ReferenceModel built with this group asks)."""
        self.shard_plan(cfg)

    # ---- what ModelWeights calls (the ``shard`` hook) ------------------------------------
    def read(self, ckpt, name: str) -> torch.Tensor:
        return self.shard_plan(ckpt.config).read(ckpt, name)

    def expert_range(self, n_experts: int) -> tuple[int, int]:
        return self.split(n_experts, "n_routed_experts") if self.ep else (0, n_experts)

    # ---- what the model calls ------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns it."""
        t0 = self._tick()
        dist.all_reduce(t, group=self.group)
        self._tock(t0)
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` of the group's rank 0 on every rank, in place; returns it."""
        t0 = self._tick()
        dist.broadcast(t, src=self.leader or 0, group=self.group)
        self._tock(t0)
        return t

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: rows this rank holds, zeros elsewhere, summed over ranks (exact)."""
        lo, hi = self.vocab_range(self._plan.cfg.vocab_size)
        mine = (ids >= lo) & (ids < hi)
        x = torch.where(mine[:, None], table[(ids - lo).clamp(0, table.shape[0] - 1)], 0)
        return self.all_reduce(x.contiguous())

    def gather_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """Local logits [T, V/N] of every rank → full [T, V] on every rank (all-gather)."""
        per = -(-vocab // self.world_size)
        if logits.shape[1] < per:  # the last rank's short share, padded so every piece has one shape
            logits = torch.cat([logits, logits.new_zeros(logits.shape[0], per - logits.shape[1])], dim=1)
        parts = [torch.empty_like(logits) for _ in range(self.world_size)]
        t0 = self._tick()
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        self._tock(t0)
        return torch.cat(parts, dim=1)[:, :vocab]

    def owned_experts(self, experts: list[int]) -> list[int]:
        """EP: the routed experts (of those listed) this rank computes; TP: all of them."""
        if not self.ep:
            return experts
        lo, hi = self.expert_range(self._plan.cfg.n_routed_experts)
        return [e for e in experts if lo <= e < hi]

    def local_expert_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """EP on the grouped-GEMM op path: global expert ids → this rank's stacked index, -1 = not here."""
        if not self.ep:
            return ids
        lo, hi = self.expert_range(self._plan.cfg.n_routed_experts)
        return torch.where((ids >= lo) & (ids < hi), ids - lo, torch.full_like(ids, -1))


def peak_memory(device: torch.device) -> dict:
    """Peak host RSS and device memory of this process so far, in MiB."""
    rss = None
    try:  # VmHWM: this process's own peak (ru_maxrss carries the parent's peak across fork + exec)
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    out = {"host_peak_mib": round(rss, 1), "device_peak_mib": None}
    if device.type == "cuda":
        out["device_peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out
