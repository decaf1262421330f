"""What each rank holds in a training step of a plan, predicted from the programs the runtime runs.

A rank holds three things: its resident tensors' home cells (parameters, optimizer state, the
loaded data; kept across steps), the arena of its step buffers (`runtime.step.buffers`: every
activation, gradient, message, collective and scratch buffer, each live from its first use to its
last and placed once), and the process's own baseline (the interpreter, NumPy, Numba's compiled
kernels, MPI: `Machine.process_baseline_bytes`). The first two are exactly the runtime's buffer
bytes (`train --log-json`'s `buffer_peak_bytes`), since the runtime allocates by this very
placement; the three together predict its peak resident set.

The prediction builds every rank's program, so it costs about what planning all the ranks does;
`partitioner.accounting` gives the quicker count the search prices, by layer (every tensor and
staging buffer held all step), which is above the placed buffers. `memory_prediction` is what
`partition` reports: every rank placed up to `PLACED_MAX_RANKS` ranks, and beyond that the held
count, which the runtime's buffers stay within.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from legion_nn.graph import TaskGraph
from partitioner.accounting import memory_per_rank
from partitioner.machine import Machine
from partitioner.plan import Plan
from runtime.instances import choose_storage_orders
from runtime.step.buffers import PREDICTED_COMPILED_FROM, StepBuffers, hop_buffers, step_buffers
from runtime.step.programs import build_programs
from runtime.step.rank_program import RankProgram
from runtime.step.shared_programs import collectives_of, source

#: plans on more ranks are given the held-all-step count (`HELD`), not placed buffers
PLACED_MAX_RANKS = 64

#: what a rank's resident tensors hold, by their kind
RESIDENT_PARTS = {"param": "parameters", "state": "optimizer state", "data": "data"}


@dataclass(frozen=True)
class RankMemory:
    rank: int
    #: bytes of resident tensors, by `RESIDENT_PARTS`
    resident: dict[str, int]
    buffers: StepBuffers
    baseline: int
    #: names of the program's tasks, in the order it runs them
    tasks: tuple[str, ...]

    @property
    def buffer_bytes(self) -> int:
        """What the runtime's buffers hold: the resident tensors and the arena."""
        return sum(self.resident.values()) + self.buffers.size

    @property
    def peak(self) -> int:
        """The predicted peak resident set: the buffers and the baseline."""
        return self.buffer_bytes + self.baseline

    def live(self) -> np.ndarray:
        """Bytes held at each task: the resident tensors, the step buffers in use, the
        baseline (the arena's unused space is not counted: it is where the curve peaks)."""
        return self.buffers.live() + sum(self.resident.values()) + self.baseline

    def breakdown(self) -> dict[str, int]:
        """The peak, by part: resident tensors, the step buffers in use where they peak (by what
        they hold), the arena's space unused there (placement's cost), and the baseline."""
        live = self.buffers.live()
        at = int(np.argmax(live)) if len(live) else 0
        out = dict(self.resident)
        out.update(self.buffers.by_kind(at))
        out["arena unused at its peak"] = self.buffers.size - self.buffers.peak
        out["baseline"] = self.baseline
        return out

    @property
    def peak_task(self) -> str:
        live = self.buffers.live()
        return self.tasks[int(np.argmax(live))] if len(live) else ""


def predict(
    graph: TaskGraph,
    plan: Plan,
    machine: Machine | None = None,
    ranks: Iterable[int] | None = None,
    programs: Mapping[int, RankProgram] | None = None,
) -> dict[int, RankMemory]:
    """Each rank's memory in a training step of `plan` (all ranks unless `ranks`), from their
    `programs` where the caller has built them."""
    machine = machine or Machine()
    ranks = list(range(plan.nranks)) if ranks is None else list(ranks)
    layouts = choose_storage_orders(graph)
    if programs is None:
        programs = build_programs(graph, plan, machine, ranks)
    out = {}
    #: per program placed and its adding hops' buffers, its resident bytes and buffers: a
    #: rank whose program is moved from another's (`shared_programs.source`) holds buffers of the
    #: same sizes, used alike, but for the chunks of collectives it adds (`hop_buffers`, of
    #: the collectives it joins)
    placed: dict[tuple, tuple[dict[str, int], StepBuffers]] = {}
    for rank in ranks:
        program = source(programs, rank)
        key = (id(program), hop_buffers(collectives_of(programs, rank), rank))
        found = placed.get(key)
        if found is None:
            if program.rank != rank and key[1] != hop_buffers(
                collectives_of(programs, program.rank), program.rank
            ):
                program = programs[rank]  # its own, moved: its hops' buffers
            resident: dict[str, int] = {part: 0 for part in RESIDENT_PARTS.values()}
            for name, box in program.boxes.items():
                tensor = graph.tensors[name]
                if tensor.resident:
                    resident[RESIDENT_PARTS[tensor.kind]] += box.volume * tensor.itemsize
            buffers = step_buffers(graph, program, layouts, compiled_from=PREDICTED_COMPILED_FROM)
            found = placed[key] = (resident, buffers)
        out[rank] = RankMemory(
            rank,
            dict(found[0]),
            found[1],
            machine.process_baseline_bytes,
            tuple(rt.task.name for rt in program.tasks),
        )
    return out


#: in `auto`'s fitting, how many ranks (the fullest by `accounting.memory_per_rank`) are placed,
#: besides rank 0 (which holds the step's statistics)
SAMPLED_RANKS = 4
#: what a rank holds on more ranks than `PLACED_MAX_RANKS`: placing even a few ranks' programs
#: walks every message of the plan (a minute for vgg19 at 1024 ranks), so the count of every
#: tensor and staging buffer held all step, which is above the placement, stands in
HELD = "at most: every tensor and staging buffer held all step, beyond 64 ranks"


def sampled_ranks(held: dict[int, int]) -> list[int]:
    """Rank 0 and the `SAMPLED_RANKS` ranks fullest by the held-all-step count `held`: a plan's
    ranks run alike but for the cells they get, so its fullest rank is among them."""
    return sorted({0, *sorted(held, key=lambda r: -held[r])[:SAMPLED_RANKS]})


def plan_peak(
    graph: TaskGraph,
    plan: Plan,
    machine: Machine,
    programs: Mapping[int, RankProgram] | None = None,
    placed: Sequence[PlacedRanks] | None = None,
) -> int:
    """The most bytes a rank of a plan holds with its baseline: its buffers placed on the ranks
    `sampled_ranks` picks (from `programs`, where the caller has every rank's, or read from
    `placed`, every rank placed in shares), or beyond `PLACED_MAX_RANKS` the held count (`HELD`). What
    `auto` fits in memory (`partitioner.search.memory_fit`, through
    `runtime.step.model.StepModel.peak`)."""
    held = memory_per_rank(graph, plan)
    if plan.nranks > PLACED_MAX_RANKS:
        return max(held.values(), default=0) + machine.process_baseline_bytes
    sampled = sampled_ranks(held)
    if placed is not None:
        peaks = every_peak(placed)
        return max(peaks[rank] for rank in sampled)
    memories = predict(graph, plan, machine, sampled, programs)
    return max(m.peak for m in memories.values())


@dataclass(frozen=True)
class PlacedRanks:
    """What `memory_prediction` reports of some of a plan's ranks, placed: each one's peak, and
    the fullest one's (the first of the fullest) parts and the task at its peak."""

    peaks: dict[int, int]
    fullest: int
    fullest_at: str
    fullest_breakdown: dict[str, int]


def every_peak(placed: Sequence[PlacedRanks]) -> dict[int, int]:
    """Each rank's peak, from the shares that placed them."""
    return {rank: peak for share in placed for rank, peak in share.peaks.items()}


def placed_ranks(
    graph: TaskGraph,
    plan: Plan,
    machine: Machine,
    ranks: Iterable[int] | None = None,
    programs: Mapping[int, RankProgram] | None = None,
) -> PlacedRanks:
    """`predict` of `ranks` (all ranks unless given), summed up as `memory_prediction` reports
    them; small enough to send from the process that placed them."""
    memories = predict(graph, plan, machine, ranks, programs)
    top = max(memories.values(), key=lambda m: m.peak)
    return PlacedRanks(
        {rank: m.peak for rank, m in memories.items()}, top.rank, top.peak_task, top.breakdown()
    )


def memory_prediction(
    graph: TaskGraph,
    plan: Plan,
    machine: Machine,
    programs: Mapping[int, RankProgram] | None = None,
    placed: Sequence[PlacedRanks] | None = None,
) -> dict:
    """What `partition` reports of a rank's memory: the peak over ranks of the runtime's buffers
    and baseline (`predict`, every rank's program placed: `programs`, where the caller has built
    them, or `placed`, every rank placed in shares by the caller), its mean, the fullest rank's
    parts; beyond `PLACED_MAX_RANKS` ranks the held count with the baseline (`HELD`)."""
    held = memory_per_rank(graph, plan)
    baseline = machine.process_baseline_bytes
    out = {
        "memory_held_per_rank_max": max(held.values(), default=0),
        "memory_held_per_rank_mean": sum(held.values()) / max(len(held), 1),
        "process_baseline_bytes": baseline,
    }
    if plan.nranks > PLACED_MAX_RANKS:
        fullest = max(held, key=lambda r: held[r])
        out |= {
            "memory_per_rank_max": held[fullest] + baseline,
            "memory_per_rank_mean": out["memory_held_per_rank_mean"] + baseline,
            "memory_model": HELD,
            "memory_peak_rank": fullest,
        }
    else:
        placed = placed or [placed_ranks(graph, plan, machine, programs=programs)]
        peaks = every_peak(placed)
        top = min(placed, key=lambda share: (-share.peaks[share.fullest], share.fullest))
        out |= {
            "memory_per_rank_max": peaks[top.fullest],
            "memory_per_rank_mean": sum(peaks.values()) / len(peaks),
            "memory_model": "placed, each live from its first use to its last",
            "memory_peak_rank": top.fullest,
            "memory_peak_at": top.fullest_at,
            "memory_breakdown": top.fullest_breakdown,
        }
    return out | {"feasible": out["memory_per_rank_max"] <= machine.memory_bytes}
