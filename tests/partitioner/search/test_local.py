"""The local search where the DP cannot tabulate: assignments priced by rows equal whole plans."""

from __future__ import annotations

import random

import pytest

from partitioner.machine import Machine
from partitioner.search import frontier_dp
from partitioner.search.auto import auto
from partitioner.search.families import FAMILIES
from partitioner.search.local import PlanPricer, RowPricer, local_search
from partitioner.search.transitions import UnitPricer
from partitioner.strategy import builtin, find_units
from tests.partitioner.search.test_auto import MACHINE, buffers_within, step
from tests.plan_cases import two_headed

GRAPH = two_headed(batch=8)
UNITS = find_units(GRAPH)


def pricers(nranks: int, machine: Machine) -> tuple[PlanPricer, RowPricer]:
    return (
        PlanPricer(GRAPH, UNITS, nranks, machine),
        RowPricer(UnitPricer(GRAPH, UNITS, nranks, machine)),
    )


def tight_machine(nranks: int) -> Machine:
    """Room for the second smallest built-in plan, not the largest."""
    sizes = sorted(
        step(GRAPH, builtin(GRAPH, n, nranks), nranks).memory_max
        for n in ("data", "model", "spatial")
    )
    return buffers_within(sizes[1] + 1)


@pytest.mark.parametrize("nranks", [4, 8])
@pytest.mark.parametrize("tight", [False, True])
def test_rows_price_every_assignment_as_its_whole_plan(nranks, tight):
    machine = tight_machine(nranks) if tight else MACHINE
    plans, rows = pricers(nranks, machine)
    draw = random.Random(nranks)
    assignments = [[f] * len(UNITS) for f in FAMILIES]
    assignments += [[draw.choice(FAMILIES) for _ in UNITS] for _ in range(12)]
    feasible = set()
    for chosen in assignments:
        whole, summed = plans.price(chosen), rows.price(chosen)
        assert summed.step_seconds == pytest.approx(whole.step_seconds, rel=1e-12)
        assert summed.feasible == whole.feasible
        for unit in UNITS:
            assert summed.unit_seconds[unit.name] == pytest.approx(
                whole.unit_seconds.get(unit.name, 0.0), rel=1e-12, abs=1e-15
            )
        feasible.add(whole.feasible)
    if tight:
        assert feasible == {True, False}  # the case tells fitting from not
    assert rows.met_memory_limit == (False in feasible)


@pytest.mark.parametrize("nranks", [4, 8])
def test_the_search_by_rows_goes_where_the_search_by_whole_plans_goes(nranks):
    plans, rows = pricers(nranks, MACHINE)
    by_plans, by_rows = local_search(plans, float("inf")), local_search(rows, float("inf"))
    assert by_rows[0] == by_plans[0]
    # a change of one unit's family prices the rows that depend on it, not every row again
    assert rows.rows_priced < rows.priced * len(UNITS)


def test_auto_beyond_the_frontier_limit_searches_by_rows_and_says_what_memory_did(monkeypatch):
    monkeypatch.setattr(frontier_dp, "FRONTIER_LIMIT", 1)
    roomy = auto(GRAPH, 8, MACHINE)
    assert roomy.note.startswith("not a chain: local search converged")
    assert roomy.transitions_priced > 0 and roomy.memory_aside and not roomy.fastest
    assert roomy.bulk_seconds["auto"] == pytest.approx(
        step(GRAPH, roomy.strategy, 8).step_seconds, rel=1e-12
    )
    tight = auto(GRAPH, 8, tight_machine(8))
    assert not tight.memory_aside  # it priced plans too large: memory steered it
    assert step(GRAPH, tight.strategy, 8, tight_machine(8)).feasible


def test_a_search_that_met_the_memory_limit_repeats_itself_on_its_rows_without_one(monkeypatch):
    monkeypatch.setattr(frontier_dp, "FRONTIER_LIMIT", 1)
    data = step(GRAPH, builtin(GRAPH, "data", 8), 8)  # the fastest plan, and the smallest
    small = buffers_within(0.95 * data.memory_max)
    tight = auto(GRAPH, 8, small)
    roomy = auto(GRAPH, 8, Machine(100, 12.5, 2, float("inf")))
    assert step(GRAPH, tight.strategy, 8, small).feasible
    assert tight.strategy.unit_grids != roomy.strategy.unit_grids  # memory steered it
    assert tight.unlimited is not None and tight.unlimited.memory_aside
    assert tight.unlimited.strategy.unit_grids == roomy.strategy.unit_grids
    assert tight.unlimited.bulk_seconds == pytest.approx(roomy.bulk_seconds, rel=1e-12)
    assert auto(GRAPH, 8, MACHINE).unlimited is None  # it met no limit: nothing to repeat
