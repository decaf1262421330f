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

Here are the program's parts; `runtime.step.rank_builder.Builder` builds one, its messages are
`runtime.step.rank_messages`'s;
`runtime.step.task_events` finds what each task tells the builders, once for all ranks, and
`runtime.step.programs.build_programs` builds every rank's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from legion_nn.ir import Requirement, Task
from legion_nn.rect import Rect
from partitioner.collectives import Schedule
from partitioner.task_plan import Reduction
from runtime.step.rank_messages import Message, tensor_of


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
    #: (`rank_builder.Builder._completion_points`, `RankProgram.completions`)
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
        ):  # an idle task (`rank_builder.Builder.idle`): most of a model-parallel rank's on many ranks
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
