"""Compiling a run's kernels ahead: which units a graph needs, how they are shared among
processes, and that a run after them compiles nothing (on an empty Numba cache)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from legion_nn.networks import load_network
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.compile_ahead import (
    GEMM_GROUPS,
    GEMM_SECONDS,
    STEP_GROUPS,
    UNITS,
    WAIT,
    Helpers,
    assign,
    cached,
    units_of,
    warm,
)
from runtime.step.programs import build_programs
from tests.paths import ROOT


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


@pytest.mark.parametrize("processes", [1, 2, 3, 5])
def test_every_unit_goes_to_one_process_and_a_group_stays_together(processes):
    units = list(UNITS)
    shares = assign(units, processes)
    assert len(shares) == processes
    assert sorted(u for share in shares for u in share) == sorted(units)
    owner = {u: i for i, share in enumerate(shares) for u in share}
    groups = {UNITS[u].group for u in units}
    weight = {g: sum(UNITS[u].weight() for u in units if UNITS[u].group == g) for g in groups}
    for group in groups:  # together
        assert len({owner[u] for u in units if UNITS[u].group == group}) == 1, group
    first = max(groups, key=weight.__getitem__)
    assert {owner[u] for u in units if UNITS[u].group == first} == {0}  # the heaviest, first
    loads = [sum(UNITS[u].weight() for u in share) for share in shares]
    # longest-first greedy: no process is more than its heaviest unit above the lightest
    heaviest = max(weight.values())
    assert max(loads) - min(loads) <= heaviest + GEMM_SECONDS


@pytest.mark.parametrize("processes", [2, 3])
@pytest.mark.parametrize("late", [0.0, 1.0])
def test_one_process_compiles_the_gemm_first_and_the_others_reach_it_last(processes, late):
    """The default job's units on its two ranks (and with a helper): the process holding the
    first GEMM callers starts with them; every other process's callers come after the rest of
    its share, so the GEMM is in the cache when it gets there."""
    units = ["filter.untied", "filter.untied.gradient", "filterA", "filterNL", "linear",
             "softmax", "update", "update.parallel"]  # fmt: skip
    shares = assign(units, processes, late)
    calls = [[UNITS[u].group in GEMM_GROUPS for u in share] for share in shares]
    first = [i for i, share in enumerate(calls) if share and share[0]]
    assert len(first) == 1
    for i, share in enumerate(calls):
        if i != first[0] and any(share):
            assert share == sorted(share), shares  # the rest, then the GEMM's callers
        steps = [UNITS[u].group in STEP_GROUPS for u in shares[i]]
        if i != first[0] and any(steps):  # the optimizer's step first, which the callers call
            assert steps == sorted(steps, reverse=True), shares
    gemm = [u for u in units if UNITS[u].group in GEMM_GROUPS]
    heaviest = max(gemm, key=lambda u: sum(
        UNITS[v].weight() for v in gemm if UNITS[v].group == UNITS[u].group))  # fmt: skip
    assert heaviest in shares[first[0]]  # the group that took the GEMM's compile with it


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_unit_runs_its_kernels(dtype):
    warm(list(UNITS), dtype)
    assert cached(list(UNITS), dtype)


@pytest.mark.parametrize(("before", "begun"), [([], True), (["filter.untied"], False)])
def test_a_run_after_compiling_ahead_with_a_helper_compiles_nothing(tmp_path, before, begun):
    """On an empty cache, with a helper begun before the units are known (`Helpers`), or on one
    holding the main process's share (`before`), with a helper started for the rest: the main
    process and the helper compile the default network's units between them; training then
    compiles no kernel, and no helper is left running."""
    script = textwrap.dedent(
        f"""
        import os
        import numba
        from numba.core import event
        from cli.main import main
        from legion_nn.networks import load_network
        from runtime.compile_ahead import Helpers, cached, compile_ahead, units_of, warm

        graph = load_network("seed-lcn-small").lower(batch=8, dtype="float32", optimizer="adam")
        units = units_of(graph)
        numba.set_num_threads(1)  # the plain loops, which a run of two steps chooses
        warm({before!r}, "float32")
        assert not cached(units, "float32")
        if {begun!r}:
            assert Helpers.worth_starting("float32")  # the cache is cold
            with Helpers(1) as helpers:
                compile_ahead(units, "float32", helpers=helpers)
        else:
            compile_ahead(units, "float32", helpers=1)
        assert cached(units, "float32")
        assert not Helpers.worth_starting("float32")
        children = open(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children").read().split()
        assert not children, children
        with event.install_recorder("numba:compile") as compiled:
            main(["train", "--steps", "2", "--batch", "8", "--no-progress"])
        names = [e.data["dispatcher"].py_func.__qualname__ for _, e in compiled.buffer if e.is_start]
        assert not names, names
        print("compiled nothing")
        """
    )
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled nothing" in result.stdout


def test_helpers_given_nothing_exit_and_helpers_never_given_a_share_are_ended():
    with Helpers(2) as helpers:
        assert len(helpers) == 2
        assert helpers.give([[], []], "float32") == []
        for process in helpers.processes:
            assert process.wait(timeout=120) == 0  # an empty line: nothing to compile
    unused = Helpers(1)
    unused.close()  # as a run that fails before it compiles leaves its block
    assert unused.processes[0].poll() is not None
    assert not Helpers(0)


@pytest.mark.parametrize(
    "told", ["float32 x filterA", "float32 0 filterA", "int8 1", "float32 1 conv9"]
)
def test_a_waiting_helper_told_nonsense_exits_2_naming_its_usage(told):
    done = subprocess.run(
        [sys.executable, "-m", "runtime.compile_ahead", WAIT],
        input=told + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("usage: python -m runtime.compile_ahead")
