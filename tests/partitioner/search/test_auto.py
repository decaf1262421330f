"""`auto`: exact DP on chains (against brute force), its unit transitions priced exactly as whole
plans price them, local search elsewhere, and its time limit."""

from __future__ import annotations

from itertools import product
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from legion_nn.networks import load_network
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import build_plan, task_rows
from partitioner.search import frontier_dp
from partitioner.search.auto import auto
from partitioner.search.coupling import is_chain
from partitioner.search.families import FAMILIES, family_grid, grid_options
from partitioner.search.frontier_dp import FrontierDP
from partitioner.search.local import RowPricer
from partitioner.search.transitions import UnitPricer
from partitioner.strategy import Strategy, builtin, find_units
from partitioner.verify_plan import verify_plan
from tests.plan_cases import networks, strategies, two_headed

MACHINE = Machine(100, 12.5, 2, 16)
#: a machine that also prices memory traffic and a per-task overhead (the roofline terms)
ROOFLINE = Machine(100, 12.5, 2, 16, memory_gbytes_per_s=20, task_overhead_us=10)


def buffers_within(nbytes: float) -> Machine:
    """`MACHINE` with room for `nbytes` of a rank's buffers beside its process's own."""
    return Machine(100, 12.5, 2, (nbytes + MACHINE.process_baseline_bytes) / 2**30)


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


def test_dp_on_a_branching_network_prices_its_choice_exactly_and_beats_every_pure_strategy():
    graph = two_headed(batch=8)
    result = auto(graph, 8, MACHINE)
    assert result.note == "exact DP over the rows' dependencies"
    cost = step(graph, result.strategy, 8)
    assert cost.step_seconds <= best_pure(graph, 8) + 1e-12
    whole = cost.unit_seconds()
    assert [c.seconds for c in result.choices] == [whole.get(c.unit, 0.0) for c in result.choices]
    verify_plan(graph, build_plan(graph, result.strategy, 8))


def test_local_search_on_a_branching_network_beats_every_pure_strategy(monkeypatch):
    """Where the DP's table would be too wide, `auto` searches over whole plans instead."""
    monkeypatch.setattr(frontier_dp, "FRONTIER_LIMIT", 1)
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


def _local_searches(graph, nranks: int, machine: Machine):
    """`auto` by the local search over rows (the DP's table made too wide), with the changes
    its rows' bounds rule out skipped, and without."""
    with mock.patch.object(frontier_dp, "FRONTIER_LIMIT", 1):
        pruned = auto(graph, nranks, machine)
        with mock.patch.object(RowPricer, "cannot_improve", lambda *args: False):
            full = auto(graph, nranks, machine)
    assert pruned.note.startswith("not a chain: local search")
    return pruned, full


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graph=networks(branching=True),
    nranks=st.sampled_from([2, 4, 6]),
    machine=st.sampled_from([MACHINE, ROOFLINE]),
)
def test_the_local_search_skips_the_changes_bounds_rule_out_and_goes_the_same_way(
    graph, nranks, machine
):
    """A change whose rows' bounds already add up to more than the rows it replaces is not
    priced (`RowPricer.cannot_improve`): the search chooses the same grids, pricing no more."""
    pruned, full = _local_searches(graph, nranks, machine)
    assert pruned.strategy.unit_grids == full.strategy.unit_grids
    assert pruned.transitions_priced <= full.transitions_priced


def test_the_local_search_prices_fewer_rows_where_bounds_rule_changes_out():
    pruned, full = _local_searches(two_headed(batch=8), 8, MACHINE)
    assert pruned.strategy.unit_grids == full.strategy.unit_grids
    assert pruned.transitions_priced < full.transitions_priced


@pytest.mark.parametrize("graph", [two_headed(batch=8), load_network("seed-lcn-small").lower(8)])
def test_a_spent_time_limit_still_prices_the_builtins_and_returns_the_best(graph):
    result = auto(graph, 8, MACHINE, time_limit=0.0)
    assert result.note.startswith("time limit")
    if chain(graph):  # the DP prices the builtins' transitions, unit by unit, then it stops
        units = find_units(graph)
        builtins = {
            (i, family_grid(units[i - 1], f, 8) if i else None, family_grid(u, f, 8))
            for f in ("data", "model", "spatial")
            for i, u in enumerate(units)
        }
        assert result.transitions_priced == len(builtins)
    else:  # the DP prices the builtins' rows, then it stops
        assert result.transitions_priced > 0 and result.plans_priced == 0
    assert step(graph, result.strategy, 8).step_seconds == pytest.approx(best_pure(graph, 8))
    # it fits: no search with memory unlimited can find faster grids in the same time
    assert result.fastest


def test_local_search_keeps_plans_that_fit_in_memory():
    graph = two_headed(batch=8)
    sizes = [step(graph, builtin(graph, n, 8), 8).memory_max for n in ("data", "model", "spatial")]
    tight = buffers_within(sorted(sizes)[1] + 1)
    result = auto(graph, 8, tight)
    assert step(graph, result.strategy, 8, tight).feasible


def rows_by_transitions(graph, strategy, nranks: int, machine: Machine = MACHINE):
    """(seconds per unit, memory per rank) of `strategy` from `UnitPricer`'s rows: on a chain
    its transitions, elsewhere each row given the grids of the units it depends on."""
    units = find_units(graph)
    pricer = UnitPricer(graph, units, nranks, machine)
    grids = [strategy.unit_grids[u.name] for u in units]
    memory = pricer.constant().memory.copy()
    seconds = {}
    for i, unit in enumerate(units):
        if pricer.deps[i] == ((i - 1,) if i else ()):
            row = pricer.transition(i, grids[i - 1] if i else None, grids[i])
        else:
            row = pricer.factor(i, {j: grids[j] for j in (*pricer.deps[i], i)})
        seconds[unit.name] = row.seconds
        memory += row.memory
    return seconds, memory


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graph=networks(merges=False),  # the transitions are a chain's
    nranks=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 11, 13]),
    machine=st.sampled_from([MACHINE, ROOFLINE]),
    data=st.data(),
)
def test_transitions_price_each_row_exactly_as_the_whole_plan(graph, nranks, machine, data):
    strategy = data.draw(strategies(graph, nranks))
    cost = plan_cost(graph, build_plan(graph, strategy, nranks), machine)
    seconds, memory = rows_by_transitions(graph, strategy, nranks, machine)
    whole = cost.unit_seconds()
    assert seconds == {name: whole.get(name, 0.0) for name in seconds}  # float for float
    assert memory.tolist() == list(cost.memory.values())


@pytest.mark.parametrize(
    ("network", "batch", "nranks", "machine"),
    [
        ("seed-lcn", 256, 64, MACHINE),
        ("seed-lcn", 16, 13, ROOFLINE),
        ("three-layer-convnet", 8, 7, ROOFLINE),
        ("vgg19", 4, 31, MACHINE),
        ("vgg19", 4, 8, ROOFLINE),
    ],
)
def test_transitions_price_the_builtin_networks_exactly(network, batch, nranks, machine):
    graph = load_network(network).lower(batch=batch)
    units = find_units(graph)
    rng = np.random.default_rng(nranks)
    for _ in range(2):
        families = [FAMILIES[k] for k in rng.integers(len(FAMILIES), size=len(units))]
        strategy = Strategy(
            "mixed", {u.name: family_grid(u, f, nranks) for u, f in zip(units, families)}
        )
        cost = plan_cost(graph, build_plan(graph, strategy, nranks), machine)
        seconds, memory = rows_by_transitions(graph, strategy, nranks, machine)
        assert seconds == {u.name: cost.unit_seconds()[u.name] for u in units}
        assert memory.tolist() == list(cost.memory.values())


def test_the_chosen_rows_are_what_the_plan_costs_and_fit_in_memory():
    graph = load_network("seed-lcn").lower(batch=256)
    result = auto(graph, 64, MACHINE)
    cost = plan_cost(graph, build_plan(graph, result.strategy, 64), MACHINE)
    rows = cost.unit_seconds()
    assert [c.seconds for c in result.choices] == [rows[c.unit] for c in result.choices]
    data = plan_cost(graph, build_plan(graph, builtin(graph, "data", 64), 64), MACHINE)
    data_rows = data.unit_seconds()
    assert [c.data_seconds for c in result.choices] == [data_rows[c.unit] for c in result.choices]
    assert cost.feasible


@pytest.mark.parametrize(
    "graph",
    # at batch 8 the dag's fastest assignment is data parallelism, the least memory of all
    [load_network("seed-lcn-small").lower(batch=2), two_headed(batch=4)],
    ids=["chain", "dag"],
)
def test_the_dp_keeps_to_assignments_that_fit_in_memory(graph):
    """Where the fastest assignment does not fit, the DP trades seconds for memory: what it
    returns fits, and is no slower than any built-in family that does."""
    fastest = step(graph, auto(graph, 8, MACHINE).strategy, 8)
    pure = [step(graph, builtin(graph, n, 8), 8) for n in ("data", "model", "spatial")]
    fitting = [c for c in pure if c.memory_max < fastest.memory_max]
    assert fitting  # the fastest assignment needs more memory than some pure strategy
    tight = buffers_within(fastest.memory_max - 1)
    cost = step(graph, auto(graph, 8, tight).strategy, 8, tight)
    assert cost.feasible
    assert fastest.step_seconds <= cost.step_seconds <= min(c.step_seconds for c in fitting)


def test_the_plan_of_autos_grids_takes_the_pieces_its_search_found(monkeypatch):
    """The search keeps the pieces of the grids it chose for the graph's plans
    (`pieces.graph_pieces`): planning them finds no piece anew. The strategy itself is plain
    data (it pickles whole), and another graph of the same network plans with its own pieces."""
    import pickle

    from partitioner import pieces

    graph = load_network("seed-lcn-small").lower(batch=8)
    strategy = auto(graph, 4, MACHINE).strategy

    def found_anew(*args, **kwargs):
        raise AssertionError("a piece of auto's grids found again")

    with monkeypatch.context() as patched:
        patched.setattr(pieces, "grid_pieces", found_anew)
        plan = build_plan(graph, strategy, 4)
    verify_plan(graph, plan)
    copy = pickle.loads(pickle.dumps(strategy))
    assert copy == strategy and vars(copy) == vars(strategy)
    other = load_network("seed-lcn-small").lower(batch=8)  # another graph: its own pieces
    verify_plan(other, build_plan(other, strategy, 4))


def test_busy_seconds_equal_one_collective_at_a_time():
    """Disjoint groups (one running sum each) and overlapping ones (summed pair by pair)."""
    from partitioner.cost import busy_seconds

    rng = np.random.default_rng(3)
    overlapping = 0
    for _ in range(200):
        n = int(rng.integers(1, 40))
        ranks = rng.permutation(n)
        cut = np.sort(rng.integers(0, n + 1, size=3))
        groups = [g for g in np.split(ranks, cut) if len(g)]
        if rng.random() < 0.5:  # groups sharing ranks: a collective's extra participants
            groups.append(np.sort(rng.permutation(n)[: int(rng.integers(1, n + 1))]))
        count = int(rng.integers(0, 30))
        group = rng.integers(0, len(groups), count)
        seconds = rng.random(count) * 10.0 ** rng.integers(-6, 1, count)
        expected = np.zeros(n)
        for g, s in zip(group, seconds):
            expected[groups[g]] += s
        used = np.concatenate([groups[g] for g in set(group.tolist())] or [np.zeros(0, int)])
        overlapping += len(np.unique(used)) < len(used)
        assert busy_seconds(groups, group, seconds, n).tolist() == expected.tolist()
    assert overlapping > 20


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graph=networks(merges=False),  # the transitions are a chain's
    nranks=st.sampled_from([2, 3, 4, 6, 7, 8, 13]),
    machine=st.sampled_from([MACHINE, ROOFLINE]),
)
def test_bounds_are_below_every_transition_and_the_lazy_dp_is_exact(graph, nranks, machine):
    units = find_units(graph)
    pricer = UnitPricer(graph, units, nranks, machine)
    options = [sorted({family_grid(u, f, nranks) for f in FAMILIES}) for u in units]
    rows = {}
    for i, grids in enumerate(options):
        for q in grids:
            bound = pricer.bound(i, q)
            for p in options[i - 1] if i else [None]:
                rows[(i, p, q)] = pricer.transition(i, p, q).seconds
                assert bound <= rows[(i, p, q)]
    best = {q: rows[(0, None, q)] for q in options[0]}
    for i in range(1, len(units)):
        best = {q: min(c + rows[(i, p, q)] for p, c in best.items()) for q in options[i]}
    result = auto(graph, nranks, machine)
    assert result.note == "exact DP over all family pairs"
    assert sum(c.seconds for c in result.choices) == pytest.approx(min(best.values()), rel=1e-12)


@pytest.mark.parametrize("network, nranks", [("seed-lcn-small", 8), ("deep-mlp", 4)])
def test_a_bound_counts_the_least_fetch_of_its_input_over_the_predecessors_grids(
    network, nranks, monkeypatch
):
    """A row's bound counts its input's fetch at the least, per rank, over every grid the
    search offers the predecessor: at least the bound that drops it, below the row after each
    of those grids, and above it where every grid of the predecessor leaves something to fetch
    (the built-in networks' rows after a differently split layer)."""
    graph = load_network(network).lower(batch=16)
    units = find_units(graph)
    options = [sorted({family_grid(u, f, nranks) for f in FAMILIES}) for u in units]
    tight = UnitPricer(graph, units, nranks, MACHINE)
    loose = UnitPricer(graph, units, nranks, MACHINE)
    monkeypatch.setattr(loose, "_least_fetch", lambda *args: None)  # the fetch dropped
    raised = 0
    for i in range(1, len(units)):
        for q in options[i]:
            bound, dropped = tight.bound(i, q), loose.bound(i, q)
            least = min(tight.transition(i, p, q).seconds for p in options[i - 1])
            assert dropped <= bound <= least
            raised += bound > dropped
    assert raised


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graph=networks(branching=True),
    nranks=st.sampled_from([2, 3, 4, 6]),
    machine=st.sampled_from([MACHINE, ROOFLINE]),
)
def test_partial_bounds_are_below_every_factor_and_the_lazy_dag_dp_is_exact(graph, nranks, machine):
    """Every factor of a branching network priced: each row's bound, with its dependencies all
    hidden or one of them known, is below the row under every assignment of their grids, and the
    lazy DP, which prices only what those bounds leave open, finds the least sum of them all."""
    assume(not chain(graph))
    units = find_units(graph)
    pricer = UnitPricer(graph, units, nranks, machine)
    _, options = grid_options(units, nranks)
    grids = [list(found) for found in options]
    scopes = [tuple(sorted((*pricer.deps[i], i))) for i in range(len(units))]
    factors = []
    for i, scope in enumerate(scopes):
        factor = np.empty([len(grids[j]) for j in scope])
        for cell in product(*(range(len(grids[j])) for j in scope)):
            assignment = {j: grids[j][k] for j, k in zip(scope, cell)}
            factor[cell] = seconds = pricer.factor(i, assignment).seconds
            assert pricer.bound(i, assignment[i]) <= seconds
            for j in pricer.deps[i]:
                assert pricer.bound(i, assignment[i], {j: assignment[j]}) <= seconds
        factors.append(factor)
    best = FrontierDP(scopes, [len(found) for found in grids]).solve(factors)
    least = sum(f[tuple(best[j] for j in scope)] for f, scope in zip(factors, scopes))
    result = auto(graph, nranks, machine)
    assert result.note == "exact DP over the rows' dependencies"
    assert sum(c.seconds for c in result.choices) == pytest.approx(least, rel=1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graph=networks(),
    nranks=st.sampled_from([1, 2, 3, 4, 6, 8]),
    machine=st.sampled_from([MACHINE, ROOFLINE]),
    data=st.data(),
)
def test_factors_price_each_row_of_a_branching_network_as_the_whole_plan(
    graph, nranks, machine, data
):
    """With an add or a concat merging a branch, each row given the grids of the units it
    depends on costs what the whole plan says, float for float, and the memory terms add up."""
    strategy = data.draw(strategies(graph, nranks))
    cost = plan_cost(graph, build_plan(graph, strategy, nranks), machine)
    seconds, memory = rows_by_transitions(graph, strategy, nranks, machine)
    whole = cost.unit_seconds()
    assert seconds == {name: whole.get(name, 0.0) for name in seconds}
    assert memory.tolist() == list(cost.memory.values())


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_frontier_dp_finds_the_least_sum_of_its_factors(data):
    """Against every assignment: random scopes (a unit depending on earlier or later ones) and
    random factor values, some infinite."""
    n = data.draw(st.integers(1, 5))
    sizes = [data.draw(st.integers(1, 3)) for _ in range(n)]
    scopes = []
    for i in range(n):
        others = data.draw(st.sets(st.integers(0, n - 1), max_size=2))
        scopes.append(tuple(sorted(others | {i})))
    values = st.one_of(st.floats(0, 10), st.just(float("inf")))
    factors = [
        np.array(
            data.draw(st.lists(values, min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
        ).reshape(shape)
        for shape in ([sizes[j] for j in scope] for scope in scopes)
    ]

    def total(assignment):
        return sum(f[tuple(assignment[j] for j in scope)] for f, scope in zip(factors, scopes))

    best = min(total(a) for a in product(*(range(k) for k in sizes)))
    found = FrontierDP(scopes, sizes).solve(factors)
    if best == float("inf"):
        assert found is None
    else:
        assert total(found) == best
