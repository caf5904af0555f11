"""The model's concurrent branches on CUDA side streams (``dsv4.model.branches``).

A decode step's kernels are small: most use a fraction of the SMs for a few microseconds, and in
one stream each waits for the one before. A branch the model marks (the shared expert, the
compressors, the indexer) is issued on a side stream of its lane instead, after the main stream's
work so far, and the main stream waits for it only where it reads the result: in a CUDA graph the
two become parallel paths of one graph. No value changes: the same kernels run on the same
operands.

Only a CUDA-graph capture branches (the decode and speculative graphs, batches of at most
``MAX_TOKENS`` tokens): an eager step pays each fork's stream switches and events on the host at
every step, and measured slower with them (H200, 43 layers, 128-token prefill: 977 against 1,128
tok/s). An eager step runs a branch in order but with its lane's device state (its split-K
counters, its stream), so that the uncaptured runs before a capture make them.

Memory: a branch's inputs are kept alive until its join, so the main stream cannot reuse their
blocks while the side stream reads them; what a branch allocates belongs to its side stream's pool,
reused there only by a later branch, which starts after the main stream's work that read it. A
branch forked ``after`` an earlier ``point()`` starts from that point, so between the point and the
fork the main path must not drop an earlier branch's result (the model issues one critical-path launch
there: the branch's kernels are issued after it, so the graph launches that one first).
"""

from __future__ import annotations

import torch

from ..model.branches import Pending, branch, serial_fork

ENABLED = True  # False: every branch runs in order (for A/B measurements: --set dsv4.ops.streams.ENABLED=false)
MAX_TOKENS = 256  # larger batches run in order: their kernels fill the GPU on their own
_streams: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device, lane) → its side stream


def lane_stream(device: torch.device, lane: int) -> torch.cuda.Stream:
    """The side stream of ``lane`` on ``device`` (made once: a CUDA graph keeps using it)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), lane)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device=key[0])
    return _streams[key]


def _lane_work(t: torch.Tensor) -> bool:
    return ENABLED and t.is_cuda and t.shape[0] <= MAX_TOKENS


def point() -> torch.cuda.Event | None:
    """The current stream's work so far, for a later ``fork(after=)``: in a capture, an event recorded now
    (None otherwise: a fork out of a capture runs in order)."""
    if not (ENABLED and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def fork(fn, *inputs, lane: int = 0, after: torch.cuda.Event | None = None) -> Pending:
    """``fn(*inputs)`` issued on ``lane``'s side stream after the current stream's work so far (``after``:
    only after that earlier ``point()``), in a CUDA-graph capture; its ``result()`` makes the current stream
    wait for it. In order otherwise: eager, disabled, off CUDA or for a large batch (the first tensor
    input's rows)."""
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    if first is None or not _lane_work(first):
        return serial_fork(fn, *inputs, lane=lane)
    if not torch.cuda.is_current_stream_capturing():  # eager: in order, the lane's state made for a capture
        lane_stream(first.device, lane)
        with branch(lane, concurrent=False):
            return Pending(fn(*inputs))
    main = torch.cuda.current_stream(first.device)
    side = lane_stream(first.device, lane)
    if after is not None:
        side.wait_event(after)
    else:
        side.wait_stream(main)
    with torch.cuda.stream(side), branch(lane):
        value = fn(*inputs)
    done = torch.cuda.Event()
    done.record(side)
    return Pending(value, lambda: torch.cuda.current_stream(first.device).wait_event(done), keep=inputs)


fork.label = "CUDA side streams"
fork.point = point
