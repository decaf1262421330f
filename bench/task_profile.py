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

Each run of a piece starts with its operands out of the caches (`cache_eviction.evict`), as a step's
other tasks leave them. Timed on warm caches (five runs over the same buffers), a piece read
faster the smaller it was, and by more than a step gives back (`bench/step_factor.py`, on
seed-lcn-small at batch 64, one core a rank, in five runs): a one-rank step's traced tasks over
their profile summed to 1.07-1.52, each rank's of a two-rank plan on the same host to 1.31-2.10
(data, model and spatial plans), so one factor fitted to the one-rank step
(`Machine.compute_factor`) priced a two-rank step's kernels up to 58% short (29% off on
average); and profiles of the same plan minutes apart differed by 30%. With the caches evicted,
in the same runs, 0.76-0.96 and 0.69-0.94: priced from 27% long to 12% short (13% off on
average), the one-rank profile 8.35-8.90 ms in six runs and 10.5 ms in a seventh.

What it leaves out is what the cost model adds: messages, reductions and collectives, and the
runtime's per-task bookkeeping (`Machine.task_overhead_us`). `partitioner.cost.plan_cost` takes
the result as its `measured` compute.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import replace

import numba
import numpy as np

from bench import cache_eviction
from legion_nn.graph import TaskGraph
from partitioner.machine import Machine
from partitioner.piece_times import piece_key
from partitioner.plan import Plan
from runtime.adapters import StepContext
from runtime.aligned import aligned_copy
from runtime.kernels.step_settings import step_kernel_settings
from runtime.piece_views import run_on_views
from runtime.rank_executor import RankExecutor, one_process
from runtime.step.piece_modes import fresh_roles, fused_steps, piece_mode
from runtime.step.programs import build_programs
from runtime.step.rank_program import RankProgram, RankTask
from runtime.step.shared_programs import source

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


@contextmanager
def _on_threads(threads: int) -> Iterator[None]:
    """The kernels on `threads` Numba threads meanwhile, as a rank of that many runs them."""
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        with step_kernel_settings():  # as a step runs them
            yield
    finally:
        numba.set_num_threads(previous)


def profile_plan(
    graph: TaskGraph,
    plan: Plan,
    threads: int,
    sample: tuple[RankExecutor, StepContext] | None = None,
    cache: MutableMapping[PieceKey, float] | None = None,
    programs: Mapping[int, RankProgram] | None = None,
) -> dict[str, float]:
    """Per task of `plan`, the seconds its busiest rank spends in its pieces' kernels, on
    `threads` Numba threads. Pieces with the same key (`piece_times.piece_key`: op, phase,
    attributes, shapes) are timed once (`cache`, keyed by (threads, piece key), which may be
    shared between plans and is the table `bench machine` writes).

    Every piece is timed adding into its reductions. With `programs` (every rank's,
    `step_programs.build_programs`), the pieces a rank's program runs otherwise are timed as it
    runs them too (`runtime.step.piece_modes`: writing a gradient, or taking the optimizer's step of
    an update fused into them), under their mode's key, and the seconds returned are the step's
    as run: those pieces' times, nothing for an elided zeroing or a fused update."""
    executor, ctx = sample if sample is not None else sample_step(graph)
    cache = {} if cache is None else cache
    out: dict[str, float] = {}
    with _on_threads(threads):
        for task, task_plan in zip(graph.tasks, plan.tasks):
            per_rank: dict[int, float] = defaultdict(float)
            for piece in task_plan.pieces:
                key = (threads, piece_key(task, piece.rect.shape, piece.requirements))
                if key not in cache:
                    cache[key] = _time_piece(graph, task, piece, executor, ctx)
                for rank in piece.ranks:
                    per_rank[rank] += cache[key]
            out[task.name] = max(per_rank.values(), default=0.0)
        if programs is not None:
            out = _profile_as_run(graph, programs, threads, executor, ctx, cache)
    return out


def profile_as_run(
    graph: TaskGraph,
    plan: Plan,
    threads: int,
    sample: tuple[RankExecutor, StepContext] | None = None,
    cache: MutableMapping[PieceKey, float] | None = None,
) -> dict[str, float]:
    """`profile_plan` of `plan` with every rank's program built (on the default machine): its
    pieces timed as well as those programs run them, and the step's seconds as run."""
    programs = build_programs(graph, plan, Machine(), range(plan.nranks))
    return profile_plan(graph, plan, threads, sample, cache, programs)


def _profile_as_run(graph, programs, threads, executor, ctx, cache) -> dict[str, float]:
    per_task: dict[str, dict[int, float]] = {task.name: {} for task in graph.tasks}
    for rank, seconds in _rank_task_seconds(graph, programs, threads, executor, ctx, cache):
        for name, total in seconds.items():
            per_task[name][rank] = total
    return {name: max(per.values(), default=0.0) for name, per in per_task.items()}


def _rank_task_seconds(graph, programs, threads, executor, ctx, cache):
    """(rank, {task: seconds of its pieces as the rank's program runs them}) per rank."""
    for rank in programs:
        program = source(programs, rank)
        seconds = {}
        for rt in program.tasks:
            if not rt.runs:
                continue
            total = 0.0
            for piece in rt.pieces:
                mode = piece_mode(program, rt, piece)
                key = (threads, piece_key(rt.task, piece.rect.shape, piece.requirements, mode))
                if key not in cache:
                    cache[key] = _time_piece(graph, rt.task, piece, executor, ctx, program, rt)
                total += cache[key]
            seconds[rt.task.name] = total
        yield rank, seconds


def profile_ranks(
    graph: TaskGraph,
    plan: Plan,
    threads: int,
    sample: tuple[RankExecutor, StepContext] | None = None,
    cache: MutableMapping[PieceKey, float] | None = None,
) -> dict[int, dict[str, float]]:
    """Per rank of `plan`, per task it runs, the seconds of its pieces as its program runs them
    (`profile_as_run` keeps the busiest rank's)."""
    executor, ctx = sample if sample is not None else sample_step(graph)
    cache = {} if cache is None else cache
    programs = build_programs(graph, plan, Machine(), range(plan.nranks))
    with _on_threads(threads):
        return dict(_rank_task_seconds(graph, programs, threads, executor, ctx, cache))


def _time_piece(
    graph,
    task,
    piece,
    executor: RankExecutor,
    ctx: StepContext,
    program: RankProgram | None = None,
    rt: RankTask | None = None,
) -> float:
    """The median seconds of `piece`'s kernel, each run on evicted caches: adding into its
    reductions, or as `rt` of `program` runs it (`runtime.step.piece_modes`)."""

    operands = []  # what each run reads and writes, taken out of the caches before it

    def copied(tensor, rect):
        # a copy even where the view is whole: a piece that writes must not change the sample
        operands.append(aligned_copy(executor.view(tensor, rect)))
        return operands[-1]

    stepped = rt.steps if rt is not None else {}
    views = {}
    for req in piece.requirements:
        if req.role in stepped:  # stepped from, never stored: it has no buffer
            continue
        if req.rect is None:
            views[req.role] = np.zeros((0,) * len(graph.tensors[req.tensor].dims))
        else:
            views[req.role] = copied(req.tensor, req.rect)
    if rt is not None:
        steps = fused_steps(program, rt, copied, ctx.step)
        ctx = replace(ctx, fresh=fresh_roles(rt, piece), steps=steps)
    seconds = []
    for _ in range(REPEAT + 1):
        cache_eviction.evict(operands)
        start = time.perf_counter()
        run_on_views(task, piece.rect, piece.requirements, views, graph.tensors, ctx)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])
