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
from collections.abc import Mapping, MutableMapping
from dataclasses import replace

import numba
import numpy as np

from legion_nn.graph import TaskGraph
from partitioner.machine import Machine
from partitioner.piece_times import piece_key
from partitioner.plan import Plan
from runtime.adapters import StepContext
from runtime.aligned import aligned_copy
from runtime.executor import run_on_views
from runtime.kernels.blas import kernel_threading
from runtime.piece_modes import fresh_roles, fused_steps, piece_mode
from runtime.rank_classes import source
from runtime.rank_executor import RankExecutor, one_process
from runtime.rank_program import RankProgram, RankTask
from runtime.step_programs import build_programs

#: a piece's time is the least of this many passes over a plan's pieces (`_time_pieces`)
PASSES = 3
#: of this many runs each, after one that compiles and warms up
REPEAT = 3

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
    programs: Mapping[int, RankProgram] | None = None,
) -> dict[str, float]:
    """Per task of `plan`, the seconds its busiest rank spends in its pieces' kernels, on
    `threads` Numba threads. Pieces with the same key (`piece_times.piece_key`: op, phase,
    attributes, shapes) are timed once (`cache`, keyed by (threads, piece key), which may be
    shared between plans and is the table `bench machine` writes).

    Every piece is timed adding into its reductions. With `programs` (every rank's,
    `step_programs.build_programs`), the pieces a rank's program runs otherwise are timed as it
    runs them too (`runtime.piece_modes`: writing a gradient, or taking the optimizer's step of
    an update fused into them), under their mode's key, and the seconds returned are the step's
    as run: those pieces' times, nothing for an elided zeroing or a fused update."""
    executor, ctx = sample if sample is not None else sample_step(graph)
    cache = {} if cache is None else cache
    #: the pieces not yet timed, by key, each with the program and task that run it as run
    pending: dict[PieceKey, tuple] = {}
    for task, task_plan in zip(graph.tasks, plan.tasks):
        for piece in task_plan.pieces:
            key = (threads, piece_key(task, piece.rect.shape, piece.requirements))
            if key not in cache:
                pending.setdefault(key, (task, piece, None, None))
    for program, rt, piece, key in _as_run(programs or {}, threads):
        if key not in cache:
            pending.setdefault(key, (rt.task, piece, program, rt))
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        with kernel_threading():
            cache.update(_time_pieces(graph, pending, executor, ctx))
    finally:
        numba.set_num_threads(previous)
    if programs is not None:
        per_task: dict[str, dict[int, float]] = {task.name: {} for task in graph.tasks}
        for rank in programs:
            for _, rt, _, key in _as_run({rank: source(programs, rank)}, threads):
                per_task[rt.task.name][rank] = per_task[rt.task.name].get(rank, 0.0) + cache[key]
        return {name: max(per.values(), default=0.0) for name, per in per_task.items()}
    out: dict[str, float] = {}
    for task, task_plan in zip(graph.tasks, plan.tasks):
        per_rank: dict[int, float] = defaultdict(float)
        for piece in task_plan.pieces:
            key = (threads, piece_key(task, piece.rect.shape, piece.requirements))
            for rank in piece.ranks:
                per_rank[rank] += cache[key]
        out[task.name] = max(per_rank.values(), default=0.0)
    return out


def _as_run(programs: Mapping[int, RankProgram], threads: int):
    """(program, task, piece, key) of each piece the programs run, keyed by its mode
    (`runtime.piece_modes`); a class's ranks' programs once."""
    seen = set()
    for rank in programs:
        program = source(programs, rank)
        if id(program) in seen:
            continue
        seen.add(id(program))
        for rt in program.tasks:
            for piece in rt.pieces if rt.runs else []:
                mode = piece_mode(program, rt, piece)
                key = piece_key(rt.task, piece.rect.shape, piece.requirements, mode)
                yield program, rt, piece, (threads, key)


def _time_pieces(graph, pending: dict, executor, ctx) -> dict[PieceKey, float]:
    """Each pending piece's seconds: the least of `PASSES` passes over all of them, each
    pass's time of a piece the median of `REPEAT` runs (`_time_piece`). A piece timed in one
    stretch takes that stretch's speed: on a shared VM one pass timed deep-mlp's backward
    pieces 14% slower than the pass before it, and a kernel is never faster than its cost, so
    the fastest pass is the nearest."""
    passes: dict[PieceKey, list[float]] = defaultdict(list)
    for _ in range(PASSES):
        for key, (task, piece, program, rt) in pending.items():
            passes[key].append(_time_piece(graph, task, piece, executor, ctx, program, rt))
    return {key: min(seconds) for key, seconds in passes.items()}


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


def _time_piece(
    graph,
    task,
    piece,
    executor: RankExecutor,
    ctx: StepContext,
    program: RankProgram | None = None,
    rt: RankTask | None = None,
) -> float:
    """The median seconds of `piece`'s kernel: adding into its reductions, or as `rt` of
    `program` runs it (`runtime.piece_modes`)."""

    def copied(tensor, rect):
        # a copy even where the view is whole: a piece that writes must not change the sample
        return aligned_copy(executor.view(tensor, rect))

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
        start = time.perf_counter()
        run_on_views(task, piece.rect, piece.requirements, views, graph.tensors, ctx)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])
