"""Merge layers: `add` (a residual connection) and `concat` (channels), reading two or more groups'
outputs (`Layer.inputs`).

`add`: y = x0 + x1 + ..., inputs of one shape. Its task iterates over the output and touches the
same rect of every input; the backward adds the output's gradient into each input's gradient
(roles `input0`, `input1`, ... and their `.delta`s).

`concat`: y (N, C0 + C1 + ..., H, W) holds the inputs one after another along the channels. A
piece of the output reads, of input i, the channels of [offset_i, offset_i + C_i) it covers, moved
to input i's own coordinates: nothing where it covers none of them. So a model split cuts the
output's channels as it would any other, and each piece fetches only its inputs' channels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from legion_nn import registry
from legion_nn.access import elementwise_boxes
from legion_nn.errors import ShapeError
from legion_nn.layers.base import Layer, Shape, layer_kind, sequence_axes
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


def input_role(index: int) -> str:
    return f"input{index}"


def _add_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    """Every role touches the piece."""
    return {role: piece for role in dims}


def _per_output(scale: str):
    """FLOPs per output element: the forward's k - 1 additions, or the backward's k
    accumulations into the inputs' gradients."""

    def flops(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> float:
        return float(attrs["count"] - (1 if scale == "forward" else 0))

    return flops


def _register(op: str, access, box_map, flops) -> None:
    """A merge op's record: `flops(phase)` gives each phase's FLOPs function."""
    registry.register(
        op,
        phases={
            phase: {
                "access": access,
                "box_map": box_map,
                "flops": flops(phase),
                "adapter": f"{op}.{phase}",
            }
            for phase in ("forward", "backward")
        },
        splittable=registry.EVERY_DIM,
        homing=registry.GRID,
        packed_role=None,
        owner_role=None,
        passes=None,
        sums_over=0,
    )


_register("add", _add_rects, elementwise_boxes, _per_output)


def channel_offsets(attrs: Mapping[str, Any]) -> list[int]:
    """Where each input's channels start in a concat's output, and (last) the output's channels."""
    return [0, *accumulate(attrs["channels"])]


def _concat_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    """The piece of the output, and of each input the channels of it the piece covers."""
    offsets = channel_offsets(attrs)
    out = {"output": piece, "output.delta": piece}
    for index in range(len(attrs["channels"])):
        first, last = max(piece.lo[1], offsets[index]), min(piece.hi[1], offsets[index + 1])
        rect = Rect.empty(piece.ndim)
        if first < last and not piece.is_empty():
            lo, hi = list(piece.lo), list(piece.hi)
            lo[1], hi[1] = first - offsets[index], last - offsets[index]
            rect = Rect(lo, hi)
        out[input_role(index)] = out[f"{input_role(index)}.delta"] = rect
    return {role: out[role] for role in dims}


def _concat_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`_concat_rects` over arrays of pieces."""
    offsets = channel_offsets(attrs)
    out = {"output": (lo, hi), "output.delta": (lo, hi)}
    for index in range(len(attrs["channels"])):
        first = np.maximum(lo[:, 1], offsets[index]) - offsets[index]
        last = np.minimum(hi[:, 1], offsets[index + 1]) - offsets[index]
        covered = first < last
        part_lo, part_hi = lo.copy(), hi.copy()
        part_lo[:, 1], part_hi[:, 1] = first, last
        part_lo[~covered] = 0
        part_hi[~covered] = 0
        out[input_role(index)] = out[f"{input_role(index)}.delta"] = (part_lo, part_hi)
    return {role: out[role] for role in dims}


# a copy: one move per element
_register("concat", _concat_rects, _concat_boxes, lambda phase: registry.per_element(1))


@dataclass
class MergeLayer(Layer):
    """A layer of one op over the output of several inputs, each needing its gradient."""

    MERGES = True
    RANKS = (2, 3)

    def attrs(self, shapes: tuple[Shape, ...]) -> dict[str, Any]:
        raise NotImplementedError

    def lower(self, ctx, x: tuple[str, ...], shape: tuple[Shape, ...]) -> str:
        twice = [t for i, t in enumerate(x) if t in x[:i]]
        if twice:
            raise ShapeError(f"{self.label}: reads {twice[0]} twice; inputs must be distinct")
        op = self.OP_NAME or self.KIND
        dims = (ctx.batch,) + tuple(self.out_shape(shape))
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        attrs = {**self.attrs(shape), **sequence_axes(shape[0])}
        reads = [(input_role(i), t, R_) for i, t in enumerate(x)]
        ctx.task(self.stem, op, "forward", space, reads + [("output", y, W_)], self.name, attrs)

        def backward() -> None:
            grads = [
                (f"{input_role(i)}.delta", ctx.grad(t), RD)
                for i, t in enumerate(x)
                if ctx.needs_grad(t)
            ]
            if grads:
                bindings = [("output.delta", ctx.grad(y), R_)] + grads
                ctx.task(f"{self.stem}.grad", op, "backward", space, bindings, self.name, attrs)

        ctx.on_backward(backward)
        return y


@layer_kind("add")
@dataclass
class Add(MergeLayer):
    """The sum of its inputs, which have one shape (a residual connection)."""

    def out_shape(self, shape: tuple[Shape, ...]) -> Shape:
        if len(set(shape)) != 1:
            raise ShapeError(
                f"{self.label}: inputs {list(self.inputs)} have shapes "
                f"{[list(s) for s in shape]}; add needs one shape"
            )
        return shape[0]

    def attrs(self, shapes: tuple[Shape, ...]) -> dict[str, Any]:
        return {"count": len(shapes)}


@layer_kind("concat")
@dataclass
class Concat(MergeLayer):
    """Its inputs one after another along the channels; they agree in height and width."""

    RANKS = (3,)

    def out_shape(self, shape: tuple[Shape, ...]) -> Shape:
        if len({s[1:] for s in shape}) != 1:
            raise ShapeError(
                f"{self.label}: inputs {list(self.inputs)} have shapes "
                f"{[list(s) for s in shape]}; concat needs one height and width"
            )
        return (sum(s[0] for s in shape), shape[0][1], shape[0][2])

    def attrs(self, shapes: tuple[Shape, ...]) -> dict[str, Any]:
        return {"channels": [s[0] for s in shapes]}
