"""Micro-batches (`legion_nn.micro_batches`): a step whose batch runs as M slices.

The rewritten graph must compute the full-batch step up to the order of its sums, in one process
and on R ranks under every strategy (float64, 1e-9 relative, each rank sending exactly what its
program plans), its plans must cover every task's space disjointly, and the order a schedule
gives must change the memory a rank holds: 1F1B keeps one micro-batch's activations, GPipe all.
"""

from __future__ import annotations

import numpy as np
import pytest

from legion_nn.errors import LegionNNError, VerifyError
from legion_nn.micro_batches import micro_batched, micro_name, schedule_of
from legion_nn.networks import load_network
from legion_nn.op_records import flops_per_element
from legion_nn.rect import Rect
from legion_nn.registry import access_map, box_map
from legion_nn.spec import network_from_dict
from legion_nn.verify import verify
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin, find_units, param_of
from partitioner.verify_plan import verify_plan
from runtime.step.buffers import ACTIVATIONS, step_buffers
from runtime.step.programs import build_programs
from runtime.training import Trainer
from tests.runtime.test_rank_executor import (
    assert_same,
    config,
    local_run,
    ranks_run,
    small_network,
)


def dropout_network():
    """A network whose result depends on where each sample sits in the batch (dropout masks)."""
    return network_from_dict(
        {
            "name": "drop",
            "input": [1, 6, 6],
            "classes": 3,
            "layers": [
                {"kind": "linear", "name": "hidden", "out": 12},
                {"kind": "filterNL", "fn": "relu"},
                {"kind": "dropout", "ratio": 0.5, "seed": 11},
                {"kind": "linear", "name": "classifier", "out": 3},
                {"kind": "softmax"},
                {"kind": "evaluate"},
            ],
        },
        "drop",
    )


def mlp_network():
    """Linear layers on both sides of a cut, with and without biases: each defers its weights'
    gradients under a `-deferred` schedule."""
    return network_from_dict(
        {
            "name": "mlp",
            "input": [6, 2, 2],
            "classes": 4,
            "layers": [
                {"kind": "linear", "name": "fc1", "out": 16, "bias": True},
                {"kind": "filterNL", "fn": "relu"},
                {"kind": "linear", "name": "fc2", "out": 12},
                {"kind": "filterNL", "fn": "relu"},
                {"kind": "linear", "name": "fc3", "out": 10, "bias": True},
                {"kind": "filterNL", "fn": "relu"},
                {"kind": "linear", "name": "classifier", "out": 4},
                {"kind": "softmax"},
                {"kind": "evaluate"},
            ],
        },
        "mlp",
    )


def test_the_batch_carrying_work_runs_once_per_micro_batch():
    graph = small_network().lower(batch=7, dtype="float64")
    split = micro_batched(graph, 3)
    verify(split)
    per_batch = [t for t in graph.tasks if t.space.hi[0] == 7 and t.phase != "update"]
    names = {t.name for t in split.tasks}
    for task in per_batch:
        assert task.name not in names
        rows = [split.task(micro_name(task.name, m)).space.hi[0] for m in range(3)]
        assert rows == [3, 2, 2]  # 7 samples: larger slices first
    offsets = [split.task(micro_name("data", m)).attrs["batch_offset"] for m in range(3)]
    assert offsets == [0, 3, 5]
    shared = [t for t in graph.tasks if t not in per_batch]
    assert all(split.task(t.name) is t for t in shared)  # run once, unchanged
    assert split.tensors["L0.W"] == graph.tensors["L0.W"]
    assert split.tensors[micro_name("L0.filter.output", 2)].dims == (2, 8, 16, 16)
    assert "L0.filter.output" not in split.tensors
    order = [t.name for t in split.tasks]
    # a parameter's gradient is zeroed before every micro-batch adds to it, stepped after all
    assert order.index("L0.W.grad.set_zero") < order.index(micro_name("L0.filter.grad", 0))
    assert order.index("update_L0.W") > order.index(micro_name("L0.filter.grad", 2))


def test_schedules_order_forwards_and_backwards():
    graph = small_network().lower(batch=8, dtype="float64")

    def phases(schedule):
        split = micro_batched(graph, 2, schedule)
        assert schedule_of(split) == (2, schedule)
        return [
            (t.phase[0], t.attrs["micro_batch"])
            for t in split.tasks
            if "micro_batch" in t.attrs and t.phase in ("forward", "backward")
        ]

    def runs(sequence):
        return [key for i, key in enumerate(sequence) if i == 0 or sequence[i - 1] != key]

    assert runs(phases("1f1b")) == [("f", 0), ("b", 0), ("f", 1), ("b", 1)]
    assert runs(phases("gpipe")) == [("f", 0), ("f", 1), ("b", 0), ("b", 1)]


def test_one_micro_batch_is_the_graph_itself():
    graph = small_network().lower(batch=4)
    assert micro_batched(graph, 1) is graph
    assert schedule_of(graph) == (1, None)


def test_a_layers_copies_make_one_unit_with_one_grid():
    graph = small_network().lower(batch=8)
    split = micro_batched(graph, 2)
    whole = {u.name: u for u in find_units(graph)}
    units = {u.name: u for u in find_units(split)}
    assert set(units) == set(whole)
    for name, unit in units.items():
        if name == "classifier.evaluate.accuracy":  # reads the step's counts: runs once
            assert unit == whole[name]
            continue
        assert unit.forward == tuple(
            micro_name(task, m) for m in range(2) for task in whole[name].forward
        )
        assert unit.backward == tuple(
            micro_name(task, m) for m in range(2) for task in whole[name].backward
        )
        assert unit.extents == (4, *whole[name].extents[1:])


def _flops(graph) -> float:
    return sum(flops_per_element(t, graph.tensors) * t.space.volume for t in graph.tasks)


@pytest.mark.parametrize("schedule", ["1f1b-deferred", "gpipe-deferred"])
def test_deferred_weight_gradients_run_once_over_every_micro_batch(schedule):
    graph = mlp_network().lower(batch=7, dtype="float64")
    split = micro_batched(graph, 3, schedule)
    verify(split)
    assert schedule_of(split) == (3, schedule)
    order = [t.name for t in split.tasks]
    last_backward = max(
        i for i, t in enumerate(split.tasks) if t.phase == "backward" and "micro_batch" in t.attrs
    )
    for task in graph.tasks:
        if task.op != "linear" or task.phase != "backward":
            continue
        weights = split.task(task.name)  # the whole batch's weight gradients, under its name
        assert weights.attrs["micro_rows"] == (3, 2, 2)
        assert order.index(task.name) > last_backward
        written = {r.tensor for r in task.requirements if r.role in ("weights.delta", "b.delta")}
        assert {r.tensor for r in weights.requirements if r.privilege.writes} == written
        for m, rows in enumerate((3, 2, 2)):
            for role in ("input", "output.delta"):
                req = weights.requirement(f"{role}@{m}")
                assert req.tensor == micro_name(task.requirement(role).tensor, m)
                assert req.read_rect.shape[0] == rows
            copy = micro_name(task.name, m)
            if not task.attrs["need_dx"]:  # the first layer's input needs no gradient
                assert copy not in order
                continue
            copied = split.task(copy)
            assert copied.attrs["need_dw"] is False
            assert not {r.tensor for r in copied.requirements} & written
            assert order.index(copy) < order.index(task.name)
    # the same products, grouped otherwise
    assert _flops(split) == pytest.approx(_flops(micro_batched(graph, 3, "1f1b")), rel=1e-12)


def test_a_deferred_gradients_boxes_are_its_rects():
    """The access map of a deferred weight gradient cuts each `role@m` to micro-batch m's rows,
    over arrays of pieces (the partitioner's form) as over one."""
    split = micro_batched(mlp_network().lower(batch=7), 3, "1f1b-deferred")
    task = split.task("fc3.linear3.grad")
    dims = task.role_dims(split.tensors)
    pieces = task.space.split((3, 2, 1, 1, 1, 1, 1))
    lo = np.array([p.lo for p in pieces])
    hi = np.array([p.hi for p in pieces])
    boxes = box_map(task.op, task.phase)(task.attrs, dims, lo, hi)
    rects = [access_map(task.op, task.phase)(task.attrs, dims, p) for p in pieces]
    for role in dims:
        for i, found in enumerate(rects):
            box = Rect(boxes[role][0][i], boxes[role][1][i])
            assert box == found[role] or (box.is_empty() and found[role].is_empty()), role
    # micro-batch 0 has 3 rows, the others 2: the third piece of rows reads none of theirs
    third = next(i for i, p in enumerate(pieces) if p.lo[0] == 2)
    assert rects[third]["input@1"].is_empty() and not rects[third]["input@0"].is_empty()


@pytest.mark.parametrize(
    ("count", "schedule", "message"),
    [
        (9, "1f1b", "--micro-batches 9 is larger than the batch of 8 samples"),
        (0, "1f1b", "--micro-batches must be at least 1"),
        (2, "zigzag", "--schedule must be one of 1f1b, gpipe"),
    ],
)
def test_bad_counts_and_schedules_are_named(count, schedule, message):
    graph = small_network().lower(batch=8)
    with pytest.raises(LegionNNError, match=message):
        micro_batched(graph, count, schedule)


@pytest.mark.parametrize("network", [small_network, dropout_network, mlp_network])
@pytest.mark.parametrize(
    ("count", "schedule"),
    [(2, "1f1b"), (3, "gpipe"), (7, "1f1b"), (3, "1f1b-deferred"), (2, "gpipe-deferred")],
)
def test_one_process_equals_the_full_batch(network, count, schedule):
    full = local_run(config(network()))
    split = local_run(config(network(), micro_batches=count, schedule=schedule))
    assert_same(full, [(*split, [])])


@pytest.mark.parametrize("strategy", ["data", "model", "spatial"])
@pytest.mark.parametrize(
    ("nranks", "count", "schedule"), [(2, 2, "1f1b"), (3, 3, "gpipe"), (2, 3, "1f1b-deferred")]
)
def test_ranks_equal_the_full_batch_in_one_process(strategy, nranks, count, schedule):
    full = local_run(config(small_network()))
    cfg = config(small_network(), micro_batches=count, schedule=schedule)
    assert_same(full, ranks_run(cfg, nranks, strategy))


@pytest.mark.parametrize("strategy", ["data", "model", "spatial"])
def test_plans_of_micro_batches_cover_every_task_disjointly(strategy):
    graph = micro_batched(load_network("seed-lcn-small").lower(batch=16), 4)
    verify_plan(graph, build_plan(graph, builtin(graph, strategy, 4), 4))


def test_1f1b_holds_fewer_activations_than_gpipe():
    """At M = 8 on one rank: 1F1B frees each micro-batch's activations after its backward,
    GPipe holds every micro-batch's until the backwards start: all that backward reads, as the
    whole batch does, less the transients each forward frees before the next starts."""
    base = load_network("seed-lcn-small").lower(batch=64)

    def activations(graph) -> int:
        plan = build_plan(graph, builtin(graph, "data", 1), 1)
        buffers = step_buffers(graph, build_programs(graph, plan, Machine(), [0])[0])
        return max(buffers.by_kind(p).get(ACTIVATIONS, 0) for p in range(buffers.length))

    whole = activations(base)
    one_f_one_b = activations(micro_batched(base, 8, "1f1b"))
    gpipe = activations(micro_batched(base, 8, "gpipe"))
    assert one_f_one_b == pytest.approx(whole / 8, rel=0.01)
    assert 4 * one_f_one_b < gpipe <= whole


def _gradient_sums(graph, plan) -> list:
    """The collectives of `plan` that sum parameters' gradients."""
    return sorted(
        (r.tensor, r.participants, r.targets)
        for task_plan in plan.tasks
        for r in task_plan.reductions
        if graph.tensors[r.tensor].kind == "grad" and param_of(graph, r.tensor) is not None
    )


@pytest.mark.parametrize("strategy", ["data", "spatial"])
def test_parameter_gradients_are_summed_across_ranks_once_a_step(strategy):
    """Each micro-batch adds its part of a replicated gradient into each rank's copy; the last
    one's all-reduce sums the copies: the same collectives as the full batch's, not M of each."""
    base = load_network("seed-lcn-small").lower(batch=64)
    split = micro_batched(base, 4)
    whole = build_plan(base, builtin(base, strategy, 4), 4)
    plan = build_plan(split, builtin(split, strategy, 4), 4)
    verify_plan(split, plan)
    assert _gradient_sums(split, plan) == _gradient_sums(base, whole)
    deferred = {t.task: dict(t.deferred) for t in plan.tasks if t.deferred}
    last = split.index(micro_name("L0.filterA.grad", 3))
    for m in range(3):  # the scale of layer L0, which every piece adds to under both
        assert deferred[micro_name("L0.filterA.grad", m)]["L0.a.grad"] == last


def test_a_sum_deferred_past_a_reader_is_caught():
    graph = micro_batched(load_network("seed-lcn-small").lower(batch=16), 2)
    plan = build_plan(graph, builtin(graph, "data", 2), 2)
    first = graph.index(micro_name("L0.filter.grad", 0))
    beyond = graph.index("update_L0.W")
    plan.tasks[first] = plan.tasks[first].with_deferred({"L0.W.grad": beyond})
    with pytest.raises(VerifyError, match="deferred past update_L0.W, which reads it"):
        verify_plan(graph, plan)


def test_ranks_sum_deferred_gradients_in_place():
    """Even micro-batches on 2 data-parallel ranks: every gradient's sum is deferred to the
    last micro-batch, whose collective sums each rank's copy in place."""
    cfg = config(small_network(), batch=8, micro_batches=4)
    graph = Trainer(cfg).graph(8)
    plan = build_plan(graph, builtin(graph, "data", 2), 2)
    assert sum(len(t.deferred) for t in plan.tasks) >= 3 * 5  # every parameter, 3 of 4 times
    assert_same(local_run(config(small_network(), batch=8)), ranks_run(cfg, 2, "data"))
