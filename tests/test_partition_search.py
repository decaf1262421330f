"""`auto`: exact DP on chains (against brute force), local search elsewhere, and its time limit."""

from __future__ import annotations

from itertools import product

import pytest
from plan_cases import two_headed

from legion_nn.networks import load_network
from partitioner.cost import plan_cost
from partitioner.coupling import is_chain
from partitioner.machine import Machine
from partitioner.plan import build_plan, task_rows
from partitioner.search import FAMILIES, auto, family_grid
from partitioner.strategy import Strategy, builtin, find_units
from partitioner.verify_plan import verify_plan

MACHINE = Machine(100, 12.5, 2, 16)


def step(graph, strategy, nranks: int, machine: Machine = MACHINE):
    return plan_cost(graph, build_plan(graph, strategy, nranks), machine)


def best_pure(graph, nranks: int) -> float:
    return min(
        step(graph, builtin(graph, name, nranks), nranks).step_seconds
        for name in ("data", "model", "spatial")
    )


def chain(graph) -> bool:
    return is_chain(graph, find_units(graph), task_rows(graph))


def test_builtin_networks_are_chains_and_a_two_headed_one_is_not():
    for name in ("seed-lcn", "three-layer-convnet", "vgg19"):
        assert chain(load_network(name).lower(batch=8)), name
    assert not chain(two_headed())


def test_dp_on_a_chain_finds_the_best_assignment_of_families():
    graph = load_network("seed-lcn-small").lower(batch=8)
    units = find_units(graph)
    result = auto(graph, 4, MACHINE)
    assert result.note == "exact DP over all family pairs"
    options = [sorted({family_grid(u, f, 4) for f in FAMILIES}) for u in units]
    brute = min(
        step(graph, Strategy("all", dict(zip([u.name for u in units], grids))), 4).step_seconds
        for grids in product(*options)
    )
    assert step(graph, result.strategy, 4).step_seconds == pytest.approx(brute, rel=1e-9)


def test_local_search_on_a_branching_network_beats_every_pure_strategy():
    graph = two_headed(batch=8)
    result = auto(graph, 8, MACHINE)
    assert result.note.startswith("not a chain: local search converged")
    assert result.plans_priced > len(FAMILIES)  # it tried changing single units
    cost = step(graph, result.strategy, 8)
    assert cost.step_seconds <= best_pure(graph, 8) + 1e-12
    assert sum(c.seconds for c in result.choices) == pytest.approx(
        sum(cost.unit_seconds()[c.unit] for c in result.choices)
    )
    verify_plan(graph, build_plan(graph, result.strategy, 8))


@pytest.mark.parametrize("graph", [two_headed(batch=8), load_network("seed-lcn-small").lower(8)])
def test_a_spent_time_limit_still_prices_the_builtins_and_returns_the_best(graph):
    result = auto(graph, 8, MACHINE, time_limit=0.0)
    assert result.note.startswith("time limit")
    assert result.plans_priced == 3  # data, model and spatial, then it stops
    assert step(graph, result.strategy, 8).step_seconds == pytest.approx(best_pure(graph, 8))


def test_local_search_keeps_plans_that_fit_in_memory():
    graph = two_headed(batch=8)
    sizes = [step(graph, builtin(graph, n, 8), 8).memory_max for n in ("data", "model", "spatial")]
    tight = Machine(100, 12.5, 2, (sorted(sizes)[1] + 1) / 2**30)
    result = auto(graph, 8, tight)
    assert step(graph, result.strategy, 8, tight).feasible
