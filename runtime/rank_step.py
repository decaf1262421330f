"""One step of one rank's program: messages in flight, pieces, partial sums and collectives.

`RankExecutor` (the buffers, the plans, the values across steps) runs a `StepRun` per program it
executes. The step posts the program's copies as their data appears, waits for them just before
the task that reads them, runs the rank's pieces with the shared kernel adapters, sends and adds
partial sums, and runs the plan's collectives hop by hop. Every wait goes through
`transport.wait`, the stall watchdog. Trace events, when recorded, name the step ("eval" for an
evaluation pass) and pair each send with its receive by (program run, message sequence).

`LEGION_NN_FAULT=raise:RANK:TASK` makes the named rank raise inside that task's kernel, and
`hang:RANK:TASK` makes it stop there, to test that a job ends cleanly and that the watchdog names
the rank.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from runtime.adapters import StepContext
from runtime.piece_views import run_on_views
from runtime.running_collective import RunningCollective
from runtime.step.piece_modes import fresh_roles, fused_steps
from runtime.step.rank_messages import Message
from runtime.step.rank_program import Collective, RankProgram, RankTask
from runtime.tracing import COMMUNICATION, COMPUTE
from runtime.transport import done, wait

if TYPE_CHECKING:
    from runtime.instances import StorageOrder
    from runtime.step.buffers import Arena, StepBuffers
    from runtime.tracing import Recorder
    from runtime.transport import Transport


class StepHost(Protocol):
    """What a step needs of the executor that owns it (`runtime.rank_executor.RankExecutor`):
    its transport and identity, the buffers and layouts it keeps across steps, its views of
    them, and its settings."""

    rank: int
    transport: Transport
    recorder: Recorder | None
    arena: Arena
    layouts: dict[str, StorageOrder]
    stall_timeout: float
    fault: tuple[str, int, str] | None

    def view(self, name: str, rect: Rect) -> np.ndarray: ...


class InjectedFault(RuntimeError):
    pass


FAULT_KINDS = ("raise", "hang")


def fault_from_env() -> tuple[str, int, str] | None:
    spec = os.environ.get("LEGION_NN_FAULT", "")
    if not spec:
        return None
    kind, _, rest = spec.partition(":")
    rank, _, task = rest.partition(":")
    if kind not in FAULT_KINDS or not rank.isdigit() or not task:
        raise LegionNNError(f"LEGION_NN_FAULT must be raise|hang:RANK:TASK, got {spec!r}")
    return kind, int(rank), task


class StepRun:
    """The state of one step on one rank: messages in flight and reduction scratch."""

    def __init__(
        self,
        executor: StepHost,
        graph: TaskGraph,
        program: RankProgram,
        buffers: StepBuffers,
        ctx: StepContext,
        run_index: int,
    ) -> None:
        self.ex = executor
        #: where in the arena each of the step's buffers lives (`runtime.step.buffers`)
        self.buffers = buffers
        self.run_index = run_index
        #: what trace events call the step: its number, or "eval" for an evaluation pass
        self.step_label: int | str = ctx.step if ctx.training else "eval"
        self.graph = graph
        self.program = program
        self.ctx = ctx
        self.rank = executor.rank
        self.transport = executor.transport
        self.recorder = executor.recorder
        #: seq -> (request, buffer, message, posted at)
        self.inbox: dict[int, tuple[Any, np.ndarray, Message, float]] = {}
        #: (request, peer, buffer kept alive, message, posted at)
        self.sends: list[tuple[Any, int, np.ndarray, Message | None, float]] = []
        #: collectives started and not yet complete, in the order they started
        self.collectives: list[RunningCollective] = []
        #: every collective started this step, in the order they started
        self.started: list[RunningCollective] = []
        self.stall_timeout = executor.stall_timeout
        #: seconds this rank spent in its pieces' kernels this step (the rest it spent waiting,
        #: posting and copying): what `bench scaling` compares with the simulated compute
        self.compute_seconds = 0.0

    def _dtype(self, tensor: str):
        return np.dtype(self.graph.tensors[tensor].dtype)

    def _shape(self, tensor: str, rect: Rect) -> tuple[int, ...]:
        return self.ex.layouts[tensor].shape(rect.shape)

    def _event(self, cat: str, name: str, tid: int, start: float, args: dict[str, Any]) -> None:
        if self.recorder is not None:
            self.recorder.add(cat, name, tid, start, self.recorder.now(), args)

    def buffer(self, key: tuple, shape, dtype, zero: bool = False) -> np.ndarray:
        """The step's buffer `key` (`runtime.step.buffers`): the same memory every step."""
        array = self.ex.arena.view(self.buffers, key, shape, dtype)
        if zero:
            array.fill(0)
        return array

    def view(self, tensor: str, rect: Rect) -> np.ndarray:
        """This rank's buffer of `tensor` over `rect` (`RankExecutor.view`)."""
        return self.ex.view(tensor, rect)

    def now(self) -> float:
        return self.recorder.now() if self.recorder is not None else 0.0

    def post(self, messages: list[Message]) -> None:
        for m in messages:
            tag = self.transport.data_tag(m.seq)
            staged = m.seq not in self.buffers.staging.direct
            if m.src == self.rank:
                data = view = self.ex.view(m.tensor, m.rect)
                if staged:
                    data = self.buffer(("send", m.seq), view.shape, view.dtype)
                    data[...] = view
                request = self.transport.isend(data, m.dst, tag)
                self.sends.append((request, m.dst, data, m, self.now()))
            if m.dst == self.rank:
                if staged:
                    shape = self._shape(m.tensor, m.rect)
                    buffer = self.buffer(("recv", m.seq), shape, self._dtype(m.tensor))
                else:
                    buffer = self._window_view(self.program.tasks[m.task], m.tensor, m.rect)
                request = self.transport.irecv(buffer, m.src, tag)
                self.inbox[m.seq] = (request, buffer, m, self.now())

    def _window(self, rt: RankTask, tensor: str) -> np.ndarray:
        """The window of `tensor` for task `rt` (`RankTask.windows`): the same memory every
        step, from where its first copy is posted to `rt`."""
        shape = self._shape(tensor, rt.windows[tensor])
        return self.buffer(("window", rt.index, tensor), shape, self._dtype(tensor))

    def _window_view(self, rt: RankTask, tensor: str, rect: Rect) -> np.ndarray:
        return self._part(tensor, self._window(rt, tensor), rt.windows[tensor], rect)

    def _wait_messages(self, messages: list[Message], task: Task, why: str) -> None:
        if not messages:
            return
        start = self.now()
        pending = [(self.inbox[m.seq][0], m.src) for m in messages]
        wait(
            pending,
            f"step {self.ctx.step}, task {task.name} ({why})",
            self.rank,
            self.stall_timeout,
            self.advance_collectives if self.collectives else None,
        )
        if self.recorder is not None:
            end = self.recorder.now()
            for m in messages:
                self.recorder.add(
                    "recv",
                    f"{m.tensor} from {m.src}",
                    COMMUNICATION,
                    start,
                    end,
                    self._message_args(m, task, m.src),
                )

    def _message_args(self, m: Message, task: Task, peer: int) -> dict[str, Any]:
        consumer = self.program.tasks[m.task].task.name if m.task < len(self.program.tasks) else ""
        return {
            "step": self.step_label,
            "task": consumer or task.name,
            "tensor": m.tensor,
            "rect": [list(m.rect.lo), list(m.rect.hi)],
            "bytes": m.nbytes,
            "peer": peer,
            "id": f"{self.run_index}:{m.seq}",
        }

    def task(self, rt: RankTask) -> None:
        task = rt.task
        self._complete(rt.complete_before)
        self.post(rt.partial_in)
        self._wait_messages(rt.copies_in, task, "halo and copies")
        # The rank's own passes around its kernels move as much memory as a kernel (a sharded
        # weight's 283 MB half is packed in 17 ms): messages in flight move on meanwhile too.
        with self.transport.computing():
            scratch = self._compute_task(rt)
        if rt.partial_in:
            self._wait_messages(rt.partial_in, task, "partial sums")
            with self.transport.computing():
                for m in rt.partial_in:
                    _, buffer, _, _ = self.inbox.pop(m.seq)
                    self.ex.view(m.tensor, m.rect)[...] += buffer
        for collective in rt.collectives:
            self._collective(rt, collective, scratch)
        self._complete(rt.complete_after)  # a copy of a sum carries the whole sum
        if rt.post:
            with self.transport.computing():
                self.post(rt.post)
        self._wait_sends(rt)
        self._progress()

    def _compute_task(self, rt: RankTask) -> dict[str, tuple[Rect, np.ndarray]]:
        """`rt`'s copies received moved in, its kernels run, its partial sums sent and the parts
        it keeps added in; returns the scratch its pieces reduced into."""
        task = rt.task
        for m in rt.copies_in:
            _, buffer, _, _ = self.inbox.pop(m.seq)
            if m.tensor not in rt.windows:
                self.ex.view(m.tensor, m.rect)[...] = buffer
            elif m.seq not in self.buffers.staging.direct:
                self._window_view(rt, m.tensor, m.rect)[...] = buffer
        for tensor, parts in rt.window_home.items():
            for part in parts:
                self._window_view(rt, tensor, part)[...] = self.ex.view(tensor, part)
        for tensor, rect in rt.zero_first:
            self.ex.view(tensor, rect)[...] = 0
        scratch: dict[str, tuple[Rect, np.ndarray]] = {}
        staging = self.buffers.staging
        for tensor, rect in staging.scratch[rt.index].items():
            shape = self._shape(tensor, rect)
            array = self.buffer(("scratch", rt.index, tensor), shape, self._dtype(tensor), True)
            scratch[tensor] = (rect, array)
        for tensor, target in staging.in_place.get(rt.index, {}).items():
            scratch[tensor] = (target, self.ex.view(tensor, target))
        start = self.now()
        began = time.perf_counter()
        for piece in rt.pieces if rt.runs else []:
            self._compute(rt, piece, scratch)
        self.compute_seconds += time.perf_counter() - began
        if rt.runs:
            self._event(
                "compute",
                task.name,
                COMPUTE,
                start,
                {"step": self.step_label, "task": task.name, "phase": task.phase},
            )
        for m in rt.partial_out:
            rect, contribution = scratch[m.tensor]
            part = self._part(m.tensor, contribution, rect, m.rect)
            data = self.buffer(("send", m.seq), part.shape, part.dtype)
            data[...] = part
            request = self.transport.isend(data, m.dst, self.transport.data_tag(m.seq))
            self.sends.append((request, m.dst, data, m, self.now()))
        for tensor, parts in rt.local_parts.items():
            rect, contribution = scratch[tensor]
            for part in parts:
                self.ex.view(tensor, part)[...] += self._part(tensor, contribution, rect, part)
        return scratch

    def _wait_sends(self, rt: RankTask) -> None:
        """Wait for the sends released at `rt` (or earlier, `RankProgram.send_released`): their
        buffers' lifetimes end here (`runtime.step.buffers`), and by now their receivers have
        posted them."""
        released = self.program.send_released
        due = [(req, peer) for req, peer, _, m, _ in self.sends if m and released(m) <= rt.index]
        if due:
            wait(
                due,
                f"step {self.ctx.step}, task {rt.task.name} (sends still in flight)",
                self.rank,
                self.stall_timeout,
                self.advance_collectives if self.collectives else None,
            )

    def _part(self, tensor: str, array: np.ndarray, rect: Rect, part: Rect) -> np.ndarray:
        return array[self.ex.layouts[tensor].slices(part.relative_to(rect))]

    def _compute(self, rt: RankTask, piece, scratch) -> None:
        task = rt.task
        fault = self.ex.fault
        if fault is not None and fault[1:] == (self.rank, task.name):
            if fault[0] == "hang":  # a rank that stops making progress, for the stall watchdog
                time.sleep(3600)
            raise InjectedFault(f"fault injected by LEGION_NN_FAULT into {task.name}")
        views = {}
        for req in piece.requirements:
            if req.role in rt.steps:  # stepped from, never stored: it has no buffer
                continue
            if req.tensor in scratch and req.privilege is Privilege.REDUCE:
                views[req.role] = scratch[req.tensor][1]
            elif req.tensor in rt.windows and req.privilege is Privilege.READ:
                views[req.role] = self._window_view(rt, req.tensor, req.rect)
            elif req.rect is None:
                views[req.role] = np.zeros((0,) * len(self.graph.tensors[req.tensor].dims))
            else:
                views[req.role] = self.ex.view(req.tensor, req.rect)
        ctx = self.ctx
        fresh = fresh_roles(rt, piece)
        if fresh:  # the first contribution since a zeroing that was elided: it writes
            ctx = replace(ctx, fresh=fresh)
        if rt.steps:  # the updates fused into the task: its kernel steps their weights
            steps = fused_steps(self.program, rt, self.ex.view, ctx.step, ctx.lr_scale)
            ctx = replace(ctx, steps=steps)
        run_on_views(task, piece.rect, piece.requirements, views, self.graph.tensors, ctx)

    def _collective(self, rt: RankTask, collective: Collective, scratch) -> None:
        """Start `collective` on the contribution in `scratch` (an all-gather's: the parts of
        the tensor this rank owns); it runs in the background."""
        tensor = collective.reduction.tensor
        sizes = [rect.volume for rect, _ in collective.targets]
        mine = scratch.get(tensor)
        staging = self.buffers.staging
        if collective.owners:
            vector = self.buffer(("vector", collective.seq), (sum(sizes),), self._dtype(tensor))
            offset = 0
            for (rect, _), size, owner in zip(collective.targets, sizes, collective.owners):
                if owner == self.rank:
                    vector[offset : offset + size] = self.ex.view(tensor, rect).ravel()
                offset += size
        elif collective.seq in staging.vector_in_scratch or tensor in staging.in_place.get(
            rt.index, {}
        ):
            # The contribution is the vector (a replicated gradient, or a sharded one cut along
            # its outermost axis): reduce it in place rather than copy a weight-sized array.
            vector = mine[1].reshape(-1)
        else:
            vector = self.buffer(
                ("vector", collective.seq), (sum(sizes),), self._dtype(tensor), zero=True
            )
            offset = 0
            for (rect, _), size in zip(collective.targets, sizes):
                if mine is not None and mine[0].contains(rect):
                    part = self._part(tensor, mine[1], mine[0], rect)
                    vector[offset : offset + size] = part.ravel()
                offset += size
        running = RunningCollective(self, rt, collective, vector)
        running.post_round()
        self.collectives.append(running)
        self.started.append(running)

    def _complete(self, ordinals: tuple[int, ...]) -> None:
        """Complete the collectives `ordinals` names (in start order: the program's completion
        points, `RankTask.complete_before`); the others stay in flight, moved on meanwhile."""
        for ordinal in ordinals:
            running = self.started[ordinal]
            if running in self.collectives:  # else completed with all (clipping's norm)
                running.complete()
                self.collectives.remove(running)

    def complete_collectives(self) -> None:
        """Complete every collective still in flight, in the order they started."""
        while self.collectives:
            self.collectives.pop(0).complete()

    def advance_collectives(self, skip: RunningCollective | None = None) -> None:
        for running in self.collectives:
            if running is not skip:
                running.advance()

    def _progress(self) -> None:
        self.advance_collectives()
        still = []
        for entry in self.sends:
            request, peer, _, message, posted = entry
            if done(request, peer, f"step {self.ctx.step}, a send to rank {peer}", self.rank):
                if message is not None and self.recorder is not None:
                    self.recorder.add(
                        "send",
                        f"{message.tensor} to {peer}",
                        COMMUNICATION,
                        posted,
                        self.recorder.now(),
                        self._message_args(message, self.program.tasks[message.task].task, peer),
                    )
            else:
                still.append(entry)
        self.sends = still

    def finish(self) -> None:
        self.complete_collectives()
        if self.inbox:
            seqs = sorted(self.inbox)
            raise AssertionError(f"rank {self.rank}: messages {seqs[:5]} were never consumed")
        self._progress()
        wait(
            [(request, peer) for request, peer, *_ in self.sends],
            f"step {self.ctx.step}, end of step (sends still in flight)",
            self.rank,
            self.stall_timeout,
        )
        self._progress()
