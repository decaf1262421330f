"""The Numba threads a run in one process runs its kernels on: its cores', or one where their
parallel loops would not repay compiling them (`threads_worth_compiling`).

A kernel's parallel loops compile in about twice its plain loops' time
(`compile_units.Unit.seconds`), once per Numba cache, and save at most (1 − 1/T) of its time on
T threads, every step. A run whose kernels, as the cost model prices its steps and its
evaluations' forward passes on one thread (`run_kernel_seconds`), would save less than that
compiling adds runs on one thread, its kernels' plain loops (`runtime.kernels.threaded`): the
default job (400 steps of 0.3 ms of kernels) on two threads spent 5 s more on an empty cache,
and its warm run was no faster (3.00 s against 2.73 s). The choice reads the run, not the
cache, so that a run computes the same numbers on a cold cache as on a warm one; where
`NUMBA_NUM_THREADS` is set, the environment has chosen (`choose_threads`).
"""

from __future__ import annotations

import os

import numba

from legion_nn.graph import TaskGraph
from partitioner.cost import compute_per_rank
from partitioner.machine import Machine
from partitioner.plan import Plan
from runtime.compile_units import UNITS


def choose_threads(
    graph: TaskGraph,
    plan: Plan,
    units: list[str],
    steps: int,
    forward_passes: int,
    machine: Machine | None,
    processes: int,
) -> None:
    """Set this thread's Numba threads for a one-process run of `plan` (`steps` steps and
    `forward_passes` evaluation batches, `units` compiled by `processes` at once), unless
    `NUMBA_NUM_THREADS` says."""
    if "NUMBA_NUM_THREADS" in os.environ:
        return
    seconds = run_kernel_seconds(graph, plan, machine or Machine(), steps, forward_passes)
    threads = numba.get_num_threads()
    numba.set_num_threads(threads_worth_compiling(units, seconds, threads, processes))


def threads_worth_compiling(
    units: list[str], kernel_seconds: float, threads: int, processes: int
) -> int:
    """The Numba threads a run in one process should run its kernels on: `threads` where the
    most their parallel loops can save it, (1 − 1/threads) of `kernel_seconds` (its kernels'
    seconds on one thread, `run_kernel_seconds`), is more than compiling those loops adds on an
    empty cache beyond the plain ones (`Unit.seconds`, compiled by `processes` at once), else 1.
    """
    if threads <= 1:
        return 1
    extra = sum(max(UNITS[u].seconds[1] - UNITS[u].seconds[0], 0.0) for u in units)
    saved = kernel_seconds * (1.0 - 1.0 / threads)
    return threads if saved > extra / max(processes, 1) else 1


def run_kernel_seconds(
    graph: TaskGraph, plan: Plan, machine: Machine, steps: int, forward_passes: int
) -> float:
    """The seconds a one-rank run's kernels take, as the cost model prices them
    (`cost.compute_per_rank`, less the runtime's overhead per task, which is Python's and no
    thread shortens): `steps` steps of the whole graph and `forward_passes` of its forward tasks
    (its evaluations, `runtime.training.TrainConfig.evaluation_batches`)."""
    step = forward = 0.0
    for task, seconds in zip(graph.tasks, compute_per_rank(graph, plan, machine)):
        kernel = max(float(seconds.max(initial=0.0)) - machine.task_overhead, 0.0)
        step += kernel
        if task.phase == "forward":
            forward += kernel
    return steps * step + forward_passes * forward
