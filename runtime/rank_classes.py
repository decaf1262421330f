"""Ranks whose programs are alike, built once: the programs of a plan's ranks found by building
one rank of each class and moving its program to the others.

In a data-parallel step every rank but the one holding the loss runs the same tasks on rects
that differ only in where they lie along the batch; a spatial step's inner ranks differ only
along the rows. A rank's builder (`rank_program._Builder`) decides everything it does by
comparing rects of one tensor with each other (overlaps, coverage, differences, bounding boxes)
and by which ranks are the ends of its messages and the holders of its collectives' targets.
Those decisions do not change when every rect of a tensor moves by the same offset. So:

- Each rank's *signature* is everything its builder is told, in the order told (`task_events`):
  its pieces' requirements, its messages (its end of each, bytes, when posted), its part in each
  collective (the bytes it sends, the targets and whether it holds each) and the cells it holds
  of each layout. Each rect is written relative to the *frame* of its tensor on that rank: the
  low corner of the first rect of that tensor the rank is told of.
- Ranks with equal signatures form a class. Telling them the same things with every rect of a
  tensor moved by the difference of their frames, their builders make the same decisions: the
  program of one is that of another with its rects moved, and with each message replaced by the
  rank's own message told at the same point.
- `derive` makes those programs from the class's first rank's, unfused (fusing the updates, which
  compares rects of two tensors, runs on each program after). Pieces are the rank's own.

`tests/test_rank_classes.py` holds the programs derived equal to the programs built, field for
field, on every kind of plan.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from legion_nn.rect import Rect
from partitioner.plan import Plan
from runtime.rank_program import Message, PieceWork, RankProgram, RankTask, TaskEvents

#: a rect relative to its tensor's frame, or `EMPTY`
Relative = tuple[int, ...]
EMPTY: Relative = ()


@dataclass
class RankClasses:
    #: per class, its ranks (the first, its representative, is built)
    members: dict[int, list[int]]
    #: per rank, the low corner of each tensor's first rect it was told of
    frames: dict[int, dict[str, tuple[int, ...]]]
    #: per rank, the messages it was told of, in the order told (once per end it is)
    messages: dict[int, list[Message]]


class _Signature:
    """One rank's signature (see the module docstring) as it is told each task."""

    __slots__ = ("frames", "messages", "tokens")

    def __init__(self) -> None:
        self.frames: dict[str, tuple[int, ...]] = {}
        self.tokens: list[tuple] = []
        self.messages: list[Message] = []

    def relative(self, tensor: str, rect: Rect | None) -> Relative | None:
        if rect is None:
            return None
        if rect.is_empty():
            return EMPTY
        frame = self.frames.get(tensor)
        if frame is None:
            frame = self.frames[tensor] = rect.lo
        return (*(a - f for a, f in zip(rect.lo, frame)), *(b - f for b, f in zip(rect.hi, frame)))

    def held(self, position: int, tensor: str, rects: Sequence[Rect]) -> None:
        self.tokens.append(("held", position, tensor, *(self.relative(tensor, r) for r in rects)))


def rank_classes(plan: Plan, events: Sequence[TaskEvents], ranks: Sequence[int]) -> RankClasses:
    """The classes of `ranks` whose builders are told the same things up to where their rects
    lie: each rank's signature, following `rank_program._build` call for call."""
    signatures = {rank: _Signature() for rank in ranks}
    for name, layout in plan.homes.items():
        for rank, signature in signatures.items():
            held = layout.held_by(rank)
            if held:
                signature.held(-1, name, held)
    for event in events:
        position = event.position
        for rank, pieces in event.mine.items():
            signature = signatures[rank]
            relative = signature.relative
            for piece in pieces:
                signature.tokens.append(
                    (
                        "piece",
                        position,
                        *(
                            (
                                req.tensor,
                                req.privilege,
                                relative(req.tensor, req.read_rect),
                                relative(req.tensor, req.write_rect),
                            )
                            for req in piece.requirements
                        ),
                    )
                )
        for message in event.messages:
            for rank in (message.src, message.dst):
                signature = signatures.get(rank)
                if signature is None:
                    continue
                signature.messages.append(message)
                signature.tokens.append(
                    (
                        "message",
                        position,
                        message.src == rank,
                        message.dst == rank,
                        message.tensor,
                        signature.relative(message.tensor, message.rect),
                        message.nbytes,
                        message.post_after,
                        message.reduce,
                    )
                )
        for ordinal, (collective, sent) in enumerate(event.collectives):
            tensor = collective.reduction.tensor
            for rank in collective.reduction.participants:
                signature = signatures.get(rank)
                if signature is None:
                    continue
                signature.tokens.append(
                    (
                        "collective",
                        position,
                        ordinal,
                        sent.get(rank, 0),
                        *(
                            (signature.relative(tensor, rect), rank in holders)
                            for rect, holders in collective.targets
                        ),
                    )
                )
        for tensor, layout in event.holdings.items():
            for rank, signature in signatures.items():
                held = layout.held_by(rank)
                if held:
                    signature.held(position, tensor, held)
    members: dict[tuple, list[int]] = defaultdict(list)
    for rank, signature in signatures.items():
        members[tuple(signature.tokens)].append(rank)
    return RankClasses(
        {ranks[0]: ranks for ranks in members.values()},
        {rank: s.frames for rank, s in signatures.items()},
        {rank: s.messages for rank, s in signatures.items()},
    )


def derive(
    built: Mapping[int, RankProgram],
    classes: RankClasses,
    events: Sequence[TaskEvents],
    ranks: Sequence[int],
) -> dict[int, RankProgram]:
    """Every rank's program, in `ranks` order: the representatives' `built` (unfused), the
    others moved from their representative's."""
    out: dict[int, RankProgram] = {}
    rep_of = {rank: rep for rep, members in classes.members.items() for rank in members}
    for rank in ranks:
        rep = rep_of[rank]
        if rank == rep:
            out[rank] = built[rank]
            continue
        out[rank] = _moved(built[rep], rank, classes, events)
    return out


def _moved(
    source: RankProgram, rank: int, classes: RankClasses, events: Sequence[TaskEvents]
) -> RankProgram:
    """`source`'s program as `rank`'s: its rects moved by the difference of the two ranks'
    frames, its messages `rank`'s own told at the same points, its pieces `rank`'s own."""
    to, frames = classes.frames[rank], classes.frames[source.rank]
    offsets = {
        tensor: offset
        for tensor, frame in frames.items()
        if any(offset := tuple(a - b for a, b in zip(to[tensor], frame)))
    }

    def move(tensor: str, rect: Rect) -> Rect:
        offset = offsets.get(tensor)
        return rect if offset is None else rect.translate(offset)

    own = dict(zip((m.seq for m in classes.messages[source.rank]), classes.messages[rank]))

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
            list(rt.collectives),
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
        source.bytes_planned,
        source.messages,
    )
