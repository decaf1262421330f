"""Ranks whose programs are alike, built once: the programs of a plan's ranks found by building
one rank of each class and moving its program to the others.

In a data-parallel step every rank but the one holding the loss runs the same tasks on rects
that differ only in where they lie along the batch; a spatial step's inner ranks differ only
along the rows. A rank's builder (`rank_program.Builder`) decides everything it does by
comparing rects of one tensor with each other (overlaps, coverage, differences, bounding boxes)
and by which ranks are the ends of its messages and the holders of its collectives' targets.
Those decisions do not change when every rect of a tensor moves by the same offset. So:

- Each rank's *signature* is everything its builder is told, in the order told (`task_events`):
  its pieces' requirements, its messages (its end of each, bytes, when posted), its part in each
  collective (the bytes it sends, the buffers of the hops it adds, the targets and whether it
  holds each) and the cells it holds of each layout. Each rect is written relative to the
  *frame* of its tensor on that rank: the low corner of the first rect of that tensor the rank
  is told of.
- Ranks with equal signatures form a class. Telling them the same things with every rect of a
  tensor moved by the difference of their frames, their builders make the same decisions: the
  program of one is that of another with its rects moved, and with each message replaced by the
  rank's own message told at the same point.
- `SharedPrograms` moves those programs from the class's first rank's when asked for. Pieces
  are the rank's own. Fusing updates into their gradients' kernels compares rects of two
  tensors once (an update's parameters against its gradient), and that comparison is part of
  the signature: the first rank's fused program moves as it is.
- The step's simulators and the memory model read a class's program once for all its ranks.
- Telling ranks apart gives up once they fall into more classes than `SHARED_AT_MOST` of their
  count (a mixture of grids per layer, uneven spatial cuts): then every rank is built.

`tests/test_rank_classes.py` holds the programs moved equal to the programs built, field for
field, on every kind of plan, and the step and memory read once per class equal to those read
rank by rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import sub

from legion_nn.rect import Rect
from partitioner.plan import Plan
from runtime.step.buffers import hop_segment
from runtime.step.rank_program import Message, PieceWork, RankProgram, RankTask
from runtime.step.task_events import TaskEvents

#: a rect's low and high corners relative to its tensor's frame
Relative = tuple[int, ...]


@dataclass
class RankClasses:
    #: per class, its ranks (the first, its representative, is built)
    members: dict[int, list[int]]
    #: per rank, the low corner of each tensor's first rect it was told of
    frames: dict[int, dict[str, tuple[int, ...]]]
    #: per rank, the messages it was told of, in the order told (once per end it is)
    messages: dict[int, list[Message]]

    def own_messages(self, source: int, rank: int) -> dict[int, Message]:
        """Per message `source` was told of (by sequence number), the message `rank` of its
        class was told at the same point."""
        return dict(zip((m.seq for m in self.messages[source]), self.messages[rank]))


class _Signature:
    """One rank's signature (see the module docstring) as it is told each task."""

    __slots__ = ("frames", "messages", "tokens", "told")

    def __init__(self) -> None:
        self.frames: dict[str, tuple[int, ...]] = {}
        #: what the rank has been told since `settle`
        self.tokens: list[tuple] = []
        self.messages: list[Message] = []
        #: the class of what it was told before that
        self.told = 0

    def settle(self, classes: dict[tuple, int]) -> int:
        """Fold what the rank was told since the last call into its class: ranks told the same
        before and since share the class again (`classes` numbers each (class, tokens) met)."""
        key = (self.told, *self.tokens)
        self.told = classes.setdefault(key, len(classes))
        self.tokens = []
        return self.told

    def relative(self, tensor: str, rect: Rect | None) -> Relative | None:
        if rect is None:
            return None
        lo = rect.lo
        frame = self.frames.get(tensor)
        if frame is None:
            frame = self.frames[tensor] = lo
        return (*map(sub, lo, frame), *map(sub, rect.hi, frame))

    def held(self, position: int, tensor: str, rects: Sequence[Rect]) -> None:
        self.tokens.append(("held", position, tensor, *(self.relative(tensor, r) for r in rects)))


#: sharing gives up once the ranks fall into more classes than this share of them: building
#: each would cost little more than building them all, and telling them apart costs on
SHARED_AT_MOST = 0.25


def rank_classes(
    plan: Plan,
    events: Sequence[TaskEvents],
    ranks: Sequence[int],
    at_most: float = SHARED_AT_MOST,
) -> RankClasses | None:
    """The classes of `ranks` whose builders are told the same things up to where their rects
    lie: each rank's signature, following `task_events.build_each` call for call, task by task.
    None where there are more than `at_most` of the ranks' count."""
    signatures = {rank: _Signature() for rank in ranks}
    most = at_most * len(ranks)
    classes: dict[tuple, int] = {}

    def settled() -> bool:
        return len({signature.settle(classes) for signature in signatures.values()}) <= most

    for name, layout in plan.homes.items():
        for rank, signature in signatures.items():
            held = layout.held_by(rank)
            if held:
                signature.held(-1, name, held)
    if not settled():
        return None
    for event in events:
        position = event.position
        updates = event.task.op == "update"
        for rank, pieces in event.mine.items():
            signature = signatures[rank]
            relative = signature.relative
            for piece in pieces:
                signature.tokens.append(
                    (
                        "piece",
                        position,
                        updates and _steps_its_gradients_rect(piece.requirements),
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
            adding = collective.rounds.adding_sizes
            segment = hop_segment(collective.reduction.itemsize)
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
                        # the buffers its adding hops take (`buffers.step_slots`)
                        tuple(min(size, segment) for size in adding.get(rank, ())),
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
        if not settled():
            return None
    members: dict[int, list[int]] = defaultdict(list)
    for rank, signature in signatures.items():
        members[signature.told].append(rank)
    return RankClasses(
        {ranks[0]: ranks for ranks in members.values()},
        {rank: s.frames for rank, s in signatures.items()},
        {rank: s.messages for rank, s in signatures.items()},
    )


def _steps_its_gradients_rect(requirements) -> bool:
    """Whether an update's piece steps the rect of its gradient it reads: the one comparison of
    rects of two tensors that fusing updates into their gradients' kernels makes
    (`update_fusion.fuse_into_gradients`), so that it too is the same on every rank of a class."""
    by_role = {req.role: req for req in requirements}
    params, gradient = by_role.get("params"), by_role.get("gradient")
    return params is not None and gradient is not None and params.rect == gradient.rect


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
    to, frames = classes.frames[rank], classes.frames[source.rank]
    offsets = {
        tensor: offset
        for tensor, frame in frames.items()
        if any(offset := tuple(a - b for a, b in zip(to[tensor], frame)))
    }

    def move(tensor: str, rect: Rect) -> Rect:
        offset = offsets.get(tensor)
        return rect if offset is None else rect.translate(offset)

    own = classes.own_messages(source.rank, rank)

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
        source.bytes_planned,
        source.messages,
    )
