"""`partitioner.plan_memo`: the planner's work shared by tasks that repeat.

A plan made with the memo equals, array for array, the plan made with every task's transfers
and layouts found afresh; and a layer's copies in each micro-batch are planned once, not once
per copy.
"""

from __future__ import annotations

import numpy as np
import pytest

from legion_nn.networks import load_network
from partitioner import messages, plan_memo
from partitioner.layout import Layout
from partitioner.messages import Accesses
from partitioner.pipeline import step_graph
from partitioner.plan import build_plan
from partitioner.strategy import builtin


class _Afresh(plan_memo.PlanMemo):
    """A memo that remembers nothing: every call computes."""

    def layout(self, ndim, ranks, lo, hi):
        return Layout.from_arrays(ndim, ranks, lo, hi)

    def accesses(self, columns):
        return Accesses(*columns)

    def fetch(self, tensor, itemsize, layout, reads, fresh, fail):
        return messages.fetch(tensor, itemsize, layout, reads, fresh, fail)

    def combine(self, tensor, itemsize, layout, contributions, major, fail):
        return messages.combine(tensor, itemsize, layout, contributions, major, fail)


def _layout_arrays(layout):
    return [*layout.cut_arrays, layout.holder_ptr, layout.holder_ranks]


def _assert_same_plans(a, b):
    assert len(a.tasks) == len(b.tasks)
    for x, y in zip(a.tasks, b.tasks, strict=True):
        assert x.task == y.task
        for bx, by in zip(x.transfer_set.blocks, y.transfer_set.blocks, strict=True):
            assert (bx.tensor, bx.reduce) == (by.tensor, by.reduce)
            for field in ("lo", "hi", "nbytes", "src", "dst_ptr", "dsts", "major", "minor"):
                assert np.array_equal(getattr(bx, field), getattr(by, field)), (x.task, field)
        assert len(x.transfer_set.blocks) == len(y.transfer_set.blocks)
        assert x.reductions == y.reductions, x.task
        assert x.holdings.keys() == y.holdings.keys(), x.task
        for name in x.holdings:
            for u, v in zip(
                _layout_arrays(x.holdings[name]), _layout_arrays(y.holdings[name]), strict=True
            ):
                assert np.array_equal(u, v), (x.task, name)


CASES = [
    ("deep-mlp", 16, 2, 4, "data", 4),
    ("deep-mlp", 16, 2, 4, "model", 4),
    ("seed-lcn-small", 8, 1, 2, "spatial", 3),
    ("seed-lcn-small", 8, 2, 4, "model", 2),
    ("vgg19", 4, 1, 1, "model", 8),
]


@pytest.mark.parametrize(("network", "batch", "stages", "count", "strategy", "nranks"), CASES)
def test_a_plan_equals_the_plan_found_afresh(
    network, batch, stages, count, strategy, nranks, monkeypatch
):
    graph = step_graph(load_network(network).lower(batch), stages, count, "1f1b")
    strategy_ = builtin(graph, strategy, nranks)
    remembered = build_plan(graph, strategy_, nranks)
    monkeypatch.setattr("partitioner.pieces.PlanMemo", _Afresh)
    _assert_same_plans(remembered, build_plan(graph, strategy_, nranks))


def test_a_layers_copies_are_planned_once(monkeypatch):
    """Eight micro-batches find scarcely more transfers than one: each copy of a task takes the
    first copy's (the first reads of the parameters differ from the later ones, which hold
    them already)."""
    calls = {"fetch": 0, "combine": 0}

    def counting(name, real):
        def call(*args):
            calls[name] += 1
            return real(*args)

        return call

    monkeypatch.setattr(plan_memo, "fetch", counting("fetch", messages.fetch))
    monkeypatch.setattr(plan_memo, "combine", counting("combine", messages.combine))
    found = {}
    for count in (1, 8):
        graph = step_graph(load_network("deep-mlp").lower(32), 2, count, "1f1b")
        calls.update(fetch=0, combine=0)
        build_plan(graph, builtin(graph, "model", 4), 4)
        found[count] = calls["fetch"] + calls["combine"]
    assert found[8] < 2 * found[1], found


def _one_rect_read_by_two_ranks():
    """Rank 0 holds a 4×4 tensor whole; ranks 1 and 2 read all of it."""
    layout = Layout.from_arrays(
        2, np.array([0]), np.array([[0, 0]], np.int64), np.array([[4, 4]], np.int64)
    )
    lo, hi = np.array([[0, 0], [0, 0]], np.int64), np.array([[4, 4], [4, 4]], np.int64)
    return layout, (np.array([1, 2]), lo, hi, np.array([0, 1]))


def test_the_readers_already_holding_a_copy_are_part_of_the_key():
    layout, columns = _one_rect_read_by_two_ranks()
    memo = plan_memo.PlanMemo()
    reads = memo.accesses(columns)
    fail = ValueError
    both = memo.fetch("x", 4, layout, reads, np.array([True, True]), fail)
    one = memo.fetch("y", 4, layout, reads, np.array([True, False]), fail)
    assert list(both.dsts) == [1, 2] and list(one.dsts) == [1]
    assert (
        one.tensor == "y"
        and memo.fetch("z", 4, layout, reads, np.ones(2, bool), fail).tensor == "z"
    )


def test_a_layout_written_again_is_a_new_object_with_the_same_arrays():
    """`Copies` takes a tensor's new layout (a new object) to mean new data: the memo never
    hands back the object it made before, though it shares its arrays."""
    memo = plan_memo.PlanMemo()
    args = (2, np.array([0]), np.array([[0, 0]], np.int64), np.array([[4, 4]], np.int64))
    first, second = memo.layout(*args), memo.layout(*args)
    assert first is not second and second.holder_ranks is first.holder_ranks
    assert memo.layout_key(first) == memo.layout_key(second)
