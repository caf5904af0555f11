"""Concurrent branches of a forward: work that reads what the main path has made but that the main
path does not need until later (the shared expert beside the routed ones, the compressors and the
indexer beside the query projection).

The model marks such work with its op set's ``fork(fn, *inputs, lane=)`` and takes the result where
it is needed with ``Pending.result()``. ``fork(..., after=point)`` starts the branch from an earlier
``fork_point()`` of the main path: it is issued after the main path's work since then (a critical
path's launch, which then reaches the SMs first) but does not wait for it. The oracle's ``fork``
(``serial_fork``) runs it at once, so the reference's order and bits are the model's; a backend's
``fork`` may run it beside the main path (``dsv4.ops.streams``: a CUDA side stream per lane), which
changes no value: each branch runs the same ops on the same operands, only the launch order between
branches differs. ``fn`` gets the main path's tensors it reads as ``inputs`` (a backend keeps them
alive until the join), and a table of the forward (``step.per_forward``) that a concurrent branch is
the first to ask for is not shared (``inside``): another lane could read it before it is written. A
branch on another lane that reads a branch's value ``wait``s for it. Every ``Pending`` is joined
before the forward ends, so whatever follows the forward (a graph's end, a cache copy) sees its work.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

_lanes: list = []  # (lane, concurrent) of the branches whose work is being issued now, innermost last


@contextmanager
def branch(lane=None, concurrent: bool = True):
    """The ``with`` body issues a branch's work on ``lane``: beside the main path (``inside()`` is
    true), or in order with the lane's own device state (``concurrent=False``)."""
    _lanes.append((lane, concurrent))
    try:
        yield
    finally:
        _lanes.pop()


def inside() -> bool:
    """Whether the work being issued now belongs to a concurrent branch."""
    return any(c for _, c in _lanes)


def current_lane():
    """The lane whose work is being issued now (None: the main path). A kernel's device state that one
    launch at a time may use (split-K arrival counters) is kept per lane: lanes run at the same time."""
    return _lanes[-1][0] if _lanes else None


class Pending:
    """A branch's result. ``result()`` joins it to the main path (after its ``join``, once) and
    returns its value; calling it again is free."""

    def __init__(self, value, join: Callable[[], None] | None = None, keep=()):
        self._value, self._join, self._keep = value, join, keep

    def result(self):
        if self._join is not None:
            join, self._join, self._keep = self._join, None, ()
            join()
        return self._value

    def on_lane(self):
        """The value without a join, for a later branch of the same lane only: its work is issued after
        this branch's on the same stream, which orders it there."""
        return self._value

    def wait(self):
        """The value, for a branch on another lane: the current stream (that branch's) waits for this one's
        work; the main path still joins it with ``result()``."""
        if self._join is not None:
            self._join()
        return self._value


def serial_fork(fn: Callable, *inputs, lane: int = 0, after=None) -> Pending:
    """The oracle's fork: ``fn(*inputs)`` now, in the main path's order (its tables shared as the
    main path's: nothing runs beside it). ``after`` (a ``fork_point``) changes nothing here."""
    return Pending(fn(*inputs))


def serial_point():
    """The oracle's ``fork_point``: nothing to remember (its forks run in order)."""
    return None


serial_fork.point = serial_point


class Deferred:
    """A branch that the op it is handed to forks itself, once that op's own first launches are issued (``issue``
    wraps a ``fork(..., after=point)``): in a CUDA graph those launches then reach the SMs before the branch's,
    while the branch still starts from ``point``. ``issue(after)`` forks it once and returns its ``Pending``;
    ``after``, a later ``fork_point`` of the main path (the op's, taken just before its first launch), makes the
    branch start from there instead: its kernels cannot become ready before that launch's."""

    def __init__(self, issue: Callable[[object], object]):
        self._issue, self._pending = issue, None

    def issue(self, after=None):
        if self._issue is not None:
            self._pending, self._issue = self._issue(after), None
        return self._pending


def resolve(value):
    """``value``'s result if it is a ``Pending`` (a ``Deferred`` one issued first), else ``value`` (what an op
    that takes either reads)."""
    if isinstance(value, Deferred):
        value = value.issue()
    return value.result() if isinstance(value, Pending) else value
