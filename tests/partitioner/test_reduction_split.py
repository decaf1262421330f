"""Reduction-dimension splits: grids that cut the dims a task sums over (`reduction_split`).

Megatron's row-parallel linear and a filter split over its input channels, checked in the plan
(the partial sums' bytes by hand, where the sums land, what stays local), by `verify_plan` (a
dropped partial sum is caught), in the runtime (R ranks in threads equal one process in float64,
sending exactly what the plan says), in strategy files and in `auto`.
"""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest

from legion_nn.errors import LegionNNError, VerifyError
from legion_nn.layers import Conv, Evaluate, FilterNL, Linear, Softmax
from legion_nn.network import Network
from legion_nn.networks import load_network
from legion_nn.spec import load_spec
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.reduction_split import output_grid
from partitioner.search import families
from partitioner.search.auto import auto
from partitioner.strategy import Strategy, builtin, find_units, from_grids, grid_label
from partitioner.verify_plan import verify_plan
from tests.paths import ROOT
from tests.runtime.test_rank_executor import assert_same, config, local_run, ranks_run

MACHINE = Machine(100, 12.5, 2, 16)


def mlp(features: int = 8, hidden: int = 6, classes: int = 6, bias: bool = False) -> Network:
    """Megatron's MLP block: a linear layer, a nonlinearity, a linear layer."""
    return Network(
        "mlp",
        (features, 1, 1),
        classes,
        [
            Linear("fc1", out=hidden, bias=bias),
            FilterNL("act", fn="relu"),
            Linear("fc2", out=classes, bias=bias),
            Softmax(),
            Evaluate(),
        ],
    )


def strategy(graph, nranks: int, **grids) -> Strategy:
    """The given unit grids; every other unit split over the batch as far as it goes."""
    out = {}
    for unit in find_units(graph):
        first = min(nranks, unit.extents[0]) if 0 in unit.splittable else 1
        out[unit.name] = grids.get(unit.name, (first,) + (1,) * (len(unit.extents) - 1))
    return Strategy("custom", out)


def column_then_row(graph, nranks: int) -> Strategy:
    """Megatron's plan for `mlp`: fc1 (and its nonlinearity) split over its outputs, fc2 over its
    inputs."""
    return strategy(
        graph,
        nranks,
        fc1=(1, nranks, 1, 1, 1, 1, 1),
        act=(1, nranks, 1, 1),
        **{"fc2.linear2": (1, 1, 1, 1, nranks, 1, 1)},
    )


def task_plan(plan, name: str):
    return next(tp for tp in plan.tasks if tp.task == name)


def test_a_unit_spans_its_reducers_dims_and_its_other_tasks_take_the_sum_grid():
    graph = load_network("seed-lcn-small").lower(batch=8)
    units = {u.name: u for u in find_units(graph)}
    assert units["L1"].extents == (8, 8, 14, 14, 8) and units["L1"].summed == (4,)
    assert units["classifier.linear1"].summed == (4, 5, 6)
    grids = strategy(graph, 4, L1=(1, 1, 1, 1, 4)).task_grids(graph)
    assert grids["L1.filter"] == grids["L1.filter.grad"] == (1, 1, 1, 1, 4)
    # the filter's partial sums land split over the batch, where filterA and filterNL run and
    # the gradients of their outputs are zeroed
    assert grids["L1.filterA"] == grids["L1.filterNL"] == (4, 1, 1, 1)
    assert grids["L1.filter.output.grad.set_zero"] == (4, 1, 1, 1)


def test_the_sum_grid_keeps_each_cells_sums_on_the_ranks_that_made_them():
    task = load_network("seed-lcn-small").lower(batch=8).task("L1.filter")  # (8, 8, 14, 14) × 8
    assert output_grid(task, (1, 1, 1, 1, 1)) == (1, 1, 1, 1)
    assert output_grid(task, (1, 1, 1, 1, 8)) == (8, 1, 1, 1)  # batch first
    # after the last output dim the grid cuts: ranks 4k..4k+3 made channel half k's sums
    assert output_grid(task, (1, 2, 1, 1, 4)) == (1, 8, 1, 1)
    assert output_grid(task, (2, 1, 1, 1, 2)) == (4, 1, 1, 1)
    # no room on the batch: the next dim that has it
    assert output_grid(task, (4, 1, 1, 1, 4)) == (4, 4, 1, 1)


def test_the_partial_sums_of_a_row_parallel_linear_by_hand():
    """fc2 (6 outputs over 6 inputs) split over its inputs on 2 ranks, batch 4, float32: each
    rank makes a partial sum of the whole (4, 6) output, which lands split over the batch, so
    each sends the other's 2 rows: 2 × 6 × 4 = 48 bytes each way, and nothing else moves."""
    graph = mlp().lower(batch=4)
    plan = build_plan(graph, strategy(graph, 2, **{"fc2.linear2": (1, 1, 1, 1, 2, 1, 1)}), 2)
    verify_plan(graph, plan)
    forward = task_plan(plan, "fc2.linear2")
    partial = [t for t in forward.transfers if t.reduce]
    assert sorted((t.src, t.dsts, t.nbytes) for t in partial) == [(0, (1,), 48), (1, (0,), 48)]
    assert not forward.reductions
    assert {t.tensor for t in forward.transfers if not t.reduce} == {"act.filterNL.output"}
    held = forward.holdings["fc2.linear2.output"].volumes_by_rank()
    assert held == {0: 12, 1: 12}  # one sum per element, half on each rank


def test_the_partial_sums_over_four_ranks_are_one_reduce_scatter():
    graph = mlp().lower(batch=4)
    grids = {"fc2.linear2": (1, 1, 1, 1, 4, 1, 1)}
    plan = build_plan(graph, strategy(graph, 4, **grids), 4)
    verify_plan(graph, plan)
    forward = task_plan(plan, "fc2.linear2")
    (reduction,) = forward.reductions
    assert reduction.algorithm == "reduce_scatter"
    assert reduction.participants == (0, 1, 2, 3) and reduction.nbytes == 4 * 6 * 4
    cost = plan_cost(graph, plan, MACHINE).tasks[plan.tasks.index(forward)]
    # the ring: every rank sends p - 1 of the p shares: (4 - 1) × 96 bytes on the wire
    fetched = sum(t.nbytes * len(t.dsts) for t in forward.transfers)
    assert cost.bytes_sent == 3 * 96 + fetched


def test_a_row_parallel_linear_keeps_its_input_gradient_split_and_its_weight_gradient_local():
    """Column then row (Megatron): fc1 split over its outputs, fc2 over its inputs. The hidden
    activation never moves; fc2's backward fetches the output gradient whole (all-gather) and
    reduces into nothing another rank holds."""
    graph = mlp().lower(batch=4)
    plan = build_plan(graph, column_then_row(graph, 2), 2)
    verify_plan(graph, plan)
    backward = task_plan(plan, "fc2.linear2.grad")
    assert not backward.reductions and not [t for t in backward.transfers if t.reduce]
    assert {t.tensor for t in backward.transfers} == {"fc2.linear2.output.grad"}
    assert sum(t.nbytes for t in backward.transfers) == 2 * 2 * 6 * 4  # the other half's rows
    for name in ("act.filterNL", "act.filterNL.grad", "fc1.linear1.grad"):
        assert not task_plan(plan, name).transfers and not task_plan(plan, name).reductions
    # each rank holds its half of fc2's weights, and the update needs no all-reduce
    assert plan.homes["fc2.weights2"].volumes_by_rank() == {0: 18, 1: 18}


def test_the_partial_sums_of_an_input_channel_split_filter_by_hand():
    """A 3×3 convolution over 4 input channels into 2, 6×6, batch 2, split over its input
    channels on 2 ranks: each makes a partial sum of the whole (2, 2, 6, 6) output, 144 values,
    which lands split over the batch: each rank sends the other its 72, 288 bytes."""
    net = Network(
        "cin",
        (4, 6, 6),
        3,
        [Conv("c", out_channels=2, kernel=3, pad=1), Linear("fc", out=3), Softmax()],
    )
    graph = net.lower(batch=2)
    plan = build_plan(graph, strategy(graph, 2, c=(1, 1, 1, 1, 2)), 2)
    verify_plan(graph, plan)
    forward = task_plan(plan, "c.conv")
    partial = [t for t in forward.transfers if t.reduce]
    assert sorted((t.src, t.dsts, t.nbytes) for t in partial) == [(0, (1,), 288), (1, (0,), 288)]
    # the bias is read only by the piece that starts the sum (input channels from 0)
    pieces = {p.ranks[0]: {r.role: r for r in p.requirements} for p in forward.pieces}
    assert not pieces[0]["b"].read_rect.is_empty() and pieces[1]["b"].read_rect.is_empty()
    backward = task_plan(plan, "c.conv.grad")
    assert not backward.reductions  # each rank's weight gradient is its own channels'
    assert plan.homes["c.W"].volumes_by_rank() == {0: 2 * 2 * 9, 1: 2 * 2 * 9}


def test_verify_plan_rejects_a_plan_that_drops_a_partial_sum():
    graph = mlp().lower(batch=4)
    plan = build_plan(graph, strategy(graph, 2, **{"fc2.linear2": (1, 1, 1, 1, 2, 1, 1)}), 2)
    index = plan.tasks.index(task_plan(plan, "fc2.linear2"))
    kept = [t for t in plan.tasks[index].transfers if not (t.reduce and t.src == 1)]
    plan.tasks[index] = plan.tasks[index].with_transfers(kept)
    with pytest.raises(VerifyError, match="rank 1's partial sum .* never reaches rank 0"):
        verify_plan(graph, plan)


@pytest.mark.parametrize(
    "nranks, grids",
    [
        (2, {"L1": (1, 1, 1, 1, 2), "classifier.linear1": (1, 1, 1, 1, 2, 1, 1)}),
        (3, {"L1": (1, 1, 1, 1, 3), "classifier.linear1": (1, 1, 1, 1, 1, 1, 3)}),
        (4, {"L1": (1, 2, 1, 1, 2), "classifier.linear1": (1, 1, 1, 1, 2, 2, 1)}),
        (4, {"L1": (2, 1, 1, 1, 2), "classifier.linear1": (1, 2, 1, 1, 2, 1, 1)}),
    ],
    ids=["C2-C2", "C3-W3", "K2xC2-C2xH2", "N2xC2-M2xC2"],
)
def test_reduction_splits_of_the_seed_network_equal_one_process(nranks, grids):
    cfg = config(load_network("seed-lcn-small"))
    choose = lambda graph, n: strategy(graph, n, **grids)
    assert_same(local_run(cfg), ranks_run(cfg, nranks, choose))


def test_a_convolution_with_bias_split_over_input_channels_equals_one_process():
    cfg = config(load_network("three-layer-convnet"), batch=4)
    choose = lambda graph, n: strategy(graph, n, conv1=(1, 1, 1, 1, 3))
    assert_same(local_run(cfg), ranks_run(cfg, 3, choose))


def test_column_then_row_with_biases_equals_one_process():
    cfg = config(mlp(bias=True), batch=5)
    assert_same(local_run(cfg), ranks_run(cfg, 3, column_then_row))


def test_a_strategy_file_may_name_the_summed_dims_or_leave_them_out():
    graph = mlp().lower(batch=4)
    chosen = from_grids(
        graph,
        {
            "fc1": [1, 2, 1, 1],  # output dims alone: the sums stay whole
            "act": [1, 2, 1, 1],
            "fc2.linear2": [1, 1, 1, 1, 2, 1, 1],
            "fc2.softmax": [2, 1, 1, 1],
            "fc2.evaluate.accuracy": [1],  # one piece: as many as its extent allows
        },
        2,
    )
    assert chosen.unit_grids["fc1"] == (1, 2, 1, 1, 1, 1, 1)
    with pytest.raises(LegionNNError, match=r"has 5 dims; .* \(the first 4 its output's"):
        from_grids(graph, {**chosen.unit_grids, "fc1": [1, 2, 1, 1, 1]}, 2)


def test_grid_labels_show_the_summed_dims_where_they_are_cut():
    assert grid_label((1, 8, 1, 1, 1, 1, 1), 3) == "1×8×1×1"
    assert grid_label((2, 1, 1, 1, 4, 1, 1), 3) == "2×1×1×1 Σ4×1×1"
    assert grid_label((4, 1), 0) == "4×1"


def test_auto_finds_column_then_row_on_megatrons_mlp_at_half_the_bytes_of_model_parallelism():
    """The issue's MLP (4096 → 16384 → 4096, batch 64, 8 ranks): model/model gathers fc1's
    output for fc2 and reduce-scatters its gradient back, 60.6 MB a step; auto keeps the hidden
    activation where fc1 makes it."""
    graph = load_spec(ROOT / "examples" / "megatron-mlp.json").lower(batch=64)
    machine = Machine(100, 25, 2, 16)
    model = plan_cost(graph, build_plan(graph, builtin(graph, "model", 8), 8), machine)
    result = auto(graph, 8, machine)
    chosen = plan_cost(graph, build_plan(graph, result.strategy, 8), machine)
    assert chosen.bytes_sent <= model.bytes_sent / 2
    assert chosen.step_seconds <= model.step_seconds
    grids = result.strategy.unit_grids
    assert grids["fc2.linear2"][4:] != (1, 1, 1)  # fc2 is split over its inputs


def test_auto_with_reduction_splits_is_never_worse_on_the_seed_network_at_64_ranks():
    graph = load_network("seed-lcn").lower(batch=256)
    data = plan_cost(graph, build_plan(graph, builtin(graph, "data", 64), 64), MACHINE)
    old = [f for f in families.FAMILIES if "row" not in f]
    with mock.patch.object(families, "FAMILIES", tuple(old)):
        without = auto(graph, 64, MACHINE)
    with_rows = auto(graph, 64, MACHINE)
    before = plan_cost(graph, build_plan(graph, without.strategy, 64), MACHINE)
    after = plan_cost(graph, build_plan(graph, with_rows.strategy, 64), MACHINE)
    assert after.step_seconds <= before.step_seconds
    assert data.step_seconds / after.step_seconds >= 3.2


def test_the_example_mlp_spec_is_the_issues():
    spec = json.loads((ROOT / "examples" / "megatron-mlp.json").read_text())
    assert spec["input"] == [4096, 1, 1]
    assert [layer.get("out") for layer in spec["layers"][::2][:2]] == [16384, 4096]
    graph = load_spec(ROOT / "examples" / "megatron-mlp.json").lower(batch=2)
    assert np.prod(graph.tensors["fc1.weights1"].dims) == 4096 * 16384


def test_reduction_splits_are_seen_in_the_table_the_render_and_the_maps():
    from partitioner.report import report_json, table
    from visualize.partition_dot import partition_graphviz
    from visualize.partition_map import partition_maps

    graph = mlp().lower(batch=4)
    plan = build_plan(graph, column_then_row(graph, 2), 2)
    report = report_json(graph, plan, plan_cost(graph, plan, MACHINE), None)
    rows = {row["layer"]: row for row in report["layers"]}
    assert rows["fc2.linear2"]["grid"] == [1, 1, 1, 1, 2, 1, 1]
    assert rows["fc2.linear2"]["summed_dims"] == 3 and rows["act"]["summed_dims"] == 0
    assert "fc2.linear2                    1×1×1×1 Σ2×1×1" in table(report)
    assert "fc1                            1×2×1×1 " in table(report)  # its sums stay whole
    source = partition_graphviz(graph, plan, collapse="layer").source
    assert "grid 1×1×1×1 Σ2×1×1" in source and "reduce_scatter" not in source  # 2 ranks: p2p
    maps = {m.unit: m for m in partition_maps(graph, plan)}
    assert maps["fc2.linear2"].grid == "1×1×1×1 Σ2×1×1"
    # the output is owned where its sums land (split over the batch), the weights by input
    output = maps["fc2.linear2"].output[0]
    assert sorted(owners for _, owners in output.regions) == [(0,), (1,)]


def test_verify_plan_rejects_sums_that_land_twice():
    from dataclasses import replace

    from partitioner.task_plan import TaskPlan

    graph = mlp().lower(batch=4)
    plan = build_plan(graph, strategy(graph, 2, **{"fc2.linear2": (1, 1, 1, 1, 2, 1, 1)}), 2)
    index = plan.tasks.index(task_plan(plan, "fc2.linear2"))
    old = plan.tasks[index]
    (pieces,) = old.piece_sets
    (j, ranks, lo, hi) = pieces.sums[0]
    whole = (j, ranks, np.zeros_like(lo), np.tile(hi.max(axis=0), (len(hi), 1)))
    twice = replace(pieces, sums=(whole,))
    plan.tasks[index] = TaskPlan(
        old.task, old.unit, old.grid, [twice], old.transfer_set, old.reductions, old.holdings
    )
    with pytest.raises(VerifyError, match=r"the sums of fc2.linear2.output\): two pieces overlap"):
        verify_plan(graph, plan)
