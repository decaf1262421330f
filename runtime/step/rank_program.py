"""What one rank does in a step of a plan: its pieces, messages, partial sums and collectives.

The program is derived from the plan alone, identically on every rank, so that both ends of every
message agree on it without talking: each message has a sequence number (its tag) and a point in
the task order after which both sides post it.

- *Copies* (a plan `Transfer` that is not a reduction): the part of a read rect that another rank
  holds. They are posted, the send on its source and the receive on its destination, right after
  the last task that wrote the part (or at the start of the step), and the destination waits for
  them just before the task that reads them. A halo therefore travels while the ranks compute
  whatever lies between its producer and its consumer.
- *Partial sums* (a `reduce` transfer): part of a piece's reduction that another rank holds. Sent
  after the piece runs; the holder adds it in at the end of the task.
- *Collectives*: the plan's `Reduction`s, run with the schedules of `partitioner.collectives`:
  sums, and all-gathers of a tensor the task wrote in parts (`partitioner.gathers`).
- *Local reduction*: the rest of a piece's reduction, the part this rank holds, added straight in.
  Where a reduction is entirely local the kernel accumulates into the tensor itself; otherwise it
  accumulates into a zeroed scratch, whose parts then go their separate ways.

The program runs the step's tasks in `runtime.step.order`: the graph's order with the
optimizer's updates moved as late as their dependences allow, so that a gradient's collective,
which runs in the background (see `rank_step`), overlaps the backward pass of the layers below
it rather than holding up the update that reads its result.

Which rects a rank holds, and which task last wrote each part (after which a copy of it is
posted), are read from the plan's record: the homes before the first task, then each task's
`holdings` (the layout of every tensor it writes or reduces into, after it) and
`Plan.written_by` (per cell of that layout, the task that last wrote or reduced into it).

`bytes_planned` is what the program sends: every copy and partial sum once per destination, and
the hops of every collective this rank sends. The executor counts what its calls actually send
and the two must agree.

Here are the program's parts and its `Builder`; its messages are `runtime.step.rank_messages`'s;
`runtime.step.task_events` finds what each task tells the builders, once for all ranks, and
`runtime.step.programs.build_programs` builds every rank's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.ir import Requirement, Task
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.collectives import Schedule
from partitioner.layout import Layout
from partitioner.pieces import Piece
from partitioner.plan import Plan
from partitioner.task_plan import Reduction
from runtime.step.rank_messages import STEP_START, Message, MessagesTold, tensor_of


@dataclass(frozen=True)
class Collective:
    reduction: Reduction
    #: the targets in flat-vector order: (rect, holders)
    targets: tuple[tuple[Rect, tuple[int, ...]], ...]
    #: its schedule (a list of rounds of `Hop`s, as a hand-made program gives it, is taken too)
    rounds: Schedule
    #: the tag of hop j of the flattened rounds is seq + j
    seq: int
    #: whether it sums a parameter's gradient whose home is sharded
    sharded: bool = False
    #: an all-gather's: per target, in flat-vector order, the rank that holds it before
    owners: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.rounds, Schedule):
            object.__setattr__(self, "rounds", Schedule.of_rounds(self.rounds))

    def targets_meeting(self, rect: Rect) -> list[Rect]:
        """The target rects that overlap `rect`, in order: those that `Rect.minus` cuts it by (a
        sum scattered over 1024 ranks has 1024 targets, of which each rank's part meets few)."""
        if len(self.targets) <= FEW_TARGETS:
            return [target for target, _ in self.targets if target.overlap_volume(rect)]
        lo, hi = self._target_corners
        meets = ((np.minimum(hi, rect.hi) - np.maximum(lo, rect.lo)) > 0).all(axis=1)
        return [self.targets[i][0] for i in np.flatnonzero(meets).tolist()]

    @cached_property
    def holders(self) -> frozenset[int]:
        """The ranks that hold some target."""
        return frozenset(rank for _, holders in self.targets for rank in holders)

    @cached_property
    def _target_corners(self) -> tuple[np.ndarray, np.ndarray]:
        lo = np.array([target.lo for target, _ in self.targets], np.int64)
        hi = np.array([target.hi for target, _ in self.targets], np.int64)
        return lo, hi


#: the most targets of a collective that `Collective.targets_meeting` compares one by one
FEW_TARGETS = 16


@dataclass(frozen=True)
class PieceWork:
    rect: Rect
    requirements: tuple[Requirement, ...]


class _found_once:
    """`functools.cached_property` without its lock, which Python 3.11 takes at every first
    access: a step's rank tasks (resnet18's 64 ranks: 26,816 of them) ask it once each. The value
    is kept in the instance's `__dict__`, where later reads find it first."""

    def __init__(self, find: Callable[[Any], Any]) -> None:
        self.find, self.name, self.__doc__ = find, find.__name__, find.__doc__

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.find(instance)
        return value


@dataclass
class RankTask:
    index: int
    task: Task
    pieces: list[PieceWork] = field(default_factory=list)
    copies_in: list[Message] = field(default_factory=list)
    partial_out: list[Message] = field(default_factory=list)
    partial_in: list[Message] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    #: per reduced tensor, the parts of this rank's contribution it adds into its own copy;
    #: absent when the kernel may accumulate into the tensor directly
    local_parts: dict[str, list[Rect]] = field(default_factory=dict)
    #: copies (sends and receives) to post once this task is done
    post: list[Message] = field(default_factory=list)
    #: reduced tensors whose collective runs in the tensor itself: this rank holds the whole
    #: target, nothing has been added to it since it was zeroed, and nothing else adds to it in
    #: this task, so the kernel accumulates straight into it and the collective sums it in place
    #: (no scratch the size of the gradient, no zeroing it, no folding it back)
    in_place: set[str] = field(default_factory=set)
    #: the rects this rank holds of outputs whose partial sums the task adds up (a grid cutting
    #: a reduction dim, `partitioner.reduction_split`): zeroed before its pieces run
    zero_first: list[tuple[str, Rect]] = field(default_factory=list)
    #: the collectives (by their ordinal in this rank's start order, ascending) to complete
    #: before the task runs, and before the copies due after it are posted
    #: (`Builder._completion_points`, `RankProgram.completions`)
    complete_before: tuple[int, ...] = ()
    complete_after: tuple[int, ...] = ()
    #: per resident tensor the task reads beyond this rank's home (a sharded parameter), the
    #: bounding box of those reads: a buffer of the step, filled from the home and the copies
    #: fetched for this task, and dropped after it
    windows: dict[str, Rect] = field(default_factory=dict)
    #: per window, the parts of it this rank holds at home, copied in before the task runs
    window_home: dict[str, list[Rect]] = field(default_factory=dict)
    #: tensors whose first contribution since their zeroing this task's one piece here makes
    #: over all of the zeroed rect: it writes them rather than adds, and the zeroing is elided
    fresh: set[str] = field(default_factory=set)
    #: a zeroing whose every rect the first contribution overwrites (`fresh`): not run
    elided: bool = False
    #: per gradient role, the position of the update task whose optimizer step this task's
    #: kernel takes in place of storing the gradient (`runtime.step.update_fusion`)
    steps: dict[str, int] = field(default_factory=dict)
    #: an update fused into the task at this position, which runs its step: not run itself
    fused_into: int | None = None

    @property
    def runs(self) -> bool:
        """Whether the task's pieces run here: not an elided zeroing, not a fused update."""
        return bool(self.pieces) and not self.elided and self.fused_into is None

    @_found_once
    def tensors(self) -> frozenset[str]:
        """Every tensor the task touches: its pieces', messages', collectives' and parts'."""
        if not (
            self.pieces
            or self.post
            or self.copies_in
            or self.partial_in
            or self.partial_out
            or self.collectives
            or self.local_parts
            or self.zero_first
        ):  # an idle task (`Builder.idle`): most of a model-parallel rank's on many ranks
            return _NO_TENSORS
        names = {req.tensor for piece in self.pieces for req in piece.requirements}
        for messages in (self.copies_in, self.partial_in, self.partial_out, self.post):
            names.update(map(tensor_of, messages))  # in C: a rank may post 10⁴ messages
        names.update(c.reduction.tensor for c in self.collectives)
        names.update(self.local_parts)
        names.update(tensor for tensor, _ in self.zero_first)
        return frozenset(names)


_NO_TENSORS: frozenset[str] = frozenset()


@dataclass
class RankProgram:
    rank: int
    nranks: int
    tasks: list[RankTask]
    #: copies to post at the start of the step
    post_at_start: list[Message]
    #: per tensor, the bounding box of every rect this rank touches (its buffer)
    boxes: dict[str, Rect]
    bytes_planned: int
    #: every message of the step, for diagnostics (who waits for whom)
    messages: int

    @cached_property
    def collectives(self) -> list[tuple[int, Collective]]:
        """(position of the task that starts it, collective), in the order they start."""
        return [(rt.index, c) for rt in self.tasks for c in rt.collectives]

    @cached_property
    def _next_computing(self) -> list[int]:
        """Per position, the first later position whose task's pieces run here
        (`RankTask.runs`), else the step's last: `send_released`'s answer for each consumer,
        found once, since the step asks it for every send in flight at every task."""
        found = [len(self.tasks) - 1] * len(self.tasks)
        following = len(self.tasks) - 1
        for rt in reversed(self.tasks):
            found[rt.index] = following
            if rt.runs:
                following = rt.index
        return found

    def send_released(self, message: Message) -> int:
        """The position at whose end this rank, having sent `message`, waits for it to leave:
        the first task after its consumer that computes here, else the step's last. Its send
        buffer lives until then (`runtime.step.buffers`), so the rank computes while the message
        is on the wire. Waiting at the consumer held the sender idle for that whole time: the
        consumer of a partial sum is the task that sends it, and a copy's may be a task of
        another pipeline stage that the sender only passes by (a micro-batch's gradient at a
        2-stage pipeline's cut, 256 KiB at 1 Gbit/s: about 3 ms before each forward)."""
        return self._next_computing[message.task]

    @cached_property
    def completions(self) -> list[int]:
        """Per collective, in start order, the position of the task at which it is complete at
        the latest: the first whose completion points name it (`Builder._completion_points`),
        or the step's last task (the step completes what is left at its end)."""
        out = [len(self.tasks) - 1] * len(self.collectives)
        for rt in self.tasks:
            for ordinal in (*rt.complete_before, *rt.complete_after):
                out[ordinal] = rt.index
        return out


class Builder:
    def __init__(self, graph: TaskGraph, plan: Plan, rank: int) -> None:
        self.graph = graph
        self.rank = rank
        self.nranks = plan.nranks
        self.tasks: list[RankTask] = []
        self.at_start: list[Message] = []
        self.touched: dict[str, list[Rect]] = defaultdict(list)
        self.bytes_planned = 0
        #: per tensor, its layout now (from the plan's record) and the cells this rank holds
        self.layouts: dict[str, Layout] = dict(plan.homes)
        self._held: dict[str, tuple[Layout, list[Rect]]] = {}
        #: per tensor, the rects this rank zeroed and has not added to or written since
        self.zeroed: dict[str, list[Rect]] = defaultdict(list)
        #: per tensor zeroed by a `set_zero` task and not read, written or added to since, the
        #: position of that task (whose zeroing a first contribution may make needless)
        self.zeroed_at: dict[str, int] = {}
        for name in plan.homes:
            self.touched[name].extend(self.held(name))

    def held(self, tensor: str) -> list[Rect]:
        """The rects of `tensor` this rank holds now."""
        layout = self.layouts.get(tensor)
        if layout is None:
            return []
        found = self._held.get(tensor)
        if found is None or found[0] is not layout:
            found = self._held[tensor] = (layout, layout.held_by(self.rank))
        return found[1]

    def holds(self, tensor: str, rect: Rect) -> bool:
        """Whether this rank holds all of `rect` of `tensor` now: where its cells fill one box
        (most ranks' do, `Layout.held_box`), whether the box contains `rect`."""
        layout = self.layouts.get(tensor)
        box = layout.held_box(self.rank) if layout is not None else None
        if box is not None:
            return box.contains(rect)
        return rect.covered_by_disjoint(self.held(tensor))

    def begin(self, position: int, task: Task, pieces: Iterable[Piece]) -> None:
        """Start the task at `position`: `pieces`, those of its pieces this rank computes, and
        the rects they touch. A reduction's rects are not yet touched: `end` adds what lands in
        the tensor itself (the rest is scratch), and a resident tensor's read beyond the home
        goes to a window."""
        current = RankTask(position, task)
        for piece in pieces:
            current.pieces.append(PieceWork(piece.rect, piece.requirements))
            for req in piece.requirements:
                read, write = req.read_rect, req.write_rect
                if req.privilege.reads:  # a read sees the zeros: they must be written
                    self.zeroed_at.pop(req.tensor, None)
                if read is not None and not read.is_empty():
                    if self.graph.tensors[req.tensor].resident and not self.holds(req.tensor, read):
                        window = current.windows.get(req.tensor, read)
                        current.windows[req.tensor] = window.union_bounds(read)
                    else:
                        self.touched[req.tensor].append(read)
                reduces = req.privilege is Privilege.REDUCE
                if write is not None and not write.is_empty() and not reduces:
                    self.touched[req.tensor].append(write)
        for tensor, window in current.windows.items():
            parts = (window.intersect(h) for h in self.held(tensor))
            current.window_home[tensor] = [p for p in parts if not p.is_empty()]
        self.current = current

    def messages(self, told: MessagesTold) -> None:
        """This rank's ends of the task's messages, grouped (`MessagesTold`)."""
        current = self.current
        touched = self.touched
        for tensor, box, reduce in told.received:
            if reduce or tensor not in current.windows:  # a window is filled, not touched
                touched[tensor].append(box)
        self.bytes_planned += told.sent_bytes
        current.partial_out += told.partial_out
        current.partial_in += told.partial_in
        current.copies_in += told.copies_in
        for post_after, messages in told.posted:
            (self.at_start if post_after == STEP_START else self.tasks[post_after].post).extend(
                messages
            )

    def collective(self, collective: Collective, sent: int, start: int) -> None:
        """`collective` starts after the task at position `start` (this one, or for an
        all-gather bringing this task's reads, an earlier one); this rank's hops of it send
        `sent` bytes."""
        at = self.current if start == self.current.index else self.tasks[start]
        at.collectives.append(collective)
        self.bytes_planned += sent

    def idle(self, position: int, task: Task, holdings: Mapping[str, Layout]) -> None:
        """`begin` and `end` of the task at `position` for a rank with no part in it: no piece,
        no end of a message, no place in a collective, and no cell of what it writes or adds
        into after it (`rank_parts`). Of a model-parallel vgg19 on 8192 ranks,
        90% of the (rank, task) pairs: what `end` would find for them, found without looking."""
        self.current = current = RankTask(position, task)
        self.tasks.append(current)
        self.layouts.update(holdings)
        for tensor in _opened(task, holdings):  # this rank holds none of it: nothing zeroed
            self.zeroed[tensor] = []

    def end(self, holdings: Mapping[str, Layout], deferred: Mapping[str, int]) -> None:
        """Finish the task begun: `holdings`, the layouts after it of what it writes or adds
        into; `deferred`, the tensors whose sums a later task's collective makes (this rank's
        part is added into its own copy, which then holds nothing but its own partial sums,
        so that the collective may sum the copy in place)."""
        current = self.current
        self.tasks.append(current)
        self.layouts.update(holdings)  # a sum's target is where it is held after the task
        reduced: dict[str, list[Rect]] = defaultdict(list)
        written: dict[str, list[Rect]] = defaultdict(list)
        for piece in current.pieces:
            for req in piece.requirements:
                if req.write_rect is None or req.write_rect.is_empty():
                    continue
                if req.privilege is Privilege.REDUCE:
                    reduced[req.tensor].append(req.write_rect)
                elif req.privilege.writes:
                    written[req.tensor].append(req.write_rect)
        for tensor in _opened(current.task, holdings):  # partial sums, added here or not
            if tensor not in written:
                self.zeroed[tensor] = list(self.held(tensor))
                self.touched[tensor].extend(self.zeroed[tensor])
                current.zero_first.extend((tensor, rect) for rect in self.zeroed[tensor])
        for tensor, rects in reduced.items():
            summing = [c for c in current.collectives if c.reduction.tensor == tensor]
            sends = [m for m in current.partial_out if m.tensor == tensor]
            held = self.held(tensor)
            if (
                not any(c.targets for c in summing)
                and not sends
                and all(r.covered_by(held) for r in rects)
            ):
                self.touched[tensor].extend(rects)  # the kernel adds into the tensor itself
                self._first_contribution(tensor, rects)
                continue
            if tensor in deferred:
                raise AssertionError(f"rank {self.rank} adds to {tensor} beyond its copy")
            parts = []
            for rect in rects:
                for h in held:
                    part = rect.intersect(h)
                    if not part.is_empty():
                        parts.extend(part.minus(_meeting(summing, part)))
            current.local_parts[tensor] = parts
            self.touched[tensor].extend(parts)
            if self._reduces_in_place(tensor, rects):
                current.in_place.add(tensor)
                self.touched[tensor].extend(rects)
                self._first_contribution(tensor, rects)
        # what other ranks add here (partial sums, a collective's result) is a contribution too
        landed = set(map(tensor_of, current.partial_in))
        landed.update(c.reduction.tensor for c in current.collectives if self.rank in c.holders)
        for tensor in set(reduced) | set(written) | landed:
            if current.task.op == "set_zero":
                self.zeroed[tensor].extend(written.get(tensor, []))
                self.zeroed_at[tensor] = current.index
            elif tensor in deferred:
                self.zeroed_at.pop(tensor, None)  # added to: no later task may just write it
            else:
                self.zeroed[tensor] = []
                self.zeroed_at.pop(tensor, None)

    def _first_contribution(self, tensor: str, rects: list[Rect]) -> None:
        """Where this task's one piece adds the first contribution to `tensor` since a
        `set_zero` task zeroed it, over exactly the one rect zeroed, the piece writes it and the
        zeroing is elided: no pass over a weight-sized gradient to zero it. A sparse update,
        which adds to some of its weights' channels, keeps its zeroing."""
        current = self.current
        zeroing = self.zeroed_at.get(tensor)
        if (
            zeroing is None
            or len(rects) != 1
            or self.zeroed.get(tensor) != rects
            or current.task.attrs.get("channels") is not None
        ):
            return
        zeroer = self.tasks[zeroing]
        if {req.tensor for piece in zeroer.pieces for req in piece.requirements} != {tensor}:
            return
        current.fresh.add(tensor)
        zeroer.elided = True

    def _reduces_in_place(self, tensor: str, rects: list[Rect]) -> bool:
        current = self.current
        collectives = [c for c in current.collectives if c.reduction.tensor == tensor]
        if len(collectives) != 1 or len(rects) != 1 or len(collectives[0].targets) != 1:
            return False
        (target, holders) = collectives[0].targets[0]
        messages = current.partial_in + current.partial_out
        return (
            target == rects[0]
            and self.rank in holders
            and not any(m.tensor == tensor for m in messages)
            and target.covered_by(self.zeroed.get(tensor, []))
        )

    def _completion_points(self) -> None:
        """Set each task's `complete_before` and `complete_after`: a collective completes before
        the first task that touches its tensor and before a copy of its tensor is sent (the copy
        carries the sum); a sharded home's reduce-scatter before the next task, since its
        buffers are the size of the whole gradient, which a sharded home exists not to hold.
        Those due at one point complete in the order they started, and the others stay in
        flight: a weight's all-reduce goes on past the partial sums of the input gradient below
        it, which the next task needs now.

        No rank blocks for good: collectives start at the same task on all their ranks, and a
        rank that waits, for a message or a collective, moves on every collective it has
        started. So in a cycle of ranks each waiting, at point P_i of the step, for a collective
        C_i that the next has not started (start(C_i) > P_{i+1} ≥ start(C_{i+1})), the start
        points would fall all round the cycle. Fixed here, the same on every run, so that the
        buffers a collective holds have a known last use."""
        started = 0
        #: per tensor, the ordinals of its collectives started and not yet complete
        pending: dict[str, list[int]] = defaultdict(list)
        prompt: list[int] = []  # sharded sums started by the task before
        for rt in self.tasks:
            if pending or prompt:  # (most of a model-parallel rank's tasks on many ranks: none)
                touched = rt.tensors & pending.keys() if pending else ()  # (found lazily)
                rt.complete_before = _complete(pending, touched, prompt)
            prompt = []
            for c in rt.collectives:
                pending[c.reduction.tensor].append(started)
                if c.sharded:
                    prompt.append(started)
                started += 1
            if not pending:
                continue
            # a model-parallel rank posts 10⁴ messages, most with nothing pending
            sending = {m.tensor for m in rt.post if m.src == self.rank} & pending.keys()
            rt.complete_after = _complete(pending, sending, ())
            prompt = [o for o in prompt if o not in rt.complete_after]

    def program(self, messages: int) -> RankProgram:
        self._completion_points()
        boxes = {}
        for tensor, rects in self.touched.items():
            box = Rect.bounding(rects)
            if box is not None:
                boxes[tensor] = box
        return RankProgram(
            self.rank, self.nranks, self.tasks, self.at_start, boxes, self.bytes_planned, messages
        )


def _opened(task: Task, holdings: Mapping[str, Layout]) -> list[str]:
    """The tensors `task` opens for writing (its WRITE requirements'), in order, that
    `holdings` lays out after it: each holder's cells of them are written or zeroed by it."""
    opened = (req.tensor for req in task.requirements if req.privilege is Privilege.WRITE)
    return [tensor for tensor in dict.fromkeys(opened) if tensor in holdings]


def _meeting(collectives: list[Collective], rect: Rect) -> list[Rect]:
    """The collectives' target rects that overlap `rect`, in order."""
    return [target for c in collectives for target in c.targets_meeting(rect)]


def _complete(
    pending: dict[str, list[int]], tensors: Iterable[str], ordinals: Iterable[int]
) -> tuple[int, ...]:
    """Take out of `pending` the collectives on `tensors` and those `ordinals` name; returns
    them in start order."""
    now = {o for tensor in tensors for o in pending.pop(tensor)}
    named = set(ordinals) - now
    if named:
        now |= named
        for tensor in [t for t, listed in pending.items() if named.intersection(listed)]:
            pending[tensor] = [o for o in pending[tensor] if o not in named]
            if not pending[tensor]:
                del pending[tensor]
    return tuple(sorted(now))
