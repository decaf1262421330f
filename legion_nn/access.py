"""Access maps: for a piece of a task's iteration space, the rect each requirement touches.

Every (op, phase) records one function ``fn(attrs, dims, piece) -> {role: Rect}`` in its op record
(`legion_nn.registry`), where `dims` maps each role to the dims of the tensor bound to it.
Lowering builds a task's requirements by applying its access map to the whole space; the
partitioner applies the same map to each piece, so halos, weight slices and reduction targets
all come from one place. An op may also record the same map over arrays of pieces (its box map:
`lo`, `hi` (n, ndim) int64, every piece non-empty, returning {role: (lo, hi)}), which the
partitioner uses where one rect at a time is too slow and checks against the map itself.

This module holds the building blocks the families' maps share, one piece at a time and over
arrays; it knows no op.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from legion_nn.ir import Requirement
from legion_nn.rect import Rect


def with_rect(req: Requirement, rect: Rect) -> Requirement:
    """The requirement with its rect(s) replaced, keeping the privilege's read/write shape."""
    return replace(
        req,
        read_rect=rect if req.privilege.reads else None,
        write_rect=rect if req.privilege.writes else None,
    )


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


def input_dims(dims: Mapping[str, tuple]) -> tuple:
    """The dims of a windowed op's input: an average pool's backward reads only its gradient,
    which has the same dims."""
    return dims["input"] if "input" in dims else dims["input.delta"]


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


def class_axis(ndim: int) -> int:
    """The classes' dim of scores: (N, classes, 1, 1) per sample, (N, T, classes) per token."""
    return 1 if ndim == 4 else ndim - 1


def row_space(dims: tuple[int, ...]) -> Rect:
    """The space of a task over every row of scores `dims` and none of their classes: (N, 1, 1,
    1) per sample, (N, T, 1) per token."""
    axis = class_axis(len(dims))
    return Rect.from_dims(dims[:axis] + (1,) * (len(dims) - axis))


def class_rows(piece: Rect, dims: tuple[int, ...]) -> Rect:
    """Every class of the piece's rows (`class_axis`): its samples, or its samples' tokens."""
    if piece.is_empty():
        return Rect.empty(len(dims))
    axis = class_axis(len(dims))
    return Rect(
        piece.lo[:axis] + (0,) + piece.lo[axis + 1 :],
        piece.hi[:axis] + (dims[axis],) + piece.hi[axis + 1 :],
    )


def label_rows(piece: Rect, dims: tuple[int, ...]) -> Rect:
    """The labels of the piece's rows: a sample's (N, 1, 1, 1), or a token's (N, T)."""
    if len(dims) == 4:
        return batch_rows(piece, dims)
    if piece.is_empty():
        return Rect.empty(len(dims))
    return Rect(piece.lo[: len(dims)], piece.hi[: len(dims)])


def whole(dims: tuple[int, ...], piece: Rect) -> Rect:
    """The whole tensor, or nothing when the piece is empty."""
    return Rect.empty(len(dims)) if piece.is_empty() else Rect.from_dims(dims)


def window_spans(
    lo: np.ndarray, hi: np.ndarray, stride: int, pad: int, size: int, extent: int
) -> tuple[np.ndarray, np.ndarray]:
    """`window_span` of each (lo, hi): (0, 0) where nothing is read."""
    first = np.maximum(lo * stride - pad, 0)
    last = np.minimum((hi - 1) * stride - pad + size, extent)
    read = (hi > lo) & (first < last)
    return np.where(read, first, 0), np.where(read, last, 0)


def columns(n: int, *values) -> np.ndarray:
    """An (n, len(values)) int64 array from columns that are arrays of n or scalars."""
    out = np.empty((n, len(values)), np.int64)
    for d, column in enumerate(values):
        out[:, d] = column
    return out


def elementwise_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`elementwise` over arrays: every role touches the piece."""
    return {role: (lo, hi) for role in dims}


def channel_rect(piece: Rect, rows: int, positions: bool = False) -> Rect:
    """The (rows, C, 1, 1) entries of the channels of a piece of (N, C, H, W) activations (with
    `positions`, the (rows, C, H, W) entries of its channels and positions): a batch
    normalisation's statistics and parameters, a channel affine's parameters. An empty piece
    touches none."""
    if piece.is_empty():
        return Rect.empty(4)
    if positions:
        return Rect((0,) + piece.lo[1:], (rows,) + piece.hi[1:])
    return Rect((0, piece.lo[1], 0, 0), (rows, piece.hi[1], 1, 1))


def channel_boxes(lo: np.ndarray, hi: np.ndarray, rows: int, positions: bool = False) -> tuple:
    """`channel_rect` of each piece of arrays of pieces (an empty one's all zeros, as
    `Rect.empty`)."""
    out_lo, out_hi = np.zeros((len(lo), 4), np.int64), np.zeros((len(lo), 4), np.int64)
    out_hi[:, 0] = rows
    if positions:
        out_lo[:, 1:], out_hi[:, 1:] = lo[:, 1:], hi[:, 1:]
    else:
        out_lo[:, 1], out_hi[:, 1], out_hi[:, 2:] = lo[:, 1], hi[:, 1], 1
    empty = np.any(hi <= lo, axis=1)
    out_lo[empty], out_hi[empty] = 0, 0
    return out_lo, out_hi
