"""Access maps: for a piece of a task's iteration space, the rect each requirement touches.

Every (op, phase) registers one function ``fn(attrs, dims, piece) -> {role: Rect}``, where `dims`
maps each role to the dims of the tensor bound to it. Lowering builds a task's requirements by
applying its access map to the whole space; the partitioner applies the same map to each piece, so
halos, weight slices and reduction targets all come from one place.

The table also records which dims of the space may be cut (`splittable`): a softmax cannot be cut
across its classes, a reshape only across the batch. Where that depends on the task, `splittable`
is a function of the task's attrs.

An op may be namespaced, `ns.Name`: without an entry of its own it uses the entry of `ns`. Imported
graphs use this: every `chainer.<Type>` task has the batch-parallel map registered as `chainer`
(`legion_nn.importers.batch_access`), and a map for one type can still be registered on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.rect import Rect

AccessFn = Callable[[Mapping[str, Any], Mapping[str, tuple[int, ...]], Rect], dict[str, Rect]]
Splittable = tuple[int, ...] | Callable[[Mapping[str, Any]], tuple[int, ...]] | None


@dataclass(frozen=True)
class AccessEntry:
    fn: AccessFn
    splittable: Splittable  # None: every dim of the space; a function: of the task's attrs


_TABLE: dict[tuple[str, str], AccessEntry] = {}


def register(op: str, phase: str, splittable: Splittable = None):
    """Decorator: make `fn` the access map of `op` in `phase`."""

    def wrap(fn: AccessFn) -> AccessFn:
        _TABLE[(op, phase)] = AccessEntry(fn, splittable)
        return fn

    return wrap


def _register_all() -> None:
    """Import the modules that register maps: every layer's, and the imported functions'."""
    import legion_nn.importers.batch_access
    import legion_nn.layers  # noqa: F401


def _lookup(op: str, phase: str) -> AccessEntry | None:
    """The entry of `op`, else of its namespace (`ns` for `ns.Name`)."""
    _register_all()
    entry = _TABLE.get((op, phase))
    if entry is None and "." in op:
        entry = _TABLE.get((op.split(".", 1)[0], phase))
    return entry


def _entry(op: str, phase: str) -> AccessEntry:
    entry = _lookup(op, phase)
    if entry is None:
        raise KeyError(f"no access map for op {op!r} in phase {phase!r}")
    return entry


def access_map(op: str, phase: str) -> AccessFn:
    return _entry(op, phase).fn


def has_access_map(op: str, phase: str) -> bool:
    return _lookup(op, phase) is not None


def splittable_dims(task: Task) -> tuple[int, ...]:
    entry = _entry(task.op, task.phase)
    if entry.splittable is None:
        return tuple(range(task.space.ndim))
    if callable(entry.splittable):
        return tuple(entry.splittable(task.attrs))
    return entry.splittable


def access_rects(task: Task, dims: Mapping[str, tuple[int, ...]], piece: Rect) -> dict[str, Rect]:
    return _entry(task.op, task.phase).fn(task.attrs, dims, piece)


def with_rect(req: Requirement, rect: Rect) -> Requirement:
    """The requirement with its rect(s) replaced, keeping the privilege's read/write shape."""
    return replace(
        req,
        read_rect=rect if req.privilege.reads else None,
        write_rect=rect if req.privilege.writes else None,
    )


def piece_requirements(
    task: Task, tensors: Mapping[str, Tensor], piece: Rect
) -> tuple[Requirement, ...]:
    """The requirements of one piece of `task`'s space."""
    dims = {req.role: tensors[req.tensor].dims for req in task.requirements}
    rects = access_rects(task, dims, piece)
    return tuple(with_rect(req, rects[req.role]) for req in task.requirements)


# Shared building blocks for the layers' maps.


def window_span(lo: int, hi: int, stride: int, pad: int, size: int, extent: int) -> tuple[int, int]:
    """Input rows read by output rows [lo, hi) of a window `size` wide, clipped to the input.

    Padding rows are zeros that exist in no tensor, so they are never read.
    """
    if hi <= lo:
        return (0, 0)
    first = lo * stride - pad
    last = (hi - 1) * stride - pad + size
    first, last = max(first, 0), min(last, extent)
    return (first, last) if first < last else (0, 0)


def window_padding(
    lo: int, hi: int, stride: int, pad: int, size: int, extent: int
) -> tuple[int, int]:
    """The zero rows before and after the clipped `window_span` that output rows [lo, hi) need.

    A kernel given the clipped halo and this padding computes exactly rows [lo, hi): interior
    pieces get (0, 0), border pieces the part of the layer's padding on their side.
    """
    if hi <= lo:
        return (0, 0)
    first = lo * stride - pad
    last = (hi - 1) * stride - pad + size
    return (max(0, -first), max(0, last - extent))


def elementwise(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    """The access map of an elementwise op: every role touches exactly the piece."""
    return {role: piece for role in ("input", "output", "output.delta", "input.delta")}


def batch_rows(piece: Rect, dims: tuple[int, ...]) -> Rect:
    """All of a tensor for the batch rows of `piece` (its dim 0)."""
    if piece.is_empty():
        return Rect.empty(len(dims))
    return Rect((piece.lo[0],) + (0,) * (len(dims) - 1), (piece.hi[0],) + tuple(dims[1:]))


def whole(dims: tuple[int, ...], piece: Rect) -> Rect:
    """The whole tensor, or nothing when the piece is empty."""
    return Rect.empty(len(dims)) if piece.is_empty() else Rect.from_dims(dims)
