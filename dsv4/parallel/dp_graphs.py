"""Decode CUDA graphs under data parallelism: every rank replays the same bucket in a step, or none.

Each rank captures its own decode graphs (``engine.cuda_graphs.DecodeGraphs``) with the MoE layers'
*dense* exchange (``EPGroup.dense_mode``: all-gather of every rank's lanes, an all-to-all of equal
splits back — fixed shapes, no count read on the host), all ranks at once so that the NCCL
collectives inside pair up bucket by bucket. A graph's collectives span the ranks, so in one step
either every rank replays the graph of one bucket or every rank runs eagerly. Before each forward
the ranks agree (a two-number all-reduce on a gloo group, :meth:`DPDecodeGraphs._agree`):

- every rank whose step is a decode step a graph takes (or that has no step at all) → all replay
  the bucket of the largest batch; a smaller batch is padded with spare lanes, a rank without
  requests replays that bucket with every lane spare (``DecodeGraphs.replay_spare``);
- any rank with a prefill, a mixed step or a batch no graph takes (or timing its collectives) → all
  run eagerly (the sparse all-to-all; a rank without requests runs the dummy forward);
- no rank with requests → nobody runs a forward.

With tensor parallelism inside the ranks the agreement is the leaders' (one process per rank),
and ``graphs`` is the leader's ``TPDecodeGraphs``: each replay (spare ones too) is announced to the
rank's group as a step plan with the agreed bucket, and every process replays its own graph.

On the CPU the graphs are emulated (the same static inputs and dense exchange, run eagerly): that
is how the tests reach this path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class DPDecodeGraphs:
    """A data-parallel rank's decode graphs (its runner's ``graphs``)."""

    def __init__(self, graphs, ep, group):
        self.graphs, self.ep, self.group = graphs, ep, group
        self.buckets, self.capture_seconds = graphs.buckets, graphs.capture_seconds
        self.replays = self.spare_replays = 0  # this rank's graph replays, and those with every lane spare
        self._bucket: int | None = None  # the bucket agreed for the step in progress

    @classmethod
    def capture(cls, model, kvc, max_num_seqs: int, max_model_len: int, ep, group) -> "DPDecodeGraphs":
        """Capture this rank's graphs (every rank at once: the collectives inside pair up)."""
        from ..engine.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(model, kvc, max_num_seqs, max_model_len)
        with ep.dense_mode():
            graphs.capture()
        return cls(graphs, ep, group)

    def _agree(self, ok: bool, n: int) -> int | None:
        """This rank's say (``ok``: a graph can take its step; ``n`` its batch, 0 without requests);
        returns the bucket every rank replays, 0 if no rank has requests, None if all run eagerly."""
        t = torch.tensor([0 if ok else 1, n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        eager, most = t.tolist()
        if eager:
            return None
        return 0 if most == 0 else self.graphs.bucket(most)

    # ---- the runner's interface ---------------------------------------------------------------
    def bucket(self, n: int) -> int | None:
        return self.graphs.bucket(n)

    def staging_target(self, n: int, max_end: int):
        return self.graphs.staging_target(n, max_end)

    def can_run(self, batch) -> bool:
        """Whether this step replays a graph — agreed with every rank, so called once per forward."""
        ok = not self.ep.timed and self.graphs.can_run(batch)
        self._bucket = self._agree(ok, len(batch.step.chunks) if ok else 0)
        return self._bucket is not None

    def run(self, batch) -> torch.Tensor:
        self.ep.begin_forward()
        self.replays += 1
        with self.ep.dense_mode():  # (the emulation on CPU runs the forward now)
            return self.graphs.run(batch, bucket=self._bucket)

    def idle(self) -> bool:
        """The step of a rank without requests: join the agreement, then replay the agreed bucket
        with spare lanes, or nothing if no rank has requests. False: the step is eager (the caller
        runs the dummy forward)."""
        b = self._agree(not self.ep.timed, 0)
        if b is None:
            return False
        if b:
            self.ep.begin_forward()
            self.replays += 1
            self.spare_replays += 1
            with self.ep.dense_mode():
                self.graphs.replay_spare(b)
        return True

    def release(self) -> None:
        """Reset every graph before the process group goes (a live graph holding NCCL launches hangs
        ``destroy_process_group``, pytorch#115388)."""
        self.graphs.release()
        self.buckets = []
