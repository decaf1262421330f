"""A step whose ranks' programs all differ, simulated from programs built and flattened in shares
of its ranks, one share per core.

Ranks told alike are built once (`rank_classes`), so a data-parallel plan's step costs about one
rank's program whatever its rank count. A plan whose grids change from layer to layer over
different rank counts has no two ranks alike: vgg19's `auto` plan on 1024 ranks (layers on 4×16×16,
14×14 and 4×14×14 grids, a classifier cut 4 by batch and 256 by rows) builds 1024 programs of 216
tasks each, about 13 s on one core of the 2-core VM, and prices and flattens them in about 6 s
more. Every rank's program, its tasks' seconds, its passes and its instructions depend on the plan
alone, so each share of the ranks is built, priced and flattened (`compiled.flat_part`) by a
process of its own, forked (`foresight.Foresight`: nothing pickled or imported again), and the
command merges the parts (`flat_step.merged`) and runs the compiled loop over them: the same
instructions, so the same step, float for float, as flattening every rank in one process
(`tests/runtime/step/test_simulated_in_shares.py`).

A rank with a part in no task and no home (`rank_parts.idle_ranks`: vgg19's model plan on 8192
ranks has 4096, beyond its widest layer) is not built: it ends at 0. The others' tasks they have
no part in are told at once (`Builder.idle`).

Only the parts cross between processes: arrays of instructions, seconds, keys and the messages'
ends, and the collectives each part starts (the programs themselves, objects per task and
message, take about as long to pickle and unpickle as to build: 2.3 s against 1.7 s for 128 of
vgg19's).

On up to `rank_memory.PLACED_MAX_RANKS` ranks, where `partition` reports memory placed from every
rank's program, each share also places its ranks from the programs it built
(`simulated_and_placed_in_shares`), so that no program is built twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from legion_nn.graph import TaskGraph
from partitioner.cost import compute_per_rank
from partitioner.machine import Machine
from partitioner.plan import Plan
from runtime.step.foresight import shared_out
from runtime.step.links import Links
from runtime.step.prediction import every_rank_work, load_the_loop, priced, run_flat
from runtime.step.programs import build_programs
from runtime.step.rank_cpu import cpu_slowdown
from runtime.step.rank_memory import PlacedRanks, placed_ranks
from runtime.step.rank_parts import idle_ranks
from runtime.step.simulated_step import SimulatedStep

if TYPE_CHECKING:
    from runtime.step.flat_step import FlatPart


def simulate_in_shares(
    graph: TaskGraph, plan: Plan, machine: Machine, workers: int
) -> SimulatedStep:
    """The simulated step of `plan` (`prediction.simulate_compiled`'s), its ranks built and
    flattened in `workers + 1` contiguous shares, by this process and up to `workers` forked
    ones at once (`foresight.shared_out`; none: every share here, one after another)."""
    return _in_shares(graph, plan, machine, workers, False)[0]


def simulated_and_placed_in_shares(
    graph: TaskGraph, plan: Plan, machine: Machine, workers: int
) -> tuple[SimulatedStep, list[PlacedRanks]]:
    """`simulate_in_shares`, each share's ranks also placed (`rank_memory.placed_ranks`) from
    the programs built for the step: what `partition` reports of a plan on up to
    `rank_memory.PLACED_MAX_RANKS` ranks, every rank's program built once."""
    step, placed = _in_shares(graph, plan, machine, workers, True)
    assert placed is not None
    return step, placed


def _in_shares(
    graph: TaskGraph, plan: Plan, machine: Machine, workers: int, place: bool
) -> tuple[SimulatedStep, list[PlacedRanks] | None]:
    from runtime.step.flat_step import merged  # loads Numba: before the processes fork

    nranks = plan.nranks
    table = np.asarray(compute_per_rank(graph, plan, machine), np.float64).reshape(
        len(graph.tasks), nranks
    )
    slowdown = cpu_slowdown(machine, range(nranks), nranks)
    work = every_rank_work(graph, plan)
    # a rank with a part in no task does nothing all step: built, it would be simulated to end
    # at 0 (`tests/runtime/step/test_simulated_in_shares.py`); a placed one holds the baseline
    skipped = np.zeros(nranks, bool)
    if not place:
        skipped[idle_ranks(plan)] = True
    simulated = np.flatnonzero(~skipped)
    shares = [simulated[s] for s in balanced_shares(work[simulated], min(workers + 1, nranks))]
    jobs = {}
    for k, share in enumerate(shares):
        tell_apart = _tells_apart(graph, work, share)
        jobs[k] = partial(
            _flattened, graph, plan, machine, table, slowdown, share.tolist(), place, tell_apart
        )
    # the loop loaded from Numba's cache while the other processes build their shares
    found = list(shared_out(jobs, workers, partial(load_the_loop, machine)).values())
    links = Links.of(machine, nranks)
    step = run_flat(merged([part for part, _ in found], links), machine, links, slowdown)
    if skipped.any():
        step = with_idle_ranks(step, nranks)
    return step, [placed for _, placed in found] if place else None


def with_idle_ranks(step: SimulatedStep, nranks: int) -> SimulatedStep:
    """`step` with each of `nranks` ranks it does not hold (`rank_parts.idle_ranks`) ending at 0
    having waited and computed for 0, every rank in order as the compiled loop gives them: the
    means over ranks (`SimulatedStep.compute_fraction`) sum their terms in the same order."""

    def each_rank(of_some: dict[int, float]) -> dict[int, float]:
        return {rank: of_some.get(rank, 0.0) for rank in range(nranks)}

    return SimulatedStep(
        step.seconds,
        each_rank(step.finish),
        each_rank(step.waiting),
        step.timeline,
        each_rank(step.compute),
    )


def balanced_shares(work: np.ndarray, count: int) -> list[np.ndarray]:
    """`count` contiguous ranges of a plan's ranks, in order, of about equal `work` (per rank,
    `prediction.every_rank_work`: vgg19's auto plan on 1024 ranks: ranks 512-1023, which hold
    the 14×14 grids' ends, built for 7.4 s against 6.6 s for ranks 0-511 when the two halves
    were equal in ranks)."""
    done = np.cumsum(work)
    cuts = np.searchsorted(done, done[-1] * np.arange(1, count) / count, side="right")
    return [share for share in np.split(np.arange(len(work)), cuts) if len(share)]


def _tells_apart(graph: TaskGraph, work: np.ndarray, share: np.ndarray) -> bool:
    """Whether a share's ranks are told apart into classes alike before they are built
    (`programs.build_programs`' `share`): not where their messages are most of their work
    (`prediction.every_rank_work`). Telling ranks apart reads every end of every message, so
    there it costs about what building does, and it pays only where the share's ranks fall into
    far fewer classes than the whole plan's, which were too many to build (a model-parallel
    layer's ranks each receive every slice but their own, and all differ: vgg19's model plan
    on 1024 ranks spent 5.6 s of a share's 15 s build telling 683 ranks apart)."""
    return float(work[share].sum()) <= 2.0 * len(graph.tasks) * len(share)


def _flattened(
    graph: TaskGraph,
    plan: Plan,
    machine: Machine,
    table: np.ndarray,
    slowdown: dict[int, float],
    ranks: Sequence[int],
    place: bool,
    tell_apart: bool,
) -> tuple[FlatPart, PlacedRanks | None]:
    """The instructions of `ranks` (`compiled.flat_part`): their programs built (those of
    ranks alike once where `tell_apart`), priced and flattened; and, where `place`, the ranks
    placed from those programs."""
    from runtime.step.compiled import flat_part

    programs = build_programs(graph, plan, machine, ranks, share=tell_apart)
    placed = placed_ranks(graph, plan, machine, ranks, programs) if place else None
    seconds, passes = priced(graph, plan, machine, programs, table)
    return flat_part(programs, seconds, passes, slowdown), placed
