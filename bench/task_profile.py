"""Measured compute: how long each rank's pieces of each task of a plan take on this machine.

The cost model prices a task's compute by its FLOPs at one rate per op and pass, whatever the
size of a rank's piece. A kernel's rate does depend on the piece: half the output channels or
half the batch makes smaller GEMMs, which run further from the machine's peak, and a piece of a
small network is dominated by fixed costs. FlexFlow's simulator meets this by running each
operator once per parallel configuration on the device and simulating the rest from those
measurements; `profile_plan` does the same for a plan. It runs every distinct piece with the
runtime's own kernels (`run_on_views`, as a rank runs it), on values from a real training step,
each requirement's rect copied into its own buffer, placed and laid out as the runtime places
and lays out a rank's buffers (`runtime.aligned`, `runtime.instances`), and sums a rank's
pieces per task.

What it leaves out is what the cost model adds: messages, reductions and collectives, and the
runtime's per-task bookkeeping (`Machine.task_overhead_us`). `partitioner.cost.plan_cost` takes
the result as its `measured` compute.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import MutableMapping

import numba
import numpy as np

from legion_nn.graph import TaskGraph
from partitioner.piece_times import piece_key
from partitioner.plan import Plan
from runtime.adapters import StepContext
from runtime.aligned import aligned_copy
from runtime.executor import run_on_views
from runtime.kernels.blas import kernel_threading
from runtime.rank_executor import RankExecutor, one_process

#: a piece's time is the median of this many runs, after one that compiles and warms up
REPEAT = 5

PieceKey = tuple


def sample_step(graph: TaskGraph, seed: int = 0) -> tuple[RankExecutor, StepContext]:
    """A one-rank executor after one training step of `graph` on seeded random data, and that
    step's context: realistic values (labels in range, activations of a real forward pass) for
    every tensor a piece reads."""
    data_task = next(t for t in graph.tasks if t.op == "data")
    # the step's whole batch (a micro-batch's data task loads its rows of it)
    shape = (graph.batch, *data_task.role_dims(graph.tensors)["raw_data"][1:])
    rng = np.random.default_rng(seed)
    inputs = rng.standard_normal(shape).astype(np.float32)
    classes = next(
        graph.tensors[req.tensor].dims[-1]
        for t in graph.tasks
        if t.op == "softmax" and t.phase == "forward"
        for req in t.requirements
        if req.role == "input"
    )
    labels = rng.integers(0, classes, size=graph.batch)
    executor = one_process(seed, keep_step_tensors=True)  # gradients too: updates read them
    ctx = StepContext(0, training=True, inputs=inputs, labels=labels)
    executor.run(graph, ctx)
    return executor, StepContext(1, training=True, inputs=inputs, labels=labels)


def profile_plan(
    graph: TaskGraph,
    plan: Plan,
    threads: int,
    sample: tuple[RankExecutor, StepContext] | None = None,
    cache: MutableMapping[PieceKey, float] | None = None,
) -> dict[str, float]:
    """Per task of `plan`, the seconds its busiest rank spends in its pieces' kernels, on
    `threads` Numba threads. Pieces with the same key (`piece_times.piece_key`: op, phase,
    attributes, shapes) are timed once (`cache`, keyed by (threads, piece key), which may be
    shared between plans and is the table `bench machine` writes)."""
    executor, ctx = sample if sample is not None else sample_step(graph)
    cache = {} if cache is None else cache
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    out: dict[str, float] = {}
    try:
        with kernel_threading():
            for task, task_plan in zip(graph.tasks, plan.tasks):
                per_rank: dict[int, float] = defaultdict(float)
                for piece in task_plan.pieces:
                    key = (threads, piece_key(task, piece.rect.shape, piece.requirements))
                    if key not in cache:
                        cache[key] = _time_piece(graph, task, piece, executor, ctx)
                    for rank in piece.ranks:
                        per_rank[rank] += cache[key]
                out[task.name] = max(per_rank.values(), default=0.0)
    finally:
        numba.set_num_threads(previous)
    return out


def _time_piece(graph, task, piece, executor: RankExecutor, ctx: StepContext) -> float:
    views = {}
    for req in piece.requirements:
        if req.rect is None:
            views[req.role] = np.zeros((0,) * len(graph.tensors[req.tensor].dims))
        else:
            # a copy even where the view is whole: a piece that writes must not change the sample
            views[req.role] = aligned_copy(executor.view(req.tensor, req.rect))
    seconds = []
    for _ in range(REPEAT + 1):
        start = time.perf_counter()
        run_on_views(task, piece.rect, piece.requirements, views, graph.tensors, ctx)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])
