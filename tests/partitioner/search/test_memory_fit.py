"""`auto` fitting a step in a rank's memory (`partitioner.search.memory_fit`): grids and homes."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from legion_nn.networks import load_network
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.resolve import resolve_strategy
from partitioner.search.memory_fit import NoFit, fit, least_step
from partitioner.strategy import builtin
from runtime.step.model import StepModel
from runtime.step.rank_memory import predict


@pytest.fixture(scope="module")
def graph():
    return load_network("seed-lcn").lower(batch=16, optimizer="adam")


def peak_of(graph, strategy, nranks, machine):
    plan = build_plan(graph, strategy, nranks)
    return max(m.peak for m in predict(graph, plan, machine).values())


def test_fit_shards_the_largest_parameters_until_data_parallelism_fits(graph):
    """seed-lcn at batch 16 on 4 data-parallel ranks needs 4.6 GiB per rank with replicated
    homes; in 3 GiB the two weight-sized parameters are sharded, the small ones are not."""
    machine = Machine(rank_memory_gib=3.0)
    data = builtin(graph, "data", 4)
    assert peak_of(graph, data, 4, machine) > 4 * 2**30
    fitted = fit(graph, 4, machine, [data], StepModel(machine).peak, time.monotonic() + 60)
    assert fitted.strategy.unit_grids == data.unit_grids
    assert fitted.strategy.sharded == {"L1.W", "classifier.weights1"}
    assert fitted.peak == peak_of(graph, fitted.strategy, 4, machine) <= machine.memory_bytes
    roomy = fit(graph, 4, replace(machine, rank_memory_gib=8.0), [data], StepModel(machine).peak, 0)
    assert roomy.strategy.sharded == frozenset()


def test_fit_takes_the_fastest_candidate_that_fits(graph):
    machine = Machine(rank_memory_gib=2.0)
    candidates = [builtin(graph, name, 4) for name in ("data", "model", "spatial")]
    fitted = fit(graph, 4, machine, candidates, StepModel(machine).peak, time.monotonic() + 60)
    assert fitted.peak <= machine.memory_bytes
    for other in candidates:
        if peak_of(graph, other, 4, machine) <= machine.memory_bytes:
            assert (
                fitted.seconds
                <= fit(graph, 4, machine, [other], StepModel(machine).peak, 0).seconds
            )


def test_nothing_fits_names_the_least_memory_any_tried_plan_needs(graph):
    machine = Machine(rank_memory_gib=0.5)
    candidates = [builtin(graph, name, 4) for name in ("data", "model", "spatial")]
    with pytest.raises(NoFit) as caught:
        fit(graph, 4, machine, candidates, StepModel(machine).peak, time.monotonic() + 60)
    message = str(caught.value)
    assert "\n" not in message
    assert "fits in 0.5 GiB per rank: the smallest tried needs" in message
    least = float(message.split("needs ")[1].split(" GiB")[0])
    model = peak_of(graph, builtin(graph, "model", 4), 4, machine) / 2**30
    assert least <= round(model, 2)


def test_auto_chooses_homes_only_where_memory_asks(graph):
    small = Machine(rank_memory_gib=2.0)
    strategy, why = resolve_strategy(graph, "auto", 4, small, 30.0, peak=StepModel(small).peak)
    assert peak_of(graph, strategy, 4, small) <= small.memory_bytes
    assert {row["layer"] for row in why} >= {"L0", "L1", "classifier.linear1"}
    assert all(set(row["sharded"]) <= strategy.sharded for row in why)
    fixed, _ = resolve_strategy(
        graph, "auto", 4, small, 30.0, None, "replicated", StepModel(small).peak
    )
    assert fixed.sharded == frozenset()


def test_the_searchs_bulk_seconds_are_the_plans():
    """What the DP knows of the built-ins and of its own grids is `plan_cost`'s step, so that
    `fit` can leave out what cannot be chosen without planning it."""
    from partitioner.cost import plan_cost
    from partitioner.search.auto import auto

    deep = load_network("deep-mlp").lower(batch=64)
    result = auto(deep, 8, Machine(), 30.0)
    assert set(result.bulk_seconds) == {"auto", "data", "model", "spatial"}
    for name, seconds in result.bulk_seconds.items():
        strategy = result.strategy if name == "auto" else builtin(deep, name, 8)
        planned = plan_cost(deep, build_plan(deep, strategy, 8), Machine()).step_seconds
        assert seconds == pytest.approx(planned, rel=1e-12), name


@pytest.mark.parametrize("memory_gib", [16.0, 0.2])  # the process baseline alone is 0.2 GiB
def test_fit_near_leaves_out_only_what_cannot_be_chosen(memory_gib, monkeypatch):
    """deep-mlp on 8 ranks: data and spatial parallelism sum more than twice auto's seconds, so
    `_fit_near` plans them only where nothing else fits; its choice is `fit`'s over them all."""
    from partitioner import resolve
    from partitioner.search import memory_fit
    from partitioner.search.auto import auto

    deep = load_network("deep-mlp").lower(batch=64)
    machine = Machine(rank_memory_gib=memory_gib)
    model = StepModel(machine)
    searched = auto(deep, 8, Machine(), 30.0)
    limit = resolve.STEP_WITHIN * searched.bulk_seconds["auto"]
    skipped = {f: s for f, s in searched.bulk_seconds.items() if f != "auto" and s > limit}
    assert set(skipped) == {"data", "spatial"}
    near = [searched.strategy, builtin(deep, "model", 8)]
    planned: list[str] = []

    def counting(graph, strategy, nranks, **kwargs):
        planned.append(strategy.name)
        return build_plan(graph, strategy, nranks, **kwargs)

    monkeypatch.setattr(memory_fit, "build_plan", counting)
    deadline = time.monotonic() + 60
    everything = [*near, *(builtin(deep, f, 8) for f in skipped)]
    try:
        expected = fit(deep, 8, machine, everything, model.peak, deadline, model.step)
    except NoFit:
        expected = None
    planned.clear()
    if expected is None:
        with pytest.raises(NoFit):
            resolve._fit_near(deep, 8, machine, near, skipped, model.peak, deadline, model.step)
        assert "data" in planned  # tried before giving up (spatial is the same grids here)
        return
    got = resolve._fit_near(deep, 8, machine, near, skipped, model.peak, deadline, model.step)
    assert got.strategy == expected.strategy and got.seconds == expected.seconds
    if memory_gib == 16.0:
        assert "data" not in planned and "spatial" not in planned


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    count=st.integers(1, 6),
)
def test_least_step_with_a_bound_picks_what_it_picks_without_and_steps_fewer(data, count):
    """Random sums, steps and bounds below the steps (some absent): the same index, ties to the
    earlier, and no plan stepped whose bound is above the least step found before it."""
    sums = data.draw(st.lists(st.floats(0.1, 10), min_size=count, max_size=count))
    steps = data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=count,
                               max_size=count))  # fmt: skip
    slack = data.draw(st.lists(st.sampled_from([None, 0.0, 0.5, 1.0]), min_size=count,
                               max_size=count))  # fmt: skip
    bounds = [None if s is None else max(step - s, 0.0) for step, s in zip(steps, slack)]
    stepped = []

    def step(i):
        stepped.append(i)
        return steps[i]

    plain = least_step(sums, steps.__getitem__)
    assert least_step(sums, step, bounds.__getitem__) == plain
    for k, i in enumerate(stepped[1:], 1):
        assert bounds[i] is None or bounds[i] <= min(steps[j] for j in stepped[:k])


def test_where_every_parameter_sharded_does_not_fit_no_fewer_are_tried(graph):
    machine = Machine(rank_memory_gib=0.5)
    model = StepModel(machine)
    tried = []

    def peak(g, plan):
        tried.append((plan.strategy, plan.sharded))
        return model.peak(g, plan)

    candidates = [builtin(graph, name, 4) for name in ("data", "model", "spatial")]
    with pytest.raises(NoFit):
        fit(graph, 4, machine, candidates, peak, time.monotonic() + 60)
    for name in ("data", "model", "spatial"):
        homes = [sharded for strategy, sharded in tried if strategy == name]
        assert len(homes) == 2 and homes[0] == frozenset() and homes[1]  # none, then every one


def test_out_of_time_fit_shards_every_parameter_where_that_fits(graph):
    """In 3 GiB data parallelism fits with two parameters sharded (found one at a time, above);
    with no time left, every parameter is sharded rather than none tried further."""
    machine = Machine(rank_memory_gib=3.0)
    data = builtin(graph, "data", 4)
    fitted = fit(graph, 4, machine, [data], StepModel(machine).peak, time.monotonic() - 1)
    assert fitted.peak <= machine.memory_bytes
    assert {"L1.W", "classifier.weights1"} < fitted.strategy.sharded
