"""Per-channel layers over image activations (N, C, H, W): `channel_affine` and `channel_shuffle`.

`channel_affine`: y = x·scale[c] + shift[c], with trainable `<g>.scale` (1, C, 1, 1), starting
at 1, and, unless `shift` is false, `<g>.shift` (1, C, 1, 1), starting at 0. It is what ONNX
models compute with `Mul(x, Unsqueeze(w))` and `Add(·, Unsqueeze(b))` (DenseNet follows every
BatchNormalization with one). Its tasks are elementwise over their piece and read the parameter
entries of the piece's channels; the backward reduces Σ dy·x and Σ dy over the piece's samples,
rows and columns into those channels' `scale.delta` and `shift.delta`, so pieces of one channel
on several ranks add their parts, as a batchnorm's statistics do.

`channel_shuffle`: ShuffleNet's Reshape (N, g, C/g, H, W), Transpose (0, 2, 1, 3, 4), Reshape
(N, C, H, W). Output channel c' = j·g + i takes input channel i·(C/g) + j, where i = c' mod g and
j = c' div g. The forward iterates over the output: a piece of output channels [k0, k1) reads the
bounding box of the input channels they take. The backward iterates over the input's gradient:
a piece of input channels reads the bounding box of the output gradient's channels they went to,
and reduces into exactly its own channels. The permutation's inverse is the shuffle with C/g
groups, which is how the backward's map is computed. Both split over every dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from legion_nn import registry
from legion_nn.access import channel_boxes, channel_rect
from legion_nn.errors import ShapeError
from legion_nn.layers.base import COPY, Layer, Shape, layer_kind, moving_tasks, record_grid_op
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


def _affine_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    param = channel_rect(piece, 1)  # the (1, C, 1, 1) entries of the piece's channels
    return {
        "input": piece,
        "output": piece,
        "output.delta": piece,
        "input.delta": piece,
        "scale": param,
        "shift": param,
        "scale.delta": param,
        "shift.delta": param,
    }


def _affine_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`_affine_rects` over arrays of pieces."""
    param = channel_boxes(lo, hi, 1)
    entries = {"scale": param, "shift": param, "scale.delta": param, "shift.delta": param}
    return {role: entries.get(role, (lo, hi)) for role in dims}


# forward a multiply and an add per element; backward dy·scale, and dy·x and dy summed
record_grid_op(
    "channel_affine", _affine_rects, {"forward": 2, "backward": 4}, box_map=_affine_boxes
)


def shuffle_sources(channels: int, groups: int, first: int, last: int) -> np.ndarray:
    """The input channel each output channel in [first, last) of a shuffle takes."""
    out = np.arange(first, last, dtype=np.int64)
    return (out % groups) * (channels // groups) + out // groups


def shuffle_destinations(channels: int, groups: int, first: int, last: int) -> np.ndarray:
    """The output channel each input channel in [first, last) of a shuffle goes to: the
    inverse permutation, which is itself the shuffle with C/g groups."""
    return shuffle_sources(channels, channels // groups, first, last)


def _span(piece: Rect, channels: np.ndarray) -> Rect:
    """The piece with its channels replaced by the bounding box of `channels`."""
    if piece.is_empty() or not channels.size:
        return Rect.empty(piece.ndim)
    lo, hi = list(piece.lo), list(piece.hi)
    lo[1], hi[1] = int(channels.min()), int(channels.max()) + 1
    return Rect(lo, hi)


def shuffle_input_rect(groups: int, channels: int, piece: Rect) -> Rect:
    """The input a forward piece (over the output) reads."""
    return _span(piece, shuffle_sources(channels, groups, piece.lo[1], piece.hi[1]))


def shuffle_grad_rect(groups: int, channels: int, piece: Rect) -> Rect:
    """The output gradient a backward piece (over the input's gradient) reads."""
    return _span(piece, shuffle_destinations(channels, groups, piece.lo[1], piece.hi[1]))


def _shuffle_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    return {
        "input": shuffle_input_rect(attrs["groups"], dims["input"][1], piece),
        "output": piece,
    }


def _shuffle_grad_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    return {
        "output.delta": shuffle_grad_rect(attrs["groups"], dims["output.delta"][1], piece),
        "input.delta": piece,
    }


registry.register(
    "channel_shuffle",
    phases={
        "forward": {
            "access": _shuffle_rects,
            "flops": registry.per_element(COPY["forward"]),
            "adapter": "channel_shuffle.forward",
        },
        "backward": {
            "access": _shuffle_grad_rects,
            "flops": registry.per_element(COPY["backward"]),
            "adapter": "channel_shuffle.backward",
        },
    },
    splittable=registry.EVERY_DIM,
    homing=registry.GRID,
    packed_role=None,
    owner_role=None,
    passes=None,
    sums_over=0,
)


@layer_kind("channel_affine")
@dataclass
class ChannelAffine(Layer):
    """y = x·scale[c] + shift[c]; without `shift`, y = x·scale[c]."""

    shift: bool = True

    def out_shape(self, shape: Shape) -> Shape:
        return shape

    def lower(self, ctx, x: str, shape: Shape) -> str:
        c = shape[0]
        dims = (ctx.batch,) + tuple(shape)
        scale = ctx.param(f"{self.name}.scale", (1, c, 1, 1), "const:1")
        params = [("scale", scale)]
        if self.shift:
            params.append(("shift", ctx.param(f"{self.name}.shift", (1, c, 1, 1), "zeros")))
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        reads = [("input", x, R_)] + [(role, t, R_) for role, t in params]
        ctx.task(
            self.stem, "channel_affine", "forward", space, reads + [("output", y, W_)], self.name
        )

        def backward() -> None:
            bindings = [("output.delta", ctx.grad(y), R_), ("input", x, R_), ("scale", scale, R_)]
            if ctx.needs_grad(x):
                bindings.append(("input.delta", ctx.grad(x), RD))
            bindings += [(f"{role}.delta", ctx.grad(t), RD) for role, t in params]
            ctx.task(f"{self.stem}.grad", "channel_affine", "backward", space, bindings, self.name)
            for role, t in params:
                ctx.update(t, f"update_{self.name}.{role}", self.name)

        ctx.on_backward(backward)
        return y


@layer_kind("channel_shuffle")
@dataclass
class ChannelShuffle(Layer):
    """ShuffleNet's channel shuffle: output channel j·g + i is input channel i·(C/g) + j."""

    groups: int = 1

    def out_shape(self, shape: Shape) -> Shape:
        c = shape[0]
        g = self.groups
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or c % g:
            divisors = [d for d in range(1, c + 1) if c % d == 0]
            raise ShapeError(
                f"{self.label}: groups must be a positive int dividing its {c} input channels, "
                f"got {g!r}; divisors of {c}: {', '.join(map(str, divisors))}"
            )
        return shape

    def lower(self, ctx, x: str, shape: Shape) -> str:
        dims = (ctx.batch,) + tuple(shape)
        return moving_tasks(self, ctx, x, dims, "channel_shuffle", {"groups": self.groups})
