"""Every rank's program from the one built per class of `rank_classes`: a rank's own is its
class's first rank's program with each rect moved by the difference of the two ranks' frames and
each message and collective replaced by the rank's own told at the same point. The step's
simulators and the memory model read a class's program once for all its ranks (`source`,
`own_messages`, `own_collectives`, `collectives_of`, `built`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from legion_nn.rect import Rect
from runtime.step.rank_classes import RankClasses
from runtime.step.rank_messages import Message
from runtime.step.rank_program import Collective, PieceWork, RankProgram, RankTask
from runtime.step.task_events import TaskEvents


class SharedPrograms(Mapping[int, RankProgram]):
    """Every rank's program, from one built per class: a rank's own is moved from its class's
    when first asked for. The simulators and the memory model read a class's program once for
    all its ranks (`like`, `own_messages`) rather than asking for each."""

    def __init__(
        self,
        built: Mapping[int, RankProgram],
        classes: RankClasses,
        events: Sequence[TaskEvents],
        ranks: Sequence[int],
    ) -> None:
        self._programs: dict[int, RankProgram] = dict(built)
        self.classes = classes
        self._events = events
        self._ranks = list(ranks)
        self._like = {rank: rep for rep, members in classes.members.items() for rank in members}
        #: the facts of every message the ranks were told (`told_facts`)
        self.facts = told_facts(events)

    def __getitem__(self, rank: int) -> RankProgram:
        found = self._programs.get(rank)
        if found is None:
            source = self._programs[self._like[rank]]
            found = self._programs[rank] = _moved(source, rank, self.classes, self._events)
        return found

    def __iter__(self):
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self._like

    def like(self, rank: int) -> int:
        """The rank whose program `rank`'s is, moved (itself, for a class's first rank)."""
        return self._like[rank]

    def own_messages(self, rank: int) -> dict[int, Message] | None:
        """Per message of `like(rank)`'s program (by sequence number), `rank`'s own at the same
        point; None for a class's first rank."""
        source = self._like[rank]
        return None if source == rank else self.classes.own_messages(source, rank)

    def own_collectives(self, rank: int) -> dict[int, Collective] | None:
        """Per collective of `like(rank)`'s program (by sequence number), `rank`'s own at the
        same point; None for a class's first rank."""
        source = self._like[rank]
        return None if source == rank else self.classes.own_collectives(source, rank)


class BuiltPrograms(dict[int, RankProgram]):
    """`programs.build_programs`' programs where each rank's is built, with the facts of the
    messages they were told (`told_facts`)."""

    def __init__(self, built: Mapping[int, RankProgram], events: Sequence[TaskEvents]) -> None:
        super().__init__(built)
        self.facts = told_facts(events)


def told_facts(events: Sequence[TaskEvents]) -> np.ndarray:
    """The sequence number, source, destination and bytes of each message told the ranks
    built (`TaskEvents.facts`), a row each, in order: what the simulators read of a message
    besides its program's (a model-parallel step on 1024 ranks tells 5 million)."""
    return (
        np.concatenate([event.facts for event in events]) if events else np.zeros((0, 4), np.int64)
    )


def facts_of_programs(programs: Mapping[int, RankProgram]) -> np.ndarray | None:
    """`told_facts` of the messages of `programs` where `programs.build_programs` built them;
    None for programs made otherwise (by hand)."""
    if isinstance(programs, (SharedPrograms, BuiltPrograms)):
        return programs.facts
    return None


def source(programs: Mapping[int, RankProgram], rank: int) -> RankProgram:
    """The program `rank`'s is moved from (`SharedPrograms`), else `rank`'s own: it runs the
    same tasks, with the same messages at the same points, and the same buffers."""
    if isinstance(programs, SharedPrograms):
        return programs[programs.like(rank)]
    return programs[rank]


def own_messages(programs: Mapping[int, RankProgram], rank: int) -> dict[int, Message] | None:
    """Per message of `source(programs, rank)` (by sequence number), `rank`'s own at the same
    point; None where that program is `rank`'s own."""
    return programs.own_messages(rank) if isinstance(programs, SharedPrograms) else None


def own_collectives(programs: Mapping[int, RankProgram], rank: int) -> dict[int, Collective] | None:
    """Per collective of `source(programs, rank)` (by sequence number), `rank`'s own at the same
    point; None where that program is `rank`'s own."""
    return programs.own_collectives(rank) if isinstance(programs, SharedPrograms) else None


def collectives_of(programs: Mapping[int, RankProgram], rank: int) -> list[Collective]:
    """The collectives `rank` joins, in the order it starts them, without moving its program."""
    program = source(programs, rank)
    own = own_collectives(programs, rank)
    if own is None:
        return [c for _, c in program.collectives]
    return [own[c.seq] for _, c in program.collectives]


def built(programs: Mapping[int, RankProgram]) -> list[RankProgram]:
    """The programs of `programs` that were built, not moved: one per class."""
    if isinstance(programs, SharedPrograms):
        return [programs[rank] for rank in programs.classes.members]
    return list(programs.values())


def _moved(
    source: RankProgram, rank: int, classes: RankClasses, events: Sequence[TaskEvents]
) -> RankProgram:
    """`source`'s program as `rank`'s: its rects moved by the difference of the two ranks'
    frames, its messages `rank`'s own told at the same points, its pieces `rank`'s own."""
    to, frames = classes.frames_of(rank), classes.frames_of(source.rank)
    offsets = {
        tensor: offset
        for tensor, frame in frames.items()
        if any(offset := tuple(a - b for a, b in zip(to[tensor], frame)))
    }

    def move(tensor: str, rect: Rect) -> Rect:
        offset = offsets.get(tensor)
        return rect if offset is None else rect.translate(offset)

    own = classes.own_messages(source.rank, rank)
    own_collectives = classes.own_collectives(source.rank, rank)

    def mine(messages: list[Message]) -> list[Message]:
        return [own[m.seq] for m in messages]

    tasks = []
    for rt, event in zip(source.tasks, events):
        moved = RankTask(
            rt.index,
            rt.task,
            [PieceWork(p.rect, p.requirements) for p in event.mine.get(rank, ())],
            mine(rt.copies_in),
            mine(rt.partial_out),
            mine(rt.partial_in),
            [own_collectives[c.seq] for c in rt.collectives],
            {t: [move(t, r) for r in rects] for t, rects in rt.local_parts.items()},
            mine(rt.post),
            set(rt.in_place),
            [(t, move(t, r)) for t, r in rt.zero_first],
            rt.complete_before,
            rt.complete_after,
            {t: move(t, r) for t, r in rt.windows.items()},
            {t: [move(t, r) for r in rects] for t, rects in rt.window_home.items()},
            set(rt.fresh),
            rt.elided,
            dict(rt.steps),
            rt.fused_into,
        )
        # the tensors a task touches are the same names on every rank of the class
        moved.__dict__["tensors"] = rt.tensors
        tasks.append(moved)
    return RankProgram(
        rank,
        source.nranks,
        tasks,
        mine(source.post_at_start),
        {t: move(t, r) for t, r in source.boxes.items()},
        source.bytes_planned - classes.hop_bytes[source.rank] + classes.hop_bytes[rank],
        source.messages,
    )
