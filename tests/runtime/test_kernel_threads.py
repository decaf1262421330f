"""Which threads a run in one process runs its kernels on: the saving of its parallel loops, as
the cost model prices its kernels, against what compiling them adds."""

import pytest

from legion_nn.networks import load_network
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.compile_units import UNITS
from runtime.kernel_threads import run_kernel_seconds, threads_worth_compiling


def test_parallel_loops_are_chosen_where_they_save_more_than_their_compile_adds():
    units = ["filter.untied", "gelu", "embedding"]  # GELU and the embedding: no plain twin
    extra = sum(UNITS[u].seconds[1] - UNITS[u].seconds[0] for u in units)
    assert extra > 0
    # two threads save at most half the kernels' time, three two thirds; two processes compile
    assert threads_worth_compiling(units, 2 * extra * 1.01, 2, 1) == 2
    assert threads_worth_compiling(units, 2 * extra * 0.99, 2, 1) == 1
    assert threads_worth_compiling(units, extra * 1.01, 2, 2) == 2
    assert threads_worth_compiling(units, extra * 0.99, 2, 2) == 1
    assert threads_worth_compiling(units, 1.5 * extra * 1.01, 3, 1) == 3
    assert threads_worth_compiling(units, 1e9, 1, 1) == 1
    assert threads_worth_compiling(["gelu", "embedding"], 1e-9, 2, 1) == 2  # nothing to add


def test_a_runs_kernel_seconds_leave_out_the_overhead_per_task_and_count_forward_passes():
    graph = load_network("seed-lcn-small").lower(batch=4, dtype="float32", optimizer="adam")
    plan = build_plan(graph, builtin(graph, "data", 1), 1)
    machine = Machine()
    step = run_kernel_seconds(graph, plan, machine, 1, 0)
    forward = run_kernel_seconds(graph, plan, machine, 0, 1)
    assert 0 < forward < step
    assert run_kernel_seconds(graph, plan, machine, 3, 5) == pytest.approx(3 * step + 5 * forward)
    slow_python = Machine(task_overhead_us=machine.task_overhead * 1e6 + 500.0)
    assert run_kernel_seconds(graph, plan, slow_python, 3, 5) == pytest.approx(
        3 * step + 5 * forward
    )
