"""`embedding`: y (N, T, D) = weights (V, D) at the rows the token ids x (N, T) name; and
`position`: y = x + weights (T, D), a learned vector per position.

Its space is the output. A piece reads its tokens' ids and its features' columns of every row of
the table, since which rows a piece needs depends on the data, not on the plan. The backward adds
each token's gradient into its row (a scatter-add), so the table's gradient is a reduction from
every piece; the ids get no gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from legion_nn.errors import ShapeError
from legion_nn.layers.base import (
    COPY,
    Layer,
    Shape,
    layer_kind,
    positive,
    record_grid_op,
    sequence_axes,
)
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


def _embedding_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    if piece.is_empty():
        ids, table = Rect.empty(2), Rect.empty(2)
    else:
        ids = Rect(piece.lo[:2], piece.hi[:2])
        table = Rect((0, piece.lo[2]), (attrs["vocab"], piece.hi[2]))
    return {
        "input": ids,
        "weights": table,
        "output": piece,
        "output.delta": piece,
        "weights.delta": table,
    }


def _embedding_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`_embedding_rects` over arrays of pieces."""
    table_lo = np.stack((np.zeros(len(lo), np.int64), lo[:, 2]), 1)
    table_hi = np.stack((np.full(len(lo), attrs["vocab"], np.int64), hi[:, 2]), 1)
    found = {
        "input": (lo[:, :2], hi[:, :2]),
        "weights": (table_lo, table_hi),
        "output": (lo, hi),
        "output.delta": (lo, hi),
        "weights.delta": (table_lo, table_hi),
    }
    return {role: found[role] for role in dims}


# a copy per element forward, an addition into the table's gradient backward
record_grid_op("embedding", _embedding_rects, COPY, box_map=_embedding_boxes)


@layer_kind("embedding")
@dataclass
class Embedding(Layer):
    """A table of `vocab` rows of `dim` features, read at each token id (PyTorch's
    `nn.Embedding`, ONNX's Gather of an initializer); weights start from N(0, 1) as there."""

    RANKS = (1,)

    vocab: int = 1
    dim: int = 1

    def __post_init__(self) -> None:
        positive(self.vocab, "vocab")
        positive(self.dim, "dim")

    def out_shape(self, shape: Shape) -> Shape:
        return (shape[0], self.dim)

    def lower(self, ctx, x: str, shape: Shape) -> str:
        weights = ctx.param(f"{self.name}.weights", (self.vocab, self.dim), "normal:1.0")
        dims = (ctx.batch, shape[0], self.dim)
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        attrs = {"vocab": self.vocab, **sequence_axes(dims[1:])}
        bindings = [("input", x, R_), ("weights", weights, R_), ("output", y, W_)]
        ctx.task(self.stem, "embedding", "forward", space, bindings, self.name, attrs)

        def backward() -> None:
            bindings = [
                ("output.delta", ctx.grad(y), R_),
                ("input", x, R_),
                ("weights.delta", ctx.grad(weights), RD),
            ]
            ctx.task(
                f"{self.stem}.grad", "embedding", "backward", space, bindings, self.name, attrs
            )
            ctx.update(weights, f"update_{self.name}.weights", self.name)

        ctx.on_backward(backward)
        return y


# Positions: y (N, T, D) = x + weights (T, D), a learned vector per position


def _position_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    table = Rect.empty(2) if piece.is_empty() else Rect(piece.lo[1:], piece.hi[1:])
    return {
        "input": piece,
        "output": piece,
        "output.delta": piece,
        "input.delta": piece,
        "weights": table,
        "weights.delta": table,
    }


# an addition per element forward; backward the sum over the batch into the table
record_grid_op("position", _position_rects, COPY)


@layer_kind("position")
@dataclass
class PositionEmbedding(Layer):
    """A learned vector added at each position (GPT's `wpe`: an `nn.Embedding` read at
    `arange(T)`, which an export folds into a constant Gather); weights start from N(0, 1).
    The table may hold more `rows` than the sequence has tokens (a model trained for a longer
    context): the first T are read, and the others get no gradient."""

    RANKS = (2,)

    #: the table's rows; None: the sequence's length
    rows: int | None = None

    def __post_init__(self) -> None:
        if self.rows is not None:
            positive(self.rows, "rows")

    def out_shape(self, shape: Shape) -> Shape:
        if self.rows is not None and self.rows < shape[0]:
            raise ShapeError(
                f"{self.label}: a table of {self.rows} positions for {shape[0]} tokens"
            )
        return shape

    def lower(self, ctx, x: str, shape: Shape) -> str:
        table = (self.rows or shape[0], shape[1])
        weights = ctx.param(f"{self.name}.weights", table, "normal:1.0")
        dims = (ctx.batch,) + tuple(shape)
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        attrs = sequence_axes(shape)
        bindings = [("input", x, R_), ("weights", weights, R_), ("output", y, W_)]
        ctx.task(self.stem, "position", "forward", space, bindings, self.name, attrs)

        def backward() -> None:
            bindings = [("output.delta", ctx.grad(y), R_)]
            if ctx.needs_grad(x):
                bindings.append(("input.delta", ctx.grad(x), RD))
            bindings.append(("weights.delta", ctx.grad(weights), RD))
            ctx.task(f"{self.stem}.grad", "position", "backward", space, bindings, self.name, attrs)
            ctx.update(weights, f"update_{self.name}.weights", self.name)

        ctx.on_backward(backward)
        return y
