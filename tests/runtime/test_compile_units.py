"""The units a run compiles before its first step: which a graph and a rank's program need, and
that each compiles its kernels into Numba's cache."""

import numpy as np
import pytest

from legion_nn.networks import load_network
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.compile_units import UNITS, cached, units_of, warm
from runtime.step.programs import build_programs


def graph_of(name: str, optimizer: str = "adam"):
    return load_network(name).lower(batch=4, dtype="float32", optimizer=optimizer)


def test_a_graph_needs_the_units_of_its_ops_and_optimizer():
    assert units_of(graph_of("seed-lcn-small")) == [
        "filter.untied",
        "filter.untied.gradient",
        "filter.step",
        "filterA",
        "filterNL",
        "linear",
        "linear.step",
        "softmax",
        "update",
        "update.parallel",
        "denormals",
    ]
    assert units_of(graph_of("three-layer-convnet", "sgd")) == [
        "filter.tied",
        "filter.tied.gradient",
        "filterNL",
        "linear",
        "linear.step",
        "softmax",
        "maxpool",
        "update",
        "update.parallel",
        "denormals",
    ]


@pytest.mark.parametrize(
    "strategy, nranks, stepped",
    [("data", 1, True), ("data", 2, False)],
)
def test_a_rank_compiles_the_weight_gradient_kernels_its_program_calls(strategy, nranks, stepped):
    """Where the program fuses the updates into the gradients' kernels, those kernels step the
    weights and none stores a weight gradient; where the gradients are summed across ranks
    (data parallel), they are stored and updated after."""
    graph = graph_of("seed-lcn-small")
    plan = build_plan(graph, builtin(graph, strategy, nranks), nranks)
    program = build_programs(graph, plan, Machine(), [0])[0]
    units = set(units_of(graph, program))
    assert (
        {"filter.step", "linear.step"} <= units
        if stepped
        else not units & {"filter.step", "linear.step"}
    )
    assert ("filter.untied.gradient" in units) is not stepped
    # L1.W's update runs as a task of its own, on a parallel loop, only where it is not fused
    assert ("update.parallel" in units) is not stepped
    assert {"filter.untied", "linear", "update"} <= units


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_unit_runs_its_kernels(dtype):
    warm(list(UNITS), dtype)
    assert cached(list(UNITS), dtype)


KERNELS = """
import numba

@numba.njit(cache=True)
def scaled(x, stats):
    return x[0] * stats[0]

@numba.njit(cache=True)
def counted(n):
    return n + 1
"""


def test_the_cache_is_asked_for_the_dtype_of_the_data(tmp_path, monkeypatch):
    """A kernel cached for float32 data (with float64 statistics beside it, as batch
    normalisation's) is not cached for float64 data, and a kernel of no floating type is every
    dtype's: a run in float64 after one in float32 compiles its kernels ahead again
    (`compile_ahead`), where it had found them all cached and compiled each at its first
    call."""
    import importlib

    from runtime.compile_units import in_cache

    (tmp_path / "cached_kernels.py").write_text(KERNELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    kernels = importlib.import_module("cached_kernels")
    stats = np.ones(2)
    assert not in_cache(kernels.scaled, "float32")
    kernels.scaled(np.ones(2, np.float32), stats)
    assert in_cache(kernels.scaled, "float32")
    assert not in_cache(kernels.scaled, "float64")
    kernels.scaled(np.ones(2), stats)
    assert in_cache(kernels.scaled, "float64")
    kernels.counted(3)
    assert in_cache(kernels.counted, "float32") and in_cache(kernels.counted, "float64")
