"""The rank executor: one rank's share of every step, over any transport.

Given the partitioner's plan, each rank runs its `RankProgram` (see `runtime.step.rank_program`): it
keeps one buffer per resident tensor (data, parameters, optimizer state) over the cells of its home
it holds, and places every other buffer of the step (activations and gradients over the rects its
pieces, halos and messages touch, `RankProgram.boxes`; windows of sharded parameters; message,
collective and scratch buffers) in one arena, each from its first use to its last
(`runtime.step.buffers`); it posts the step's copies as soon as their data exists, runs its pieces
with the kernel adapters (`run_on_views`), sends and adds partial
sums, and runs the plan's collectives hop by hop (`partitioner.collectives`). One rank needs no
special path: its program has no messages.

All ranks plan independently and identically, except the `auto` search, whose time limit could
make ranks disagree: rank 0 searches and sends the grids to the others.

Parameters and state keep one home for the whole run: the homes of the full training batch's plan.
The plans of other batch sizes (the last batch of an epoch, evaluation) are built with those homes,
so a rank that has no piece of a small batch still takes part in the reductions of the parameters
it holds and keeps its copies current.

Failures carry the rank, step and task (`TaskFailure`); waits past the stall timeout name the
ranks still owed a message (`transport.StallError`). One step's run, and the fault injection used
to test both, live in `runtime.rank_step`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph, inference_tasks
from legion_nn.rect import Rect
from partitioner.layout import Layout
from partitioner.machine import Machine
from partitioner.plan import Plan, build_plan
from partitioner.strategy import Strategy, builtin
from partitioner.verify_plan import verify_plan
from runtime.adapters import StepContext
from runtime.aligned import aligned_copy, aligned_zeros
from runtime.grad_clipping import clip_factor, counted_gradients, first_update
from runtime.initial_values import initial_part
from runtime.instances import StorageOrder, choose_storage_orders
from runtime.kernels.step_settings import step_kernel_settings
from runtime.kernels.update import squared_norm
from runtime.process_memory import peak_rss_bytes
from runtime.rank_step import StepRun, fault_from_env
from runtime.step.buffers import Arena, StepBuffers, step_buffers
from runtime.step.programs import build_programs
from runtime.step.rank_program import RankProgram
from runtime.tracing import Recorder
from runtime.transport import (
    GroupAborted,
    PeerLost,
    StallError,
    ThreadTransport,
    Transport,
    wait_object,
)

TAG_BROADCAST, TAG_GATHER, TAG_RESIDENT, TAG_VALUE, TAG_SUM = 1, 2, 3, 4, 5


class NotOfThisNetwork(ValueError):
    """Parameters or state given to start from (`prepare`, `load_resident`) that the network
    does not hold, or holds in another shape."""


class TaskFailure(LegionNNError):
    def __init__(self, rank: int, step: int, task: str, error: BaseException) -> None:
        self.rank, self.step, self.task, self.error = rank, step, task, error
        super().__init__(f"rank {rank}: step {step}, task {task}: {type(error).__name__}: {error}")


@dataclass
class _Prepared:
    #: held so that the graph's id, the cache key, stays its own while cached
    graph: TaskGraph
    plan: Plan
    step: RankProgram
    inference: RankProgram
    #: where each program's step buffers live in the arena
    buffers: dict[int, StepBuffers]
    #: per small tensor `RankExecutor.value` was asked for, the rank holding it whole
    value_holders: dict[str, int] = field(default_factory=dict)
    #: with clipping: the gradient pieces this rank counts in the norm, and the position in
    #: the step's program where it is taken (`runtime.grad_clipping`)
    counted: list[tuple[str, Rect]] = field(default_factory=list)
    norm_at: int = 0


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
        verify_plans: bool = False,
        keep_step_tensors: bool = False,
        read_after: Collection[str] = (),
        clip_grad_norm: float | None = None,
    ) -> None:
        self.transport = transport
        #: check every plan with `verify_plan` before running it (`train --verify`)
        self.verify_plans = verify_plans
        #: keep every step tensor until the step ends, unshared, to read them after it (tests
        #: and debugging), gradients included (no update is fused into the kernel that computes
        #: its gradient); otherwise each lives from its first use to its last
        self.keep_step_tensors = keep_step_tensors
        #: step tensors read after each step (`gathered`: a prediction's outputs), which live
        #: to the step's end rather than to their last use
        self.read_after = frozenset(read_after)
        #: scale every step's gradients to this norm over all parameters at most
        #: (`runtime.grad_clipping`); None: no clipping
        self.clip_grad_norm = clip_grad_norm
        #: the norm of the last training step's gradients, where clipped
        self.last_grad_norm: float | None = None
        self.rank, self.nranks = transport.rank, transport.size
        self.strategy_spec = strategy
        self.machine = machine or Machine()
        self.seed = seed
        self.stall_timeout = stall_timeout
        self.recorder = recorder
        self.on_task = on_task
        self.fault = fault_from_env()
        self.arrays: dict[str, np.ndarray] = {}
        self.boxes: dict[str, Rect] = {}
        self.layouts: dict[str, StorageOrder] = {}
        self._prepared: dict[int, _Prepared] = {}
        self._strategy: Strategy | None = None
        self._resident_homes: dict[str, Layout] | None = None
        self._tensors: dict[str, Any] = {}
        #: every tensor of every graph planned, by name
        self._known: dict[str, Any] = {}
        self._sent_at_step_start = 0
        self.last_bytes_planned = 0
        self.last_bytes_sent = 0
        #: seconds the last step spent in its kernels (`StepRun.compute_seconds`)
        self.last_compute_seconds = 0.0
        #: programs run so far: every rank runs the same sequence, so (run, seq) names a message
        self.runs = 0
        #: the step buffers of every program (`runtime.step.buffers`)
        self.arena = Arena()
        #: per program, its step tensors' views of the arena (and the arena's generation)
        self._views: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        #: the program, and the arena's generation, whose views `arrays` holds now
        self._bound: tuple[int, int] | None = None
        #: the graph whose resident tensors `arrays` holds now
        self._allocated: TaskGraph | None = None
        self._buffer_peak = 0
        #: the key of the graph prepared last, whose program runs next (`value` reads its
        #: tensors)
        self._bound_graph: int | None = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    # Planning.

    def strategy(self, graph: TaskGraph) -> Strategy:
        """The run's strategy, chosen once on the first graph (the training batch's)."""
        if self._strategy is None:
            spec = self.strategy_spec
            if callable(spec):
                self._strategy = self.broadcast(lambda: spec(graph, self.nranks), "the strategy")
            else:
                self._strategy = builtin(graph, spec, self.nranks)
        return self._strategy

    def settle(self, strategy: Strategy) -> None:
        """Run `strategy`, chosen already (on every rank alike), rather than choose one."""
        self._strategy = strategy

    def broadcast(self, make: Callable[[], Any], what: str) -> Any:
        """What rank 0 makes, on every rank (`what` names it to a rank left waiting): a
        choice of rank 0's, which may take as long as a search (10 minutes at most)."""
        if self.rank == 0:
            value = make()
            for dst in range(1, self.nranks):
                self.transport.send_object(value, dst, TAG_BROADCAST)
            return value
        request = self.transport.recv_object(0, TAG_BROADCAST)
        return wait_object(request, 0, f"waiting for {what}", self.rank, 600)

    def plan(self, graph: TaskGraph) -> Plan:
        return self.prepare(graph).plan

    def prepare(
        self, graph: TaskGraph, initial: Mapping[str, np.ndarray] | None = None
    ) -> _Prepared:
        """Plan `graph` and allocate what it needs; `initial`: whole logical arrays of
        parameters and state to start from (a checkpoint's, an imported model's), as
        `load_resident` sets them, which the tensors this allocates take in place of their
        initial draws (VGG-19's 140 million weights: 2.5 s drawn and 0.6 s copied, for
        nothing, on the 2-core VM)."""
        key = id(graph)
        prepared = self._prepared.get(key)
        if prepared is None:
            strategy = self.strategy(graph)
            plan = build_plan(graph, strategy, self.nranks, self._resident_homes)
            if self.verify_plans:
                verify_plan(graph, plan)
            if self._resident_homes is None:
                self._resident_homes = {
                    name: home
                    for name, home in plan.homes.items()
                    if graph.tensors[name].kind != "data"
                }
            inference = {task.name for task in inference_tasks(graph)}
            # keeping step tensors to read is keeping gradients, and clipping reads every
            # gradient before any update: no update fused into a kernel
            fuse = not self.keep_step_tensors and self.clip_grad_norm is None
            step = build_programs(graph, plan, self.machine, [self.rank], fuse_updates=fuse)[
                self.rank
            ]
            infer = build_programs(graph, plan, self.machine, [self.rank], inference)[self.rank]
            layouts = choose_storage_orders(graph)
            keep = self.keep_step_tensors
            placed = {
                id(p): step_buffers(graph, p, layouts, keep, self.read_after) for p in (step, infer)
            }
            prepared = self._prepared[key] = _Prepared(graph, plan, step, infer, placed)
            if self.clip_grad_norm is not None:
                prepared.counted = counted_gradients(graph, plan, self.rank)
                prepared.norm_at = first_update(step)
            self.arena.reserve(max(b.size for b in placed.values()))
        if initial is not None:
            self._check_fits(initial, graph.tensors)
        taken = self._allocate(graph, prepared.step, initial or {})
        if initial is not None:
            self._copy_in({n: a for n, a in initial.items() if n not in taken})
        self._bind(graph, prepared.step, prepared.buffers[id(prepared.step)])
        self._bound_graph = key
        return prepared

    def _allocate(
        self, graph: TaskGraph, program: RankProgram, initial: Mapping[str, np.ndarray]
    ) -> set[str]:
        """The resident tensors' buffers: kept across steps (every other tensor lives in the
        arena, bound to a program's buffers when it runs). A parameter or state allocated here
        starts from its array in `initial`, else from its initial draw; returns the names that
        took theirs from `initial`."""
        taken: set[str] = set()
        if self._allocated is graph:
            return taken
        self._allocated = graph
        self._bound = None  # data tensors may have been dropped or replaced
        self._known.update(graph.tensors)
        layouts = choose_storage_orders(graph)
        for name in sorted(graph.tensors):
            tensor = graph.tensors[name]
            self.layouts.setdefault(name, layouts[name])
            box = program.boxes.get(name)
            if not tensor.resident or box is None:
                if tensor.kind == "data":
                    self._drop(name)
                continue
            layout = self.layouts[name]
            if name in self.arrays and self.boxes[name] == box:
                continue
            if tensor.kind in ("param", "state"):
                if name in self.arrays:
                    raise AssertionError(f"the home of {name} moved from {self.boxes[name]!r}")
                if name in initial:
                    part = initial[name][box.to_slices()].astype(tensor.dtype, copy=False)
                    taken.add(name)
                else:
                    stream = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
                    part = initial_part(tensor, stream, box)
                self.arrays[name] = aligned_copy(layout.from_logical(np.ascontiguousarray(part)))
            else:
                shape = layout.shape(box.shape)
                self.arrays[name] = aligned_zeros(shape, np.dtype(tensor.dtype))
            self.boxes[name] = box
            self._tensors[name] = tensor
        return taken

    def _drop(self, name: str) -> None:
        self.arrays.pop(name, None)
        self.boxes.pop(name, None)

    def _bind(self, graph: TaskGraph, program: RankProgram, buffers: StepBuffers) -> None:
        """Point every step tensor of `program` at its place in the arena. The views are made
        once per program and arena (`_views`); binding the program bound last is free."""
        bound = (id(program), self.arena.generation)
        if self._bound == bound:
            return
        views = self._views.get(id(program))
        if views is None or views[0] != self.arena.generation:
            views = self._views[id(program)] = (self.arena.generation, {})
            for name, tensor in graph.tensors.items():
                if ("tensor", name) in buffers.slots:
                    shape = self.layouts[name].shape(program.boxes[name].shape)
                    dtype = np.dtype(tensor.dtype)
                    view = self.arena.view(buffers, ("tensor", name), shape, dtype)
                    views[1][name] = view
        for name, tensor in graph.tensors.items():
            if tensor.resident:
                continue
            if name not in views[1]:
                self._drop(name)
                continue
            self.arrays[name] = views[1][name]
            self.boxes[name] = program.boxes[name]
            self._tensors[name] = tensor
        self._bound = bound

    def view(self, name: str, rect: Rect) -> np.ndarray:
        if rect.is_empty():  # e.g. softmax.grad's empty read of the loss gradient
            layout = self.layouts.get(name, StorageOrder("logical"))
            return np.zeros(layout.shape(rect.shape), np.dtype(self._known[name].dtype))
        box = self.boxes[name]
        if not box.contains(rect):
            raise AssertionError(f"{rect!r} of {name} lies outside this rank's {box!r}")
        return self.arrays[name][self.layouts[name].slices(rect.relative_to(box))]

    # Running.

    def run(self, graph: TaskGraph, ctx: StepContext) -> StepContext:
        prepared = self.prepare(graph)
        self._execute(prepared, prepared.step, ctx)
        return ctx

    def run_inference(self, graph: TaskGraph, ctx: StepContext) -> StepContext:
        prepared = self.prepare(graph)
        self._execute(prepared, prepared.inference, ctx)
        return ctx

    def _execute(self, prepared: _Prepared, program: RankProgram, ctx: StepContext) -> None:
        self.runs += 1
        graph, buffers = prepared.graph, prepared.buffers[id(program)]
        self._bind(graph, program, buffers)
        run = StepRun(self, graph, program, buffers, ctx, self.runs)
        sent_before = self.transport.bytes_sent
        run.post(program.post_at_start)
        clipping = self.clip_grad_norm is not None and program is prepared.step
        with step_kernel_settings():  # once per step, not once per kernel
            for rank_task in program.tasks:
                if clipping and rank_task.index == prepared.norm_at:
                    self._clip(run, prepared)
                if self.on_task:
                    self.on_task(ctx.step, rank_task.task.name)
                try:
                    run.task(rank_task)
                except (TaskFailure, StallError, PeerLost, GroupAborted):
                    raise
                except Exception as exc:
                    raise TaskFailure(self.rank, ctx.step, rank_task.task.name, exc) from exc
            if clipping and prepared.norm_at == len(program.tasks):
                self._clip(run, prepared)  # no update here: this rank's share of the norm
            run.finish()
        self.last_bytes_sent = self.transport.bytes_sent - sent_before
        self.last_bytes_planned = program.bytes_planned
        self.last_compute_seconds = run.compute_seconds

    def _clip(self, run: StepRun, prepared: _Prepared) -> None:
        """Every gradient summed: the norm over all of them, and the updates' factor."""
        run.complete_collectives()
        mine = sum((squared_norm(self.view(t, rect)) for t, rect in prepared.counted), 0.0)
        norm = math.sqrt(self.sum_over_ranks(mine, f"step {run.ctx.step}, the gradients' norm"))
        run.ctx = replace(run.ctx, grad_scale=clip_factor(norm, self.clip_grad_norm))
        self.last_grad_norm = norm

    def sum_over_ranks(self, value: float, what: str) -> float:
        """The sum of every rank's `value`, on every rank: added on rank 0 in rank order, so
        every rank gets the same bits (`what` names the wait to a stalled rank)."""
        if self.nranks == 1:
            return value
        if self.rank != 0:
            self.transport.send_object(value, 0, TAG_SUM)
            request = self.transport.recv_object(0, TAG_SUM)
            return wait_object(request, 0, what, self.rank, self.stall_timeout)
        total = value
        for src in range(1, self.nranks):
            request = self.transport.recv_object(src, TAG_SUM)
            total += wait_object(request, src, what, 0, self.stall_timeout)
        for dst in range(1, self.nranks):
            self.transport.send_object(total, dst, TAG_SUM)
        return total

    # Values, checkpoints and log records.

    def value(self, name: str) -> np.ndarray | None:
        """A whole small tensor of the step just run (the loss, evaluate's sums) on rank 0 (None
        elsewhere): the rank holding it (a pipeline's last stage) sends it there. Every rank
        calls it alike."""
        prepared = self._prepared[self._bound_graph]
        holder = prepared.value_holders.get(name)
        if holder is None:
            tensor = prepared.graph.tensors[name]
            found = next(prepared.plan.layouts[name].held(tensor.rect), (None, ()))[1]
            holder = prepared.value_holders[name] = 0 if 0 in found or not found else found[0]
        if self.rank == holder:
            local = self._whole(name)
            if holder == 0:
                return local
            self.transport.send_object(local, 0, TAG_VALUE)
        elif self.rank == 0:
            request = self.transport.recv_object(holder, TAG_VALUE)
            return wait_object(request, holder, f"waiting for {name}", 0, self.stall_timeout)
        return None

    def _whole(self, name: str) -> np.ndarray | None:
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
        """Bytes sent and planned in the last step, and the seconds it computed (the rest of a
        step a rank waits, posts and copies); the most the runtime's buffers have held
        (the resident tensors' arrays on this rank and the arena of its step buffers: both are
        allocated before their first use and kept, so the peak is what is held after the step);
        the process's peak resident set."""
        held = self.resident_bytes() + self.arena.nbytes
        self._buffer_peak = max(self._buffer_peak, held)
        return {
            "bytes_sent": self.last_bytes_sent,
            "bytes_planned": self.last_bytes_planned,
            "compute_seconds": self.last_compute_seconds,
            "buffer_peak_bytes": self._buffer_peak,
            "rss_peak_bytes": peak_rss_bytes(),
        }

    def resident_bytes(self) -> int:
        """Bytes of the resident tensors' buffers on this rank."""
        return sum(a.nbytes for n, a in self.arrays.items() if self._tensors[n].resident)

    def resident(self) -> dict[str, np.ndarray] | None:
        """Parameters and state, whole and logical, on rank 0 (None elsewhere)."""
        homes = self._resident_homes or {}
        # every rank names every parameter: a pipeline's stages each hold their own layers'
        names = sorted(n for n in homes if self._known[n].kind in ("param", "state"))
        return self._assemble({name: homes[name] for name in names}, "gathering a checkpoint")

    def gathered(self, name: str) -> np.ndarray | None:
        """A step tensor of the step just run (named in `read_after`), whole and logical, on
        rank 0 (None elsewhere), from the parts the ranks hold after the step."""
        plan = self._prepared[self._bound_graph].plan
        whole = self._assemble({name: plan.layouts[name]}, f"gathering {name}")
        return None if whole is None else whole[name]

    def _assemble(self, layouts: Mapping[str, Layout], what: str) -> dict | None:
        """The tensors laid out as `layouts` say, whole and logical, on rank 0 (None
        elsewhere): each cell is sent by its first holder, and rank 0 assembles the arrays."""
        parts: list[tuple[str, Rect, np.ndarray]] = []
        pending = []
        for name, layout in layouts.items():
            tensor = self._known[name]
            for part, holders in layout.held(tensor.rect):
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
            parts.append(wait_object(request, sender, what, 0, self.stall_timeout))
        out = {
            name: np.zeros(self._known[name].dims, np.dtype(self._known[name].dtype))
            for name in layouts
        }
        for name, part, block in parts:
            out[name][part.to_slices()] = block
        return out

    def load_resident(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Set this rank's parts of parameters and state from whole logical arrays."""
        self._check_fits(arrays, self._known)
        self._copy_in(arrays)

    def _check_fits(self, arrays: Mapping[str, np.ndarray], tensors: Mapping[str, Any]) -> None:
        """`NotOfThisNetwork` naming the first of `arrays` that is not a parameter or state of
        the graphs planned, or not of its shape (in `tensors`)."""
        homes = self._resident_homes or {}
        for name, array in arrays.items():
            tensor = tensors.get(name)
            if name not in homes or (tensor is not None and tuple(array.shape) != tensor.dims):
                raise NotOfThisNetwork(
                    f"tensor {name} {list(array.shape)} does not fit this network"
                )

    def _copy_in(self, arrays: Mapping[str, np.ndarray]) -> None:
        for name, array in arrays.items():
            if name not in self.arrays:
                continue  # held by other ranks only
            box = self.boxes[name]
            self.arrays[name][...] = self.layouts[name].from_logical(
                np.ascontiguousarray(array[box.to_slices()])
            )


def one_process(seed: int = 0, strategy: str = "data", **options: Any) -> RankExecutor:
    """The executor of a run in one process: rank 0 of 1 over the in-process transport."""
    (transport,) = ThreadTransport.group(1)
    return RankExecutor(transport, strategy, seed=seed, **options)
