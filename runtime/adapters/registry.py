"""The adapter registry: `adapter(name)` registers a kernel adapter under the name that op records
give (`legion_nn.registry`: each phase's `adapter`); `run_piece` runs a task's piece with it.

`resolve_adapters` checks both ways when `runtime.adapters` is imported: every name a record gives
resolves to a registered adapter, and every registered adapter is named by some record, so an op
cannot run without a record nor a record promise a kernel that does not exist.

See `runtime.adapters` for the contract between adapters, views and privileges.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from legion_nn.ir import Task
from legion_nn.op_records import OpRecord, RegistryError
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from runtime.kernels.update import OptimizerStep


@dataclass
class StepContext:
    """What a step's tasks need besides tensors: its number, its batch, and returned values."""

    step: int
    #: False for evaluation: dropout passes its input through, batchnorm uses running statistics
    training: bool = True
    inputs: np.ndarray | None = None
    labels: np.ndarray | None = None
    futures: dict[str, Any] = field(default_factory=dict)
    #: roles of the piece at hand whose `reduce` view holds no sum yet, not even zeros (its
    #: zeroing was elided, `RankTask.fresh`): the adapter writes every element of them, by
    #: returning them or by writing them in place, rather than adding
    fresh: frozenset[str] = frozenset()
    #: roles of the piece at hand (a gradient, its op's `stepped_role`) that get no view: the
    #: adapter takes the optimizer's step of their parameter from them, block by block, in
    #: place of storing them (an update fused into the task, `RankTask.steps`)
    steps: Mapping[str, OptimizerStep] = field(default_factory=dict)
    #: the learning-rate schedule's factor at this step (`runtime.lr_schedule`)
    lr_scale: float = 1.0
    #: the factor on every gradient the updates take: gradient clipping's
    #: (`runtime.grad_clipping`), found once every gradient of the step is summed
    grad_scale: float = 1.0


Views = Mapping[str, np.ndarray]
Dims = Mapping[str, tuple[int, ...]]
Adapter = Callable[[Task, Rect, Views, Dims, StepContext], dict[str, np.ndarray]]
#: adapters by name
ADAPTERS: dict[str, Adapter] = {}
#: adapters by (op, phase), as the records name them (`resolve_adapters`)
BY_OP: dict[tuple[str, str], Adapter] = {}


def in_place(
    task: Task, views: Views, ctx: StepContext, role: str
) -> tuple[np.ndarray | None, bool]:
    """(the view of `role` a kernel writes its result straight into, whether it adds to what the
    view holds: a sum over pieces that is not fresh), or (None, False) where the view is strided
    and the adapter returns the result instead (`run_on_views` writes or adds it)."""
    view = views.get(role)
    if view is None or not view.flags.c_contiguous:
        return None, False
    adds = task.requirement(role).privilege is Privilege.REDUCE and role not in ctx.fresh
    return view, adds


def written_in_place(task: Task, views: Views, ctx: StepContext, role: str) -> np.ndarray | None:
    """The view of `role` a kernel that only writes (never adds) puts its result straight into,
    or None where the adapter returns the result instead: a strided view, or a sum over pieces
    that adds to what the view holds (`in_place`)."""
    view, adds = in_place(task, views, ctx, role)
    return None if adds else view


def micro_batches_joined(task: Task, views: Views) -> Views:
    """`views`, where `task` computes weight gradients deferred over micro-batches (attr
    `micro_rows`, `legion_nn.micro_batches`), with each `role@m`'s rows put together under the
    role's name in the order of the task's requirements, the same for every role (a piece
    reading none of a shorter micro-batch's rows has no view of it); the views as they are for
    any other task."""
    if "micro_rows" not in task.attrs:
        return views
    joined: dict[str, np.ndarray] = {}
    parts: dict[str, list[np.ndarray]] = {}
    for role, view in views.items():
        name, at, _ = role.partition("@")
        if at:
            parts.setdefault(name, []).append(view)
        else:
            joined[role] = view
    for name, found in parts.items():
        rows = [v for v in found if v.shape[0]] or found[:1]
        joined[name] = rows[0] if len(rows) == 1 else np.concatenate(rows)
    return joined


def adapter(name: str):
    """Decorator: register `fn` as the adapter called `name`."""

    def wrap(fn: Adapter) -> Adapter:
        if name in ADAPTERS:
            raise RegistryError(f"adapter {name!r} is registered twice")
        ADAPTERS[name] = fn
        return fn

    return wrap


def resolve_adapters(
    records: Mapping[str, OpRecord], adapters: Mapping[str, Adapter]
) -> dict[tuple[str, str], Adapter]:
    """Each recorded (op, phase)'s adapter; a name that resolves to none, or an adapter that no
    record names, is a `RegistryError`."""
    found: dict[tuple[str, str], Adapter] = {}
    for op, record in records.items():
        for phase, entry in record.phases.items():
            if entry.adapter is None:
                continue
            if entry.adapter not in adapters:
                raise RegistryError(
                    f"op {op!r} phase {phase!r}: no adapter {entry.adapter!r} is registered"
                )
            found[(op, phase)] = adapters[entry.adapter]
    named = {entry.adapter for record in records.values() for entry in record.phases.values()}
    unnamed = sorted(set(adapters) - named)
    if unnamed:
        raise RegistryError(f"adapters {unnamed} are named by no op record")
    return found


def run_piece(task: Task, piece: Rect, views: Views, dims: Dims, ctx: StepContext) -> dict:
    try:
        fn = BY_OP[(task.op, task.phase)]
    except KeyError:
        raise NotImplementedError(f"no kernel for op {task.op!r} in phase {task.phase!r}") from None
    return fn(task, piece, views, dims, ctx)
