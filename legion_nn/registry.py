"""The op registry: one declarative record per op, everything the compiler knows about it.

A record says, for each phase the op runs in:

- `access`: its access map, `fn(attrs, dims, piece) -> {role: Rect}` (`legion_nn.access`), which
  also defines the bytes a piece moves: the partitioner's traffic is the bytes of these rects;
- `box_map`: optionally the same map over arrays of pieces (`BoxMap`), an optimisation the
  partitioner checks against `access` before using it;
- `flops`: FLOPs per element of the task's space, `fn(attrs, dims) -> float` (multiply and add
  count as two; 0 for pure data movement);
- `adapter`: the name of the kernel adapter that runs a piece, which the runtime resolves (it
  checks when `runtime.adapters` is imported that every name resolves and that every adapter
  has a record); None says the op has no kernel: it is planned and costed, not run;
- `steps`: optionally, the role of a parameter's gradient that the adapter can, instead of
  storing it, turn straight into the optimizer's step of the parameter (`StepContext.steps`),
  or a function of the task's attrs giving it or None: where nothing else reads the gradient,
  the runtime fuses the update task into this one (`runtime.step.update_fusion`);
- `weight_grad`: optionally, for a backward, `(weight roles, input roles)`: the roles its
  parameters' gradients touch and those the rest (its input's gradient) touches. A
  micro-batched step may then defer the parameters' gradients (`legion_nn.micro_batches`): each
  micro-batch's copy has the input roles only (attr `need_dw` false), and one task over every
  micro-batch's rows has the weight roles, `role@m` for what micro-batch m holds (attr
  `micro_rows`: each micro-batch's rows), its access map this one's with each `role@m` cut to
  micro-batch m's rows (`over_micro_batches`);

and for the op as a whole:

- `splittable`: the dims of the space a partition may cut (`EVERY_DIM`, a tuple, or a function
  of the task's attrs);
- `homing`: where its pieces run: `GRID` (on a grid of their own), `HOME` (where the tensors it
  writes live: data, updates), or `WITH_TENSOR` (homed when the tensor it zeroes is resident);
- `packed_role`: the role whose weights the kernels want in the packed filter layout, or None
  (`packed_tensors`; the layout stores the logical axes in `PACKED_AXES` order);
- `owner_role`: the role whose tensor owns the task's other tensors (an update's parameter owns
  its gradient and optimizer state), or None;
- `passes`: how the machine model rates its phases, `fn(attrs, phase) -> (variant, ((pass,
  share), ...))`, or None for one pass named after the phase; a filter's backward is two passes
  (data and filter gradients) whose rates differ between tied and untied weights;
- `sums_over`: how many trailing dims of the space the op sums over (its *reduction dims*: a
  linear layer's input C, H, W, a filter's input channels; 0 for most ops). The dims before them
  are the output's; a piece covering part of a reduction dim writes partial sums of its output
  (`partitioner.reduction_split`).

Every field must be given, in every phase: `register` raises `RegistryError` naming the op and the
field that is missing, so a new op cannot fall back on a silent default. Records live in one
module per op family (`legion_nn.layers.*`, `legion_nn.importers.batch_access`); importing
`legion_nn.op_records` imports them all. Lookups here see what has been registered so far: a layer's
lowering needs only its own family, which is loaded by then.

An op may be namespaced, `ns.Name`: without a record of its own it uses the record of `ns`
(imported graphs' `chainer.<Type>` tasks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from legion_nn.access import with_rect
from legion_nn.errors import LegionNNError
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.rect import Rect

Dims = Mapping[str, tuple[int, ...]]
AccessFn = Callable[[Mapping[str, Any], Dims, Rect], dict[str, Rect]]
#: the array form of an access map: (attrs, dims, lo, hi) -> {role: (lo, hi)}
BoxMap = Callable[[Mapping[str, Any], Dims, np.ndarray, np.ndarray], dict]
FlopsFn = Callable[[Mapping[str, Any], Dims], float]
PassesFn = Callable[[Mapping[str, Any], str], tuple[str, tuple[tuple[str, float], ...]]]
Splittable = str | tuple[int, ...] | Callable[[Mapping[str, Any]], tuple[int, ...]]

EVERY_DIM = "every dim"
GRID, HOME, WITH_TENSOR = "grid", "home", "with tensor"
HOMINGS = (GRID, HOME, WITH_TENSOR)

#: the packed filter layout stores 8-D filter weights' logical (K, 1, 1, C, R, S, P, Q) axes
#: outermost first in this order: (P, R, Q, K, S, C), the kernels' `WEIGHT_AXES`, then the unit axes
PACKED_AXES = (6, 4, 7, 0, 5, 3, 1, 2)

PHASE_FIELDS = ("access", "flops", "adapter")
OP_FIELDS = ("phases", "splittable", "homing", "packed_role", "owner_role", "passes", "sums_over")


class RegistryError(LegionNNError):
    """A record that is incomplete or contradicts another."""


@dataclass(frozen=True)
class PhaseRecord:
    access: AccessFn
    flops: FlopsFn
    adapter: str | None
    box_map: BoxMap | None = None
    steps: str | Callable[[Mapping[str, Any]], str | None] | None = None
    #: (the roles the parameters' gradients touch, the roles the input's gradient touches)
    weight_grad: tuple[tuple[str, ...], tuple[str, ...]] | None = None


@dataclass(frozen=True)
class OpRecord:
    op: str
    phases: Mapping[str, PhaseRecord]
    splittable: Splittable
    homing: str
    packed_role: str | None
    owner_role: str | None
    passes: PassesFn | None
    sums_over: int

    def phase(self, phase: str) -> PhaseRecord:
        try:
            return self.phases[phase]
        except KeyError:
            raise KeyError(f"op {self.op!r} has no phase {phase!r}") from None


_RECORDS: dict[str, OpRecord] = {}


def _phase_record(op: str, phase: str, fields: Mapping[str, Any]) -> PhaseRecord:
    for name in PHASE_FIELDS:
        if name not in fields:
            raise RegistryError(f"op {op!r} phase {phase!r}: the record has no {name!r}")
    unknown = set(fields) - set(PHASE_FIELDS) - {"box_map", "steps", "weight_grad"}
    if unknown:
        raise RegistryError(f"op {op!r} phase {phase!r}: unknown fields {sorted(unknown)}")
    for name in ("access", "flops"):
        if not callable(fields[name]):
            raise RegistryError(f"op {op!r} phase {phase!r}: {name!r} must be a function")
    adapter = fields["adapter"]
    if adapter is not None and not isinstance(adapter, str):
        raise RegistryError(f"op {op!r} phase {phase!r}: 'adapter' must be a name or None")
    if fields.get("weight_grad") is not None:
        fields = {**fields, "access": over_micro_batches(fields["access"])}
        if fields.get("box_map") is not None:
            fields["box_map"] = boxes_over_micro_batches(fields["box_map"])
    return PhaseRecord(**fields)


def _base_roles(attrs: Mapping[str, Any], dims: Dims) -> tuple[dict, list]:
    """The dims of the roles of a task whose roles `role@m` stand for micro-batch m's
    (`weight_grad`), each base role as tall as the tallest micro-batch; and each role's (base
    role, rows of its micro-batch or None)."""
    rows = attrs["micro_rows"]
    base: dict[str, tuple[int, ...]] = {}
    parts = []
    for role, shape in dims.items():
        name, at, m = role.partition("@")
        if at:
            base[name] = (max(rows), *shape[1:])
            parts.append((role, name, rows[int(m)]))
        else:
            base[name] = shape
            parts.append((role, name, None))
    return base, parts


def over_micro_batches(access: AccessFn) -> AccessFn:
    """`access` for a task whose roles `role@m` read micro-batch m (`weight_grad`): a piece
    of rows [a, b) touches rows [a, b) of each, cut to the micro-batch's rows."""

    def rects(attrs: Mapping[str, Any], dims: Dims, piece: Rect) -> dict[str, Rect]:
        if "micro_rows" not in attrs:
            return access(attrs, dims, piece)
        base, parts = _base_roles(attrs, dims)
        found = access(attrs, base, piece)
        out = {}
        for role, name, rows in parts:
            rect = found[name]
            if rows is not None and not rect.is_empty():
                lo, hi = (
                    (min(rect.lo[0], rows), *rect.lo[1:]),
                    (min(rect.hi[0], rows), *rect.hi[1:]),
                )
                rect = Rect(lo, hi) if hi[0] > lo[0] else Rect.empty(rect.ndim)
            out[role] = rect
        return out

    return rects


def boxes_over_micro_batches(box_map: BoxMap) -> BoxMap:
    """`over_micro_batches` over arrays of pieces."""

    def boxes(attrs: Mapping[str, Any], dims: Dims, lo: np.ndarray, hi: np.ndarray) -> dict:
        if "micro_rows" not in attrs:
            return box_map(attrs, dims, lo, hi)
        base, parts = _base_roles(attrs, dims)
        found = box_map(attrs, base, lo, hi)
        out = {}
        for role, name, rows in parts:
            low, high = found[name]
            if rows is not None:
                low, high = low.copy(), high.copy()
                low[:, 0] = np.minimum(low[:, 0], rows)
                high[:, 0] = np.minimum(high[:, 0], rows)
                empty = high[:, 0] <= low[:, 0]
                low[empty] = 0
                high[empty] = 0
            out[role] = (low, high)
        return out

    return boxes


def register(op: str, **fields: Any) -> OpRecord:
    """Record `op` (fields as in the module docstring; `phases` maps phase to its fields)."""
    for name in OP_FIELDS:
        if name not in fields:
            raise RegistryError(f"op {op!r}: the record has no {name!r}")
    unknown = set(fields) - set(OP_FIELDS)
    if unknown:
        raise RegistryError(f"op {op!r}: unknown fields {sorted(unknown)}")
    if not fields["phases"]:
        raise RegistryError(f"op {op!r}: the record has no phases")
    if fields["homing"] not in HOMINGS:
        raise RegistryError(f"op {op!r}: homing {fields['homing']!r} is not one of {HOMINGS}")
    sums_over = fields["sums_over"]
    if isinstance(sums_over, bool) or not isinstance(sums_over, int) or sums_over < 0:
        raise RegistryError(f"op {op!r}: 'sums_over' must be a count of dims, got {sums_over!r}")
    if op in _RECORDS:
        raise RegistryError(f"op {op!r} is recorded twice")
    phases = {p: _phase_record(op, p, f) for p, f in fields["phases"].items()}
    record = OpRecord(op=op, **{**fields, "phases": phases})
    _RECORDS[op] = record
    return record


def records() -> dict[str, OpRecord]:
    """Every record registered so far, by op."""
    return dict(_RECORDS)


def find_record(op: str) -> OpRecord | None:
    """The record of `op`, else of its namespace (`ns` for `ns.Name`)."""
    record = _RECORDS.get(op)
    if record is None and "." in op:
        record = _RECORDS.get(op.split(".", 1)[0])
    return record


def record_of(op: str) -> OpRecord:
    record = find_record(op)
    if record is None:
        raise KeyError(f"no record for op {op!r}")
    return record


def stepped_role(task: Task) -> str | None:
    """The gradient role whose optimizer step `task`'s kernel can take (`steps`), or None."""
    record = find_record(task.op)
    entry = record.phases.get(task.phase) if record is not None else None
    steps = entry.steps if entry is not None else None
    return steps(task.attrs) if callable(steps) else steps


def weight_grad_roles(task: Task) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(the roles `task`'s parameters' gradients touch, those its input's gradient touches)
    where its op can defer the first (`weight_grad`), else None."""
    record = find_record(task.op)
    entry = record.phases.get(task.phase) if record is not None else None
    return entry.weight_grad if entry is not None else None


def has_access_map(op: str, phase: str) -> bool:
    record = find_record(op)
    return record is not None and phase in record.phases


def access_map(op: str, phase: str) -> AccessFn:
    record = find_record(op)
    if record is None or phase not in record.phases:
        raise KeyError(f"no access map for op {op!r} in phase {phase!r}")
    return record.phases[phase].access


def box_map(op: str, phase: str) -> BoxMap | None:
    """The array form of the access map of `op` in `phase`, if it has one."""
    record = find_record(op)
    if record is None or phase not in record.phases:
        return None
    return record.phases[phase].box_map


def splittable_dims(task: Task) -> tuple[int, ...]:
    splittable = record_of(task.op).splittable
    if splittable == EVERY_DIM:
        return tuple(range(task.space.ndim))
    if callable(splittable):
        return tuple(splittable(task.attrs))
    return tuple(splittable)


def reduction_dims(task: Task) -> tuple[int, ...]:
    """The dims of `task`'s space that it sums over (the last `sums_over` of them)."""
    count = record_of(task.op).sums_over
    return tuple(range(task.space.ndim - count, task.space.ndim))


def output_ndim(task: Task) -> int:
    """How many leading dims of `task`'s space are its output's (the rest it sums over)."""
    return task.space.ndim - record_of(task.op).sums_over


#: what each dim of a task's space is to the built-in strategies: `N` the batch (`data` splits
#: it), `F` features, channels or heads (`model`), `S` positions: rows, columns or tokens
#: (`spatial`), `-` none of them. A task gives its own in attr `axes`; without, its space is
#: (N, C, H, W) followed by the dims it sums over.
IMAGE_AXES = "NFSS"


def axis_roles(task: Task) -> str:
    """The role of each dim of `task`'s space (`IMAGE_AXES`)."""
    axes = task.attrs.get("axes")
    if axes is not None:
        return axes
    ndim = task.space.ndim
    return (IMAGE_AXES + "-" * ndim)[:ndim]


def access_rects(task: Task, dims: Dims, piece: Rect) -> dict[str, Rect]:
    return access_map(task.op, task.phase)(task.attrs, dims, piece)


def piece_requirements(
    task: Task, tensors: Mapping[str, Tensor], piece: Rect
) -> tuple[Requirement, ...]:
    """The requirements of one piece of `task`'s space."""
    dims = task.role_dims(tensors)
    rects = access_rects(task, dims, piece)
    return tuple(with_rect(req, rects[req.role]) for req in task.requirements)


def flops_per_element(task: Task, tensors: Mapping[str, Tensor]) -> float:
    """FLOPs per element of `task`'s space, from its record."""
    dims = task.role_dims(tensors)
    return float(record_of(task.op).phase(task.phase).flops(task.attrs, dims))


def rate_passes(task: Task) -> tuple[str, tuple[tuple[str, float], ...]]:
    """(variant, ((pass, share), ...)): how the machine model rates `task` (`passes`)."""
    passes = record_of(task.op).passes
    if passes is None:
        return "", ((task.phase, 1.0),)
    return passes(task.attrs, task.phase)


def per_element(flops: float) -> FlopsFn:
    """A FLOPs function for an op that costs `flops` per element whatever its attrs and dims."""

    def count(attrs: Mapping[str, Any], dims: Dims) -> float:
        return flops

    return count


def packed_tensors(tasks: Iterable[Task]) -> set[str]:
    """The tensors stored in the packed filter layout: the weights whose op's record asks for it
    (`packed_role`), and the tensors their owner task updates alongside them (`owner_role`: a
    filter's gradient and optimizer state), since the update combines them elementwise."""
    tasks = list(tasks)
    packed: set[str] = set()
    for task in tasks:
        role = record_of(task.op).packed_role
        if role is not None:
            packed.add(task.requirement(role).tensor)
    for task in tasks:
        owner = record_of(task.op).owner_role
        if owner is not None and task.requirement(owner).tensor in packed:
            packed.update(req.tensor for req in task.requirements)
    return packed


def storage_order(ndim: int, packed: bool) -> tuple[int, ...]:
    """A tensor's logical axes in the order its instance stores them, outermost first: a block
    cut along the first axis whose extent exceeds one is contiguous."""
    return PACKED_AXES if packed else tuple(range(ndim))
