"""`auto` fitting a step in a rank's memory (`partitioner.memory_fit`): grids and homes."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from legion_nn.networks import load_network
from partitioner.machine import Machine
from partitioner.memory_fit import NoFit, fit
from partitioner.plan import build_plan
from partitioner.resolve import resolve_strategy
from partitioner.strategy import builtin
from runtime.step_memory import predict
from runtime.step_model import StepModel


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
