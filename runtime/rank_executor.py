"""The rank executor: one rank's share of every step, over any transport.

Given the partitioner's plan, each rank runs its `RankProgram` (see `runtime.rank_program`): it
allocates one buffer per tensor covering only the rects its pieces, halos, messages and home cells
touch (`RankProgram.boxes`), posts the step's copies as soon as their data exists, runs its pieces
with the same kernel adapters as the local executor (`run_on_views`), sends and adds partial
sums, and runs the plan's collectives hop by hop (`partitioner.collectives`). One rank needs no
special path: its program has no messages.

All ranks plan independently and identically, except the `auto` search, whose time limit could
make ranks disagree: rank 0 searches and sends the grids to the others.

Parameters and state keep one home for the whole run: the homes of the full training batch's plan.
The plans of other batch sizes (the last batch of an epoch, evaluation) are built with those homes,
so a rank that has no piece of a small batch still takes part in the reductions of the parameters
it holds and keeps its copies current.

Failures carry the rank, step and task (`TaskFailure`); waits past the stall timeout name the
ranks still owed a message (`transport.StallError`). `LEGION_NN_FAULT=raise:RANK:TASK` makes the
named rank raise inside that task's kernel, and `hang:RANK:TASK` makes it stop there, to test that
a job ends cleanly and that the watchdog names the rank.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.ir import Task
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from partitioner.layout import Layout as PlanLayout
from partitioner.machine import Machine
from partitioner.plan import Plan, build_plan
from partitioner.strategy import Strategy, builtin
from runtime.adapters import StepContext
from runtime.executor import NUMPY_DTYPES, inference_tasks, initial_part, run_on_views
from runtime.instances import Layout, choose_layouts
from runtime.rank_program import Message, RankProgram, RankTask, build_programs
from runtime.tracing import COMMUNICATION, COMPUTE, Recorder
from runtime.transport import (
    GroupAborted,
    PeerLost,
    StallError,
    Transport,
    wait,
    wait_object,
)

TAG_STRATEGY, TAG_GATHER, TAG_RESIDENT = 1, 2, 3


class TaskFailure(LegionNNError):
    def __init__(self, rank: int, step: int, task: str, error: BaseException) -> None:
        self.rank, self.step, self.task, self.error = rank, step, task, error
        super().__init__(f"rank {rank}: step {step}, task {task}: {type(error).__name__}: {error}")


class InjectedFault(RuntimeError):
    pass


FAULT_KINDS = ("raise", "hang")


def _fault_from_env() -> tuple[str, int, str] | None:
    spec = os.environ.get("LEGION_NN_FAULT", "")
    if not spec:
        return None
    kind, _, rest = spec.partition(":")
    rank, _, task = rest.partition(":")
    if kind not in FAULT_KINDS or not rank.isdigit() or not task:
        raise LegionNNError(f"LEGION_NN_FAULT must be raise|hang:RANK:TASK, got {spec!r}")
    return kind, int(rank), task


@dataclass
class _Prepared:
    plan: Plan
    step: RankProgram
    inference: RankProgram


class RankExecutor:
    def __init__(
        self,
        transport: Transport,
        strategy: str | Callable[[TaskGraph, int], Strategy],
        machine: Machine | None = None,
        seed: int = 0,
        stall_timeout: float = 60.0,
        recorder: Recorder | None = None,
        on_task: Callable[[int, str], None] | None = None,
    ) -> None:
        self.transport = transport
        self.rank, self.nranks = transport.rank, transport.size
        self.strategy_spec = strategy
        self.machine = machine or Machine()
        self.seed = seed
        self.stall_timeout = stall_timeout
        self.recorder = recorder
        self.on_task = on_task
        self.fault = _fault_from_env()
        self.arrays: dict[str, np.ndarray] = {}
        self.boxes: dict[str, Rect] = {}
        self.layouts: dict[str, Layout] = {}
        self._prepared: dict[int, _Prepared] = {}
        self._strategy: Strategy | None = None
        self._resident_homes: dict[str, PlanLayout] | None = None
        self._tensors: dict[str, Any] = {}
        #: every tensor of every graph planned, by name
        self._known: dict[str, Any] = {}
        self._sent_at_step_start = 0
        self.last_bytes_planned = 0
        self.last_bytes_sent = 0
        #: programs run so far: every rank runs the same sequence, so (run, seq) names a message
        self.runs = 0

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    # Planning.

    def strategy(self, graph: TaskGraph) -> Strategy:
        """The run's strategy, chosen once on the first graph (the training batch's)."""
        if self._strategy is None:
            spec = self.strategy_spec
            if callable(spec):
                if self.rank == 0:
                    chosen = spec(graph, self.nranks)
                    for dst in range(1, self.nranks):
                        self.transport.send_object(chosen, dst, TAG_STRATEGY)
                else:
                    request = self.transport.recv_object(0, TAG_STRATEGY)
                    chosen = wait_object(request, 0, "waiting for the strategy", self.rank, 600)
                self._strategy = chosen
            else:
                self._strategy = builtin(graph, spec, self.nranks)
        return self._strategy

    def plan(self, graph: TaskGraph) -> Plan:
        return self.prepare(graph).plan

    def prepare(self, graph: TaskGraph) -> _Prepared:
        key = id(graph)
        prepared = self._prepared.get(key)
        if prepared is None:
            strategy = self.strategy(graph)
            plan = build_plan(graph, strategy, self.nranks, self._resident_homes)
            if self._resident_homes is None:
                self._resident_homes = {
                    name: home
                    for name, home in plan.homes.items()
                    if graph.tensors[name].kind != "data"
                }
            inference = {task.name for task in inference_tasks(graph)}
            step = build_programs(graph, plan, self.machine, [self.rank])[self.rank]
            infer = build_programs(graph, plan, self.machine, [self.rank], inference)[self.rank]
            prepared = self._prepared[key] = _Prepared(plan, step, infer)
            self._graph_refs = getattr(self, "_graph_refs", [])
            self._graph_refs.append(graph)  # keep id(graph) unique while cached
        self._allocate(graph, prepared.step)
        return prepared

    def _allocate(self, graph: TaskGraph, program: RankProgram) -> None:
        self._known.update(graph.tensors)
        layouts = choose_layouts(graph)
        for name in sorted(graph.tensors):
            tensor = graph.tensors[name]
            box = program.boxes.get(name)
            if box is None:
                if tensor.kind not in ("param", "state"):
                    self.arrays.pop(name, None)
                    self.boxes.pop(name, None)
                continue
            layout = self.layouts.setdefault(name, layouts[name])
            if name in self.arrays and self.boxes[name] == box:
                continue
            if tensor.kind in ("param", "state"):
                if name in self.arrays:
                    raise AssertionError(f"the home of {name} moved from {self.boxes[name]!r}")
                stream = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
                part = initial_part(tensor, stream, box)
                self.arrays[name] = np.ascontiguousarray(layout.from_logical(part))
            else:
                shape = layout.shape(box.shape)
                self.arrays[name] = np.zeros(shape, NUMPY_DTYPES[tensor.dtype])
            self.boxes[name] = box
            self._tensors[name] = tensor

    def view(self, name: str, rect: Rect) -> np.ndarray:
        if rect.is_empty():  # e.g. softmax.grad's empty read of the loss gradient
            layout = self.layouts.get(name, Layout("logical"))
            return np.zeros(layout.shape(rect.shape), NUMPY_DTYPES[self._known[name].dtype])
        box = self.boxes[name]
        if not box.contains(rect):
            raise AssertionError(f"{rect!r} of {name} lies outside this rank's {box!r}")
        return self.arrays[name][self.layouts[name].slices(rect.relative_to(box))]

    # Running.

    def run(self, graph: TaskGraph, ctx: StepContext) -> StepContext:
        prepared = self.prepare(graph)
        self._execute(graph, prepared.step, ctx)
        return ctx

    def run_inference(self, graph: TaskGraph, ctx: StepContext) -> StepContext:
        prepared = self.prepare(graph)
        self._execute(graph, prepared.inference, ctx)
        return ctx

    def _execute(self, graph: TaskGraph, program: RankProgram, ctx: StepContext) -> None:
        self.runs += 1
        run = _StepRun(self, graph, program, ctx, self.runs)
        sent_before = self.transport.bytes_sent
        run.post(program.post_at_start)
        for rank_task in program.tasks:
            if self.on_task:
                self.on_task(ctx.step, rank_task.task.name)
            try:
                run.task(rank_task)
            except (TaskFailure, StallError, PeerLost, GroupAborted):
                raise
            except Exception as exc:
                raise TaskFailure(self.rank, ctx.step, rank_task.task.name, exc) from exc
        run.finish()
        self.last_bytes_sent = self.transport.bytes_sent - sent_before
        self.last_bytes_planned = program.bytes_planned

    # Values, checkpoints and log records.

    def value(self, name: str) -> np.ndarray | None:
        """A whole small tensor (the loss, evaluate's sums) on the rank holding it (rank 0)."""
        box = self.boxes.get(name)
        if box is None or box.lo != (0,) * box.ndim:
            return None
        tensor = self._tensors[name]
        if box.shape != tensor.dims:
            return None
        return self.layouts[name].to_logical(self.arrays[name])

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's `value` on rank 0 (None elsewhere)."""
        if self.rank != 0:
            self.transport.send_object(value, 0, TAG_GATHER)
            return None
        out = [value]
        for src in range(1, self.nranks):
            request = self.transport.recv_object(src, TAG_GATHER)
            out.append(wait_object(request, src, "gathering records", 0, self.stall_timeout))
        return out

    def step_extras(self) -> dict[str, Any]:
        return {"bytes_sent": self.last_bytes_sent, "bytes_planned": self.last_bytes_planned}

    def resident(self) -> dict[str, np.ndarray] | None:
        """Parameters and state, whole and logical, on rank 0 (None elsewhere).

        Each home cell is sent by its first holder; rank 0 assembles the logical arrays."""
        homes = self._resident_homes or {}
        names = sorted(n for n in self.arrays if self._tensors[n].kind in ("param", "state"))
        parts: list[tuple[str, Rect, np.ndarray]] = []
        pending = []
        for name in names:
            tensor = self._tensors[name]
            for part, holders in homes[name].held(tensor.rect):
                if not holders:
                    continue
                sender = holders[0]
                if sender == self.rank:
                    block = self.layouts[name].to_logical(self.view(name, part))
                    if self.rank == 0:
                        parts.append((name, part, block))
                    else:
                        self.transport.send_object((name, part, block), 0, TAG_RESIDENT)
                elif self.rank == 0:
                    pending.append((self.transport.recv_object(sender, TAG_RESIDENT), sender))
        if self.rank != 0:
            return None
        for request, sender in pending:
            parts.append(
                wait_object(request, sender, "gathering a checkpoint", 0, self.stall_timeout)
            )
        out = {
            name: np.zeros(self._tensors[name].dims, NUMPY_DTYPES[self._tensors[name].dtype])
            for name in names
        }
        for name, part, block in parts:
            out[name][part.to_slices()] = block
        return out

    def load_resident(self, arrays: dict[str, np.ndarray]) -> None:
        """Set this rank's parts of parameters and state from whole logical arrays."""
        homes = self._resident_homes or {}
        for name, array in arrays.items():
            tensor = self._tensors.get(name)
            if name not in homes or (tensor is not None and tuple(array.shape) != tensor.dims):
                raise ValueError(f"tensor {name} {list(array.shape)} does not fit this network")
            if name not in self.arrays:
                continue  # held by other ranks only
            box = self.boxes[name]
            self.arrays[name][...] = self.layouts[name].from_logical(
                np.ascontiguousarray(array[box.to_slices()])
            )


class _StepRun:
    """The state of one step on one rank: messages in flight and reduction scratch."""

    def __init__(
        self,
        executor: RankExecutor,
        graph: TaskGraph,
        program: RankProgram,
        ctx: StepContext,
        run_index: int,
    ) -> None:
        self.ex = executor
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

    def _dtype(self, tensor: str):
        return NUMPY_DTYPES[self.graph.tensors[tensor].dtype]

    def _shape(self, tensor: str, rect: Rect) -> tuple[int, ...]:
        return self.ex.layouts[tensor].shape(rect.shape)

    def _event(self, cat: str, name: str, tid: int, start: float, args: dict[str, Any]) -> None:
        if self.recorder is not None:
            self.recorder.add(cat, name, tid, start, self.recorder.now(), args)

    def _now(self) -> float:
        return self.recorder.now() if self.recorder is not None else 0.0

    def post(self, messages: list[Message]) -> None:
        for m in messages:
            tag = self.transport.data_tag(m.seq)
            if m.src == self.rank:
                data = np.array(self.ex.view(m.tensor, m.rect), copy=True, order="C")
                request = self.transport.isend(data, m.dst, tag)
                self.sends.append((request, m.dst, data, m, self._now()))
            if m.dst == self.rank:
                buffer = np.empty(self._shape(m.tensor, m.rect), self._dtype(m.tensor))
                request = self.transport.irecv(buffer, m.src, tag)
                self.inbox[m.seq] = (request, buffer, m, self._now())

    def _wait_messages(self, messages: list[Message], task: Task, why: str) -> None:
        if not messages:
            return
        start = self._now()
        pending = [(self.inbox[m.seq][0], m.src) for m in messages]
        wait(
            pending,
            f"step {self.ctx.step}, task {task.name} ({why})",
            self.rank,
            self.ex.stall_timeout,
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
        self.post(rt.partial_in)
        self._wait_messages(rt.copies_in, task, "halo and copies")
        for m in rt.copies_in:
            _, buffer, _, _ = self.inbox.pop(m.seq)
            self.ex.view(m.tensor, m.rect)[...] = buffer
        scratch: dict[str, tuple[Rect, np.ndarray]] = {}
        start = self._now()
        for piece in rt.pieces:
            self._compute(rt, piece, scratch)
        if rt.pieces:
            self._event(
                "compute",
                task.name,
                COMPUTE,
                start,
                {"step": self.step_label, "task": task.name, "phase": task.phase},
            )
        for m in rt.partial_out:
            rect, contribution = scratch[m.tensor]
            data = np.array(self._part(m.tensor, contribution, rect, m.rect), copy=True)
            request = self.transport.isend(data, m.dst, self.transport.data_tag(m.seq))
            self.sends.append((request, m.dst, data, m, self._now()))
        for tensor, parts in rt.local_parts.items():
            rect, contribution = scratch[tensor]
            for part in parts:
                self.ex.view(tensor, part)[...] += self._part(tensor, contribution, rect, part)
        self._wait_messages(rt.partial_in, task, "partial sums")
        for m in rt.partial_in:
            _, buffer, _, _ = self.inbox.pop(m.seq)
            self.ex.view(m.tensor, m.rect)[...] += buffer
        for collective in rt.collectives:
            self._collective(rt, collective, scratch)
        self.post(rt.post)
        self._progress()

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
            if req.privilege is Privilege.REDUCE and (
                req.tensor in rt.local_parts
                or any(c.reduction.tensor == req.tensor for c in rt.collectives)
            ):
                rect = req.write_rect
                if req.tensor in scratch:
                    raise AssertionError(f"{task.name}: two pieces reduce {req.tensor} here")
                array = np.zeros(self._shape(req.tensor, rect), self._dtype(req.tensor))
                scratch[req.tensor] = (rect, array)
                views[req.role] = array
            elif req.rect is None:
                views[req.role] = np.zeros((0,) * len(self.graph.tensors[req.tensor].dims))
            else:
                views[req.role] = self.ex.view(req.tensor, req.rect)
        run_on_views(task, piece.rect, piece.requirements, views, self.graph.tensors, self.ctx)

    def _collective(self, rt: RankTask, collective, scratch) -> None:
        reduction = collective.reduction
        tensor = reduction.tensor
        dtype = self._dtype(tensor)
        sizes = [rect.volume for rect, _ in collective.targets]
        mine = scratch.get(tensor)
        if mine is not None and len(sizes) == 1 and mine[0] == collective.targets[0][0]:
            # The whole contribution is the vector (a replicated gradient): reduce it in place
            # rather than copy a weight-sized array.
            vector = mine[1].reshape(-1)
        else:
            vector = np.zeros(sum(sizes), dtype)
            offset = 0
            for (rect, _), size in zip(collective.targets, sizes):
                if mine is not None and mine[0].contains(rect):
                    part = self._part(tensor, mine[1], mine[0], rect)
                    vector[offset : offset + size] = part.ravel()
                offset += size
        start = self._now()
        seq = collective.seq
        for hops in collective.rounds:
            received = []
            for hop in hops:
                tag = self.transport.data_tag(seq)
                seq += 1
                if hop.src == self.rank:
                    data = vector[hop.lo : hop.hi].copy()
                    self.sends.append(
                        (self.transport.isend(data, hop.dst, tag), hop.dst, data, None, 0.0)
                    )
                if hop.dst == self.rank:
                    buffer = np.empty(hop.hi - hop.lo, dtype)
                    received.append((self.transport.irecv(buffer, hop.src, tag), hop, buffer))
            wait(
                [(request, hop.src) for request, hop, _ in received],
                f"step {self.ctx.step}, task {rt.task.name} ({reduction.algorithm} of {tensor} "
                f"over ranks {list(reduction.participants)})",
                self.rank,
                self.ex.stall_timeout,
            )
            for _, hop, buffer in received:
                if hop.add:
                    vector[hop.lo : hop.hi] += buffer
                else:
                    vector[hop.lo : hop.hi] = buffer
        offset = 0
        for (rect, holders), size in zip(collective.targets, sizes):
            if self.rank in holders:
                target = self.ex.view(tensor, rect)
                target += vector[offset : offset + size].reshape(target.shape)
            offset += size
        self._event(
            "collective",
            f"{reduction.algorithm} {tensor}",
            COMMUNICATION,
            start,
            {
                "step": self.step_label,
                "task": rt.task.name,
                "tensor": tensor,
                "bytes": reduction.nbytes,
                "algorithm": reduction.algorithm,
                "participants": list(reduction.participants),
            },
        )

    def _progress(self) -> None:
        still = []
        for entry in self.sends:
            request, peer, _, message, posted = entry
            if request.test():
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
        if self.inbox:
            seqs = sorted(self.inbox)
            raise AssertionError(f"rank {self.rank}: messages {seqs[:5]} were never consumed")
        self._progress()
        wait(
            [(request, peer) for request, peer, *_ in self.sends],
            f"step {self.ctx.step}, end of step (sends still in flight)",
            self.rank,
            self.ex.stall_timeout,
        )
        self._progress()
