"""`lrn`: local response normalization across channels, as ONNX's LRN (AlexNet, ZFNet, GoogLeNet).

Each element is divided by a power of the squares of its neighbours in a window of `size`
channels at the same position:

    s[n, c, h, w] = bias + alpha / size · Σ x[n, i, h, w]²  over i in [c − below, c + above] ∩ [0, C)
    y = x / s^beta

with below = ⌊(size − 1)/2⌋ and above = ⌈(size − 1)/2⌉ (`window`): an even size reaches one
channel further up than down. Batch, rows and columns are independent, so a piece reads its own
positions, but a cut through the channels needs a *channel halo*:

- forward, output channels [k0, k1) read input channels [k0 − below, k1 + above), clipped;
- backward, iterating over the input gradient: channel c receives gradient from every output c′
  whose window holds c, c′ in [c − above, c + below], so input-gradient channels [k0, k1) read
  `output.delta` channels [k0 − above, k1 + below) and, to recompute those outputs'
  denominators, input channels widened by both halves again, [k0 − size + 1, k1 + size − 1);
  each piece reduces into exactly its own channels of `input.delta`.

Neither task has parameters; the backward recomputes the denominators instead of keeping them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from legion_nn import registry
from legion_nn.access import columns
from legion_nn.layers.base import Layer, Shape, check_rank, layer_kind
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE

#: ONNX's defaults
ALPHA, BETA, BIAS = 1e-4, 0.75, 1.0


def window(size: int) -> tuple[int, int]:
    """(below, above): how many channels the window of `size` reaches down and up from its own."""
    below = (size - 1) // 2
    return below, size - 1 - below


def _widened(piece: Rect, down: int, up: int, channels: int) -> Rect:
    """The piece with its channels widened by `down` and `up`, clipped to the tensor's."""
    if piece.is_empty():
        return Rect.empty(4)
    lo, hi = list(piece.lo), list(piece.hi)
    lo[1], hi[1] = max(0, lo[1] - down), min(channels, hi[1] + up)
    return Rect(lo, hi)


def _forward_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    below, above = window(attrs["size"])
    return {"input": _widened(piece, below, above, dims["input"][1]), "output": piece}


def _backward_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    below, above = window(attrs["size"])
    channels = dims["input"][1]
    return {
        "output.delta": _widened(piece, above, below, channels),
        "input": _widened(piece, above + below, below + above, channels),
        "input.delta": piece,
    }


def _widened_boxes(lo, hi, down: int, up: int, channels: int) -> tuple:
    n = len(lo)
    first = np.maximum(lo[:, 1] - down, 0)
    last = np.minimum(hi[:, 1] + up, channels)
    return (
        columns(n, lo[:, 0], first, lo[:, 2], lo[:, 3]),
        columns(n, hi[:, 0], last, hi[:, 2], hi[:, 3]),
    )


def _forward_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`_forward_rects` over arrays of (non-empty) pieces."""
    below, above = window(attrs["size"])
    found = {"input": _widened_boxes(lo, hi, below, above, dims["input"][1]), "output": (lo, hi)}
    return {role: found[role] for role in dims}


def _backward_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`_backward_rects` over arrays of (non-empty) pieces."""
    below, above = window(attrs["size"])
    channels = dims["input"][1]
    found = {
        "output.delta": _widened_boxes(lo, hi, above, below, channels),
        "input": _widened_boxes(lo, hi, above + below, below + above, channels),
        "input.delta": (lo, hi),
    }
    return {role: found[role] for role in dims}


#: a power counted as the ~20 FLOPs of the log and exp it takes (as gelu counts erf)
POWER = 20


def _forward_flops(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> float:
    # a square and an add per window channel; the scale, the bias, the power and the divide
    return 2 * attrs["size"] + 3 + POWER


def _backward_flops(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> float:
    # the denominator recomputed (as forward), dy·x·s^−β/s, an add per window channel for the
    # sum over the outputs reached, and dy·s^−β − k·x·sum
    return 3 * attrs["size"] + 9 + POWER


registry.register(
    "lrn",
    phases={
        "forward": {
            "access": _forward_rects,
            "box_map": _forward_boxes,
            "flops": _forward_flops,
            "adapter": "lrn.forward",
        },
        "backward": {
            "access": _backward_rects,
            "box_map": _backward_boxes,
            "flops": _backward_flops,
            "adapter": "lrn.backward",
        },
    },
    splittable=registry.EVERY_DIM,
    homing=registry.GRID,
    packed_role=None,
    owner_role=None,
    passes=None,
    sums_over=0,
)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"lrn {what} must be a finite number, got {value!r}")
    return float(value)


@layer_kind("lrn")
@dataclass
class LRN(Layer):
    """ONNX's LRN over the channels of images; `size` has no default, as in ONNX."""

    size: int | None = None
    alpha: float = ALPHA
    beta: float = BETA
    bias: float = BIAS

    def __post_init__(self) -> None:
        size = self.size
        if size is None:
            raise ValueError("lrn needs size, the channels of each window (a positive int)")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"lrn size must be a positive int, got {size!r}")
        self.alpha = _number(self.alpha, "alpha")
        self.beta = _number(self.beta, "beta")
        self.bias = _number(self.bias, "bias")
        # s ≥ bias > 0 keeps every real power of it defined
        if self.alpha < 0:
            raise ValueError(f"lrn alpha must not be negative, got {self.alpha!r}")
        if self.bias <= 0:
            raise ValueError(f"lrn bias must be positive, got {self.bias!r}")

    def attrs(self) -> dict[str, Any]:
        return {"size": self.size, "alpha": self.alpha, "beta": self.beta, "bias": self.bias}

    def out_shape(self, shape: Shape) -> Shape:
        check_rank(self, shape)
        return tuple(shape)

    def lower(self, ctx, x: str, shape: Shape) -> str:
        dims = (ctx.batch,) + tuple(shape)
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        attrs = self.attrs()
        ctx.task(
            self.stem,
            "lrn",
            "forward",
            space,
            [("input", x, R_), ("output", y, W_)],
            self.name,
            attrs,
            dist_roles=("input",),
        )

        def backward() -> None:
            if not ctx.needs_grad(x):
                return
            bindings = [
                ("output.delta", ctx.grad(y), R_),
                ("input", x, R_),
                ("input.delta", ctx.grad(x), RD),
            ]
            ctx.task(
                f"{self.stem}.grad",
                "lrn",
                "backward",
                space,
                bindings,
                self.name,
                attrs,
                dist_roles=("input",),
            )

        ctx.on_backward(backward)
        return y
