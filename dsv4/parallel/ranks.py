"""Rank 0's view of the other ranks' processes: spawn them, meet them, watch them, stop them.

Shared by the tensor-parallel driver and the data-parallel front end, so that both start their
ranks the same way (``spawn`` start method, one process per local rank) and fail the same way: a
rank that exits, a collective that fails (gloo: the peer's socket closed) or one that times out
(``distributed_timeout``) makes the engine *dead* — the other ranks are stopped and
:class:`~dsv4.engine.errors.EngineDeadError` names the rank, its pid and its exit code. A dead
engine never runs another step: the ranks' collectives cannot be matched up again.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import socket
import threading
import time
import weakref

import torch

from ..engine.errors import EngineDeadError

log = logging.getLogger("dsv4.parallel")


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def stop_processes(procs: dict, grace: float = 10.0) -> None:
    deadline = time.monotonic() + grace
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs.values():
        if p.is_alive():
            p.terminate()
            p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)


def destroy_group(timeout: float) -> None:
    """Leave the process group, giving up after ``timeout`` seconds (a hung teardown must not hang
    the caller's shutdown; the process exit releases what is left)."""
    if not torch.distributed.is_initialized():
        return

    def destroy():
        try:
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass

    t = threading.Thread(target=destroy, name="dsv4-destroy-group", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        log.warning("destroying the process group did not return in %.0f s; leaving it to the process exit", timeout)


def _finalize(procs: dict) -> None:  # the owner was dropped without shutdown(): no graceful message
    for p in procs.values():
        if p.is_alive():
            p.terminate()
    stop_processes(procs, grace=0.0)
    destroy_group(timeout=30.0)


class RankProcesses:
    """The local ranks 1 … n−1 of rank 0's node. ``mode`` ("tensor-parallel", "data-parallel") and
    ``member`` ("worker rank", "rank") name them in messages; ``timeout_s`` is the collectives'
    timeout."""

    def __init__(self, mode: str, member: str, timeout_s: float):
        self.mode, self.role, self.timeout_s = mode, f"{mode} {member}", timeout_s
        self.procs: dict[int, object] = {}
        self.dead: str | None = None
        self.closed = False
        self.in_step = False  # rank 0 is inside a step's collectives (the CUDA watchdog acts only then)
        self._queued: list = []  # CUDA events after deferred steps' work (async scheduling), not yet seen done
        self._finalizer = weakref.finalize(self, _finalize, self.procs)

    def detach(self) -> "RankProcesses":
        """For a process that spawned none of the ranks it names (a data-parallel rank's leader:
        the front end watches its group): nothing of its own to clean up when it goes."""
        self._finalizer.detach()
        return self

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def spawn(self, rank: int, target, args: tuple) -> None:
        p = torch.multiprocessing.get_context("spawn").Process(target=target, args=args,
                                                                name=f"dsv4-rank{rank}", daemon=True)
        p.start()
        self.procs[rank] = p
        log.info("dsv4 parallel: started %s %d, pid %d", self.role, rank, p.pid)

    def rendezvous(self, join):
        """Run ``join()`` (rank 0's side of the rendezvous) while watching the ranks: one that dies
        while starting must not leave rank 0 waiting for it."""
        box: dict = {}

        def run():
            try:
                box["out"] = join()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        t = threading.Thread(target=run, name="dsv4-rendezvous", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            self.check("while starting")
        if "error" in box:
            raise box["error"]
        return box["out"]

    def queued(self, event) -> None:
        """A deferred step's collectives stay queued on the device after rank 0 returns from it:
        ``event`` (recorded here, after them) marks them for the watchdog until it completes."""
        event.record()
        self._queued = [e for e in self._queued if not e.query()] + [event]

    def busy(self) -> bool:
        """Rank 0 is inside a step, or a deferred step's device work is not done: a collective may
        wait for a dead peer."""
        return self.in_step or any(not e.query() for e in self._queued)

    # ---- liveness ----------------------------------------------------------------------------
    def check(self, when: str) -> None:
        for rank, p in self.procs.items():
            if not p.is_alive():
                raise self.die(f"{self.role} {rank} (pid {p.pid}) exited with code {p.exitcode} {when}")

    def ensure_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.closed:
            raise EngineDeadError(f"the {self.mode} engine was shut down")
        self.check("before a step")

    def collective(self, fn, what: str):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - any failure here leaves the ranks out of step
            raise self.fatal(e, what) from e

    def fatal(self, e: BaseException, what: str) -> EngineDeadError:
        """The error to raise after ``e`` broke a step: names a dead rank if there is one."""
        if isinstance(e, EngineDeadError) and self.dead is not None:
            return e
        sentinels = [p.sentinel for p in self.procs.values()]
        if sentinels:  # a peer's death often surfaces as a socket error a moment before its exit code
            # (seconds on a loaded machine: 2 s and once 10 s were too short with the suite on 2 cores);
            # after a timeout the peer is more likely hung than dying: wait briefly
            timed_out = "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()
            ready = multiprocessing.connection.wait(sentinels, timeout=2.0 if timed_out else 20.0)
            # a sentinel is ready when the exiting process has closed its files, a moment before the
            # kernel makes it a zombie: is_alive() (waitpid WNOHANG) can still say alive then; join it
            for p in self.procs.values():
                if p.sentinel in ready:
                    p.join(5.0)
        for rank, p in self.procs.items():
            if not p.is_alive():
                return self.die(f"{self.role} {rank} (pid {p.pid}) exited with code {p.exitcode} during the {what} "
                                f"({type(e).__name__}: {e})")
        return self.die(f"{self.mode} {what} failed on rank 0 while every local rank is alive (a rank hung, or one "
                        f"on another node is gone; distributed_timeout={self.timeout_s:g} s): {type(e).__name__}: {e}")

    def die(self, message: str) -> EngineDeadError:
        self._queued = []  # (nothing queued is waited for any more)
        if self.dead is None:
            self.dead = message
            log.critical("dsv4 parallel: the engine is dead: %s", message)
            for p in self.procs.values():
                if p.is_alive():
                    p.terminate()
        return EngineDeadError(self.dead)

    def watch_cuda(self, device: torch.device) -> None:
        """NCCL does not notice a dead peer on NVLink: a collective would wait for the timeout, and
        the timeout then aborts the process. A local rank that dies mid-step aborts the communicator
        instead (the step then raises); if rank 0 is still stuck, it exits."""
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        if not sentinels:
            return

        def watch():
            multiprocessing.connection.wait(list(sentinels))
            if self.closed:
                return
            time.sleep(5.0)
            if not self.busy() or self.closed:
                return  # the next step's liveness check reports it
            log.critical("dsv4 parallel: a rank died while rank 0 waits in a collective; aborting the NCCL "
                         "communicator")
            try:
                torch.distributed.distributed_c10d._get_default_group()._get_backend(device).abort()
            except Exception as e:  # noqa: BLE001 - best effort; the exit below bounds the wait
                log.critical("dsv4 parallel: NCCL abort failed: %s", e)
            time.sleep(10.0)
            if self.busy() and self.dead is None:
                log.critical("dsv4 parallel: rank 0 is still blocked after a rank died; exiting")
                os._exit(1)

        threading.Thread(target=watch, name="dsv4-watch", daemon=True).start()

    # ---- shutdown ----------------------------------------------------------------------------
    def stop(self, clean: bool) -> None:
        """After rank 0 told the ranks to stop (``clean``) or found the engine dead: every rank leaves
        the group at the same time (NCCL's communicator teardown can wait for its peers, so rank 0
        must not first wait for the others to exit), then stragglers are terminated."""
        self.closed = True
        if clean:
            destroy_group(timeout=30.0)
        stop_processes(self.procs, grace=10.0 if clean else 0.0)
        self._finalizer.detach()
        _finalize(self.procs)

    def abandon(self) -> None:
        """A failed start: terminate whatever was started and leave the group."""
        self.closed = True
        self._finalizer()
