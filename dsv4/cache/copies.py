"""Row copies between the paged device cache and host memory, ordered against the model's compute.

A copy engine moves whole rows (a block, a window page) of 2-D tensors whose rows are contiguous
in memory (``rows_view``). The host tier's correctness rests on three orderings, and each engine
states how it keeps them:

1. a copy starts after every compute launched before it was issued: an offload reads a block only
   after the step that wrote it, and a restore overwrites a page only after the kernels that still
   read its old contents are done (the bug of a public engine: an unfenced restore overwrote KV that
   running kernels still read);
2. compute launched after ``wait()`` starts after every copy issued before it: a step reads the
   blocks restored for it, and a page an offload reads is not rewritten before the offload read it;
3. copies run in the order they were issued (one queue): a host slot or page written by one copy
   and read or rewritten by a later one.

On the CPU the model runs on the calling thread and a copy is done when issued, so all three hold by
construction. On CUDA the copies run on their own stream: (1) is the stream waiting for the compute
stream when copies are issued, (2) an event recorded after them that the compute stream waits for,
(3) the single stream.
"""

from __future__ import annotations

import torch


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, ...] as [N, R] over the same memory, row i covering t[i] and the padding after it
    (block-packed pages have a row stride larger than a page): one contiguous run per row, so a run
    of consecutive rows is one contiguous copy."""
    n, row = t.shape[0], t.stride(0)
    inner = t[0]
    if not inner.is_contiguous() or inner.numel() > row:
        raise ValueError(f"rows of a {tuple(t.shape)} tensor with strides {t.stride()} are not contiguous")
    end = t.storage_offset() + n * row
    if end * t.element_size() > t.untyped_storage().nbytes():
        raise ValueError(f"the storage of a {tuple(t.shape)} tensor ends before its last row's stride")
    return t.as_strided((n, row), (row, 1))


def runs(src_rows: list[int], dst_rows: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) runs covering ``dst[dst_rows[i]] = src[src_rows[i]]``, merging
    pairs that are consecutive on both sides (in the order given)."""
    if len(src_rows) != len(dst_rows):
        raise ValueError(f"{len(src_rows)} source rows for {len(dst_rows)} destination rows")
    out: list[list[int]] = []
    for s, d in zip(src_rows, dst_rows):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += 1
        else:
            out.append([s, d, 1])
    return [tuple(r) for r in out]


def copy_runs(src: torch.Tensor, dst: torch.Tensor, spans: list[tuple[int, int, int]],
              non_blocking: bool = False) -> None:
    """One contiguous ``copy_`` per run of rows."""
    for s, d, n in spans:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)


class CopyEngine:
    """Synchronous copies, for a CPU cache: each is done when ``issue`` returns, so the fences are
    empty (the model runs on this thread: nothing is in flight when a copy is issued)."""

    def issue(self, moves: list[tuple[torch.Tensor, list[int], torch.Tensor, list[int]]]) -> None:
        """``dst[dst_rows[i]] = src[src_rows[i]]`` for each (src, src_rows, dst, dst_rows), in order.
        Within one move the destination rows must be distinct."""
        for src, src_rows, dst, dst_rows in moves:
            if not dst_rows:
                continue
            idx_s = torch.tensor(src_rows, dtype=torch.long, device=src.device)
            idx_d = torch.tensor(dst_rows, dtype=torch.long, device=dst.device)
            dst.index_copy_(0, idx_d, src.index_select(0, idx_s).to(dst.device))

    def wait(self) -> None:
        """Compute launched after this call runs after every copy issued before it."""

    def synchronize(self) -> None:
        """The host waits for every copy issued so far (before it reads a host slot itself)."""


class CudaCopyEngine(CopyEngine):
    """Copies on a dedicated CUDA stream (host memory pinned, so they run asynchronously to the host
    and to the compute stream), fenced both ways against the compute stream."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._done: torch.cuda.Event | None = None  # recorded after the last copies issued, not yet waited for

    def issue(self, moves) -> None:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # ordering 1: after the compute launched so far
        with torch.cuda.stream(self.stream):
            for src, src_rows, dst, dst_rows in moves:
                copy_runs(src, dst, runs(src_rows, dst_rows), non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(self.stream)

    def wait(self) -> None:
        if self._done is not None:  # ordering 2: the next compute waits for these copies
            torch.cuda.current_stream(self.device).wait_event(self._done)
            self._done = None

    def synchronize(self) -> None:
        self.stream.synchronize()


def make_copy_engine(device) -> CopyEngine:
    """The copy engine of a cache on ``device``."""
    device = torch.device(device)
    return CudaCopyEngine(device) if device.type == "cuda" else CopyEngine()
