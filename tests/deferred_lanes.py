"""A fork that runs every branch as late as a side stream may (``dsv4.model.branches``): when it is
joined, after the earlier branches of its lane. A model run through it must give the in-order bits."""

from __future__ import annotations

from dsv4.model import branches
from dsv4.model.branches import Pending


class DeferredLanes:
    """A fork that issues nothing until a branch is joined; then it runs that lane's queued branches up
    to the joined one, in fork order (a lane is one side stream)."""

    def __init__(self):
        self.queues: dict[int, list[_Deferred]] = {}
        self.forks = 0

    def __call__(self, fn, *inputs, lane: int = 0, after=None) -> Pending:
        p = _Deferred(self.queues.setdefault(lane, []), fn, inputs)
        self.queues[lane].append(p)
        self.forks += 1
        return p

    def point(self):
        """A main-path point to start a later fork from (``after``): not None, as in a graph capture, so the
        model takes the paths it takes where branches run beside it; the branches here ignore it."""
        return object()

    def unjoined(self) -> int:
        return sum(len(q) for q in self.queues.values())


class _Deferred(Pending):
    def __init__(self, queue, fn, inputs):
        super().__init__(None)
        self.queue, self.fn, self.inputs, self.done = queue, fn, inputs, False

    def result(self):
        while not self.done:
            head = self.queue.pop(0)
            with branches.branch():
                head._value = head.fn(*head.inputs)
            head.done = True
        return self._value

    def wait(self):  # a branch on another lane reads it: its lane runs up to it, as a stream would have
        return self.result()

    def on_lane(self):
        if not self.done:
            raise AssertionError("a branch's value was read on its lane before the lane ran it")
        return self._value
