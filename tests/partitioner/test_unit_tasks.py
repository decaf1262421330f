"""Every task a layer lowers to runs on its unit's grid: none left to run whole on one rank."""

from __future__ import annotations

from math import prod

import pytest

from legion_nn.networks import load_network
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin, find_units, is_homed, task_grids
from tests.runtime.test_executor import MIXED, RESIDUAL

NETWORKS = {
    "mixed": MIXED,  # BatchNorm over channels and over features
    "residual": RESIDUAL,  # BatchNorm inside a residual block
    "seed-lcn-small": load_network("seed-lcn-small"),
    "byte-gpt": load_network("byte-gpt"),
}


@pytest.mark.parametrize("name", NETWORKS)
def test_every_backward_task_belongs_to_a_unit_and_splits_with_its_batch(name):
    graph = NETWORKS[name].lower(batch=8)
    in_units = {n for unit in find_units(graph) for n in (*unit.forward, *unit.backward)}
    backward = [t for t in graph.tasks if t.phase == "backward" and not is_homed(graph, t)]
    assert backward and {t.name for t in backward} <= in_units
    grids = task_grids(graph, builtin(graph, "data", 4).unit_grids)
    assert all(prod(grids[t.name]) == 4 for t in backward)


def test_batchnorms_input_gradient_moves_no_activation_under_data_parallelism():
    """Data parallelism moves only the weights' and BatchNorm's gradient sums, whatever the batch:
    the input gradient was computed whole on rank 0, its operands gathered there."""
    sums = []
    for batch in (8, 64):
        graph = MIXED.lower(batch=batch)
        plan = build_plan(graph, builtin(graph, "data", 4), 4)
        sums.append(plan_cost(graph, plan, Machine()).bytes_sent)
        gradients = 2 * sum(t.nbytes for t in graph.tensors.values() if t.kind == "param")
        assert 0 < sums[-1] <= 2 * (4 - 1) * gradients  # a ring all-reduce of each, at most
    assert sums[0] == sums[1]  # (gathering the input gradient's operands: 57.8 and 212.6 kB)
