"""The model's concurrent branches (``dsv4.model.branches``): what a fork promises, checked on CPU by
running every branch as late as a side stream may run it (``DeferredLanes``: when it is joined, after
the earlier branches of its lane). The model must give the in-order bits that way too: a branch
whose result is read before its join, an input the main path changes before the join, a branch never
joined, or a table a branch shares with the main path would all change them."""

from __future__ import annotations

import torch
from deferred_lanes import DeferredLanes

from dsv4.model import branches
from dsv4.model.branches import Pending


def test_serial_fork_runs_now_and_pending_joins_once():
    calls, joins = [], []
    p = branches.serial_fork(lambda a, b: calls.append((a, b)) or a + b, 2, 3, lane=1)
    assert calls == [(2, 3)] and p.result() == 5 and p.result() == 5
    q = Pending("v", join=lambda: joins.append(1), keep=(torch.ones(1),))
    assert q.result() == "v" and q.result() == "v" and joins == [1]
    assert branches.resolve(q) == "v" and branches.resolve(7) == 7 and branches.resolve(None) is None


def test_deferred_forks_once_when_issued_or_resolved():
    """A ``Deferred`` branch is forked by the op it is handed to (``issue``), once, from the point the op hands it
    (none: its own); ``resolve`` issues it if the op has not and joins it."""
    forks = []
    d = branches.Deferred(lambda after: forks.append(after) or branches.serial_fork(lambda a: a * 2, 21))
    assert forks == []
    p = d.issue("up")
    assert forks == ["up"] and d.issue() is p and branches.resolve(d) == 42 and forks == ["up"]
    assert branches.resolve(branches.Deferred(lambda after: forks.append(after) or Pending(5))) == 5
    assert forks == ["up", None]


def test_wait_orders_another_lane_and_leaves_the_join_to_the_main_path():
    """``wait()`` (a branch on another lane reading this one) runs the join on the current stream each time and
    returns the value; ``result()`` still joins once for the main path. The serial fork ignores ``after`` and
    its point is None."""
    joins = []
    q = Pending("v", join=lambda: joins.append(1))
    assert q.wait() == "v" and joins == [1]
    assert q.result() == "v" and joins == [1, 1] and q.result() == "v" and joins == [1, 1]
    assert q.wait() == "v" and joins == [1, 1]  # joined: nothing left to wait for
    assert branches.serial_fork.point() is None
    assert branches.serial_fork(lambda a: a + 1, 1, lane=2, after=object()).result() == 2


def test_a_table_first_made_in_a_branch_is_not_shared():
    """A concurrent branch's ``per_forward`` table is its own (another lane could read it before it is
    written); one made on the main path is served to the branches."""
    from dsv4.model.step import Step, shared_tables

    s = Step([], torch.arange(10))
    with shared_tables():
        with branches.branch():
            assert branches.inside()
            mine = s.phase(4)
            assert s.phase(4) is not mine and torch.equal(s.phase(4), mine)
        assert not branches.inside()
        main = s.visible(4)
        with branches.branch():
            assert s.visible(4) is main
        assert s.phase(4) is s.phase(4)


def test_deferred_branches_give_the_in_order_logits(tiny_ckpt, monkeypatch):
    """The fast path's structure (weights in checkpoint formats, the grouped experts, the shared expert
    a branch whose result the experts' op joins where it adds it) with every branch run as late as
    its join allows: the same bits as in order, and every branch joined."""
    from dsv4.model.model import ReferenceModel
    from dsv4.model.opset import WEIGHT_OPS, OpSet
    from dsv4.ops.registry import resolve

    weight_ops = {op: resolve(op, force={op: "torch"})[1] for op in WEIGHT_OPS}
    from dsv4.model.moe import MoE

    downs = []
    shared_down = MoE._shared_down
    monkeypatch.setattr(MoE, "_shared_down", lambda self, *a: downs.append(1) or shared_down(self, *a))
    lanes = DeferredLanes()
    deferred = ReferenceModel(tiny_ckpt, ops=OpSet(weight_ops, fork=lanes))
    in_order = ReferenceModel(tiny_ckpt, ops=OpSet(weight_ops))
    assert deferred.blocks[0].moe.grouped and deferred.blocks[0].moe.shared is not None
    # the fork has points, as a capture does: the shared expert's activation and w2 are a Deferred branch
    # (``SHARED_DOWN_BESIDE_EXPERTS``), forked inside the experts' op
    ids = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(11))
    got, want = deferred.prefill(ids, chunk_sizes=[17, 7])[0], in_order.prefill(ids, chunk_sizes=[17, 7])[0]
    assert lanes.forks >= 2 * deferred.cfg.num_hidden_layers and lanes.unjoined() == 0
    assert torch.equal(got, want)
    assert len(downs) == 2 * deferred.cfg.num_hidden_layers  # two chunks: the split shared expert every layer


def test_split_counters_are_per_lane():
    """Split-K arrival counters serve one launch at a time: the main path and each lane (a side stream
    each, running at the same time) get their own buffer, and keep it."""
    from dsv4.ops.triton._common import split_counters

    dev = torch.device("cpu")
    main = split_counters(dev, 10)
    with branches.branch(0):
        zero = split_counters(dev, 10)
        assert branches.current_lane() == 0
        with branches.branch(1):
            one = split_counters(dev, 10)
    assert branches.current_lane() is None
    with branches.branch(1, concurrent=False):  # an eager step's in-order branch: the lane's state, tables shared
        assert split_counters(dev, 10) is one and not branches.inside()
    assert len({main.data_ptr(), zero.data_ptr(), one.data_ptr()}) == 3
    assert split_counters(dev, 10) is main
    with branches.branch(1):
        assert split_counters(dev, 10) is one
