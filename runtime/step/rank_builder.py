"""A rank's program built task by task (`Builder`): told each task's pieces, messages and
collectives (`runtime.step.task_events`), it files them into the program's parts
(`runtime.step.rank_program`), tracking what the rank holds, touches and has zeroed, and fixes
where each collective completes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.layout import Layout
from partitioner.pieces import Piece
from partitioner.plan import Plan
from runtime.step.rank_messages import STEP_START, Message, MessagesTold, tensor_of
from runtime.step.rank_program import Collective, PieceWork, RankProgram, RankTask


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
