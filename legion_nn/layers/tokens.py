"""Layers between images and sequences, as a vision transformer has them.

- `image_tokens`: images (C, H, W) as a sequence of H·W tokens of C features (PyTorch's
  `flatten(2).transpose(1, 2)` of a patch embedding's output). A piece of tokens reads the
  image rows its tokens fall in, whole: exact where its cut lies between rows.
- `class_token`: a learned token (D,) put before a sequence, (T, D) → (T + 1, D).
- `select_token`: one token of a sequence, (T, D) → (D, 1, 1), as a classifier reads it (the
  class token, `x[:, 0]`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from legion_nn.errors import ShapeError
from legion_nn.layers.base import COPY, Layer, Shape, layer_kind, moving_tasks, record_grid_op
from legion_nn.rect import Rect

# Images as tokens: output (N, H·W, C) from input (N, C, H, W)


def _image_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    if piece.is_empty():
        rows = Rect.empty(4)
    else:
        (n0, t0, c0), (n1, t1, c1) = piece.lo, piece.hi
        width = attrs["width"]
        rows = Rect((n0, c0, t0 // width, 0), (n1, c1, -(-t1 // width), width))
    return {"input": rows, "input.delta": rows, "output": piece, "output.delta": piece}


record_grid_op("image_tokens", _image_rects, COPY)


@layer_kind("image_tokens")
@dataclass
class ImageTokens(Layer):
    """(C, H, W) as H·W tokens of C features, row by row."""

    def out_shape(self, shape: Shape) -> Shape:
        channels, height, width = shape
        return (height * width, channels)

    def lower(self, ctx, x: str, shape: Shape) -> str:
        dims = (ctx.batch, *self.out_shape(shape))
        return moving_tasks(self, ctx, x, dims, "image_tokens", {"width": shape[2], "axes": "NSF"})


# The class token: output (N, T + 1, D): token 0 the weights (D,), token t the input's t − 1


def _class_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    tokens = weights = None
    if not piece.is_empty():
        (n0, t0, d0), (n1, t1, d1) = piece.lo, piece.hi
        if t1 > 1:
            tokens = Rect((n0, max(t0, 1) - 1, d0), (n1, t1 - 1, d1))
        if t0 == 0:
            weights = Rect((d0,), (d1,))
    tokens = tokens or Rect.empty(3)
    weights = weights or Rect.empty(1)
    return {
        "input": tokens,
        "input.delta": tokens,
        "weights": weights,
        "weights.delta": weights,
        "output": piece,
        "output.delta": piece,
    }


record_grid_op("class_token", _class_rects, COPY)


@layer_kind("class_token")
@dataclass
class ClassToken(Layer):
    """A learned token put first (ViT's `cls`), from N(0, 0.02²)."""

    RANKS = (2,)

    def out_shape(self, shape: Shape) -> Shape:
        return (shape[0] + 1, shape[1])

    def lower(self, ctx, x: str, shape: Shape) -> str:
        weights = ctx.param(f"{self.name}.weights", (shape[1],), "normal:0.02")
        dims = (ctx.batch, *self.out_shape(shape))
        return moving_tasks(
            self, ctx, x, dims, "class_token", {"axes": "NSF"}, params=(("weights", weights),)
        )


# One token: output (N, D, 1, 1) = input (N, T, D)[:, index]


def _select_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    if piece.is_empty():
        token = Rect.empty(3)
    else:
        index = attrs["index"]
        token = Rect((piece.lo[0], index, piece.lo[1]), (piece.hi[0], index + 1, piece.hi[1]))
    return {"input": token, "input.delta": token, "output": piece, "output.delta": piece}


record_grid_op("select_token", _select_rects, COPY, splittable=(0, 1))


@layer_kind("select_token")
@dataclass
class SelectToken(Layer):
    """Token `index` of a sequence as a sample's features (D, 1, 1), for a classifier."""

    RANKS = (2,)

    index: int = 0

    def out_shape(self, shape: Shape) -> Shape:
        if not 0 <= self.index < shape[0]:
            raise ShapeError(f"{self.label}: token {self.index} of {shape[0]} does not exist")
        return (shape[1], 1, 1)

    def lower(self, ctx, x: str, shape: Shape) -> str:
        dims = (ctx.batch, *self.out_shape(shape))
        return moving_tasks(self, ctx, x, dims, "select_token", {"index": self.index})
