"""`softmax` with cross-entropy: class probabilities and the scalar loss.

The forward iterates over the batch, (N, 1, 1, 1), since a sample's classes cannot be split; its
result is the seed's (1, 1, 1, 1) loss, the mean over the global batch, which every piece reduces
into (so it is zeroed first). Probabilities (N, classes, 1, 1) are written piece by piece.

The backward iterates over (N, classes, 1, 1) and computes (p − onehot(label)) / N; like every
backward task it keeps its forward task's `result_dim` (the seed's [1 1 1 1]). As in the seed,
it reads the loss gradient `output.delta` with an empty rect: the loss is the root of the
backward pass, its gradient is 1 by definition and is never materialised.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from legion_nn import registry
from legion_nn.access import batch_rows
from legion_nn.errors import ShapeError
from legion_nn.layers.base import Layer, Shape, layer_kind
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


def _scalar(piece: Rect, ndim: int = 4) -> Rect:
    return Rect.empty(ndim) if piece.is_empty() else Rect((0,) * ndim, (1,) * ndim)


def _softmax_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    rows = batch_rows(piece, dims["input"])
    return {
        "input": rows,
        "labels": batch_rows(piece, dims["labels"]),
        "probability": rows,
        "output": _scalar(piece),
    }


def _softmax_grad_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    return {
        "output.delta": Rect.empty(4),
        "probability": piece,
        "labels": batch_rows(piece, dims["labels"]),
        "input.delta": piece,
    }


def _forward_flops(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> float:
    """Per sample: max, exp, sum, divide and the loss term over its classes."""
    return 5 * dims["input"][1]


registry.register(
    "softmax",
    phases={
        "forward": {
            "access": _softmax_rects,
            "flops": _forward_flops,
            "adapter": "softmax.forward",
        },
        # per class: (p - onehot) / N
        "backward": {
            "access": _softmax_grad_rects,
            "flops": registry.per_element(2),
            "adapter": "softmax.backward",
        },
    },
    splittable=registry.EVERY_DIM,
    homing=registry.GRID,
    packed_role=None,
    owner_role=None,
    passes=None,
    sums_over=0,
)


@layer_kind("softmax")
@dataclass
class Softmax(Layer):
    def out_shape(self, shape: Shape) -> Shape:
        if shape[1:] != (1, 1):
            raise ShapeError(
                f"{self.label}: needs class scores of shape [classes, 1, 1], got {list(shape)}; "
                f"put a linear layer (or a flatten) before it"
            )
        return shape

    def lower(self, ctx, x: str, shape: Shape) -> str:
        batch = ctx.batch
        classes = shape[0]
        probability = ctx.tensor(f"{self.stem}.probability", (batch, classes, 1, 1), "activation")
        loss = ctx.tensor(f"{self.stem}.output", (1, 1, 1, 1), "stat")
        attrs = {"batch_total": batch}
        space = Rect.from_dims((batch, 1, 1, 1))
        ctx.task(
            self.stem,
            "softmax",
            "forward",
            space,
            [
                ("input", x, R_),
                ("labels", ctx.labels, R_),
                ("probability", probability, W_),
                ("output", loss, RD),
            ],
            self.name,
            attrs,
            result=Rect.from_dims((1, 1, 1, 1)),
        )
        ctx.probability = probability

        def backward() -> None:
            if not ctx.needs_grad(x):
                return
            bindings = [
                ("output.delta", ctx.grad(loss), R_),
                ("probability", probability, R_),
                ("labels", ctx.labels, R_),
                ("input.delta", ctx.grad(x), RD),
            ]
            grad_space = Rect.from_dims((batch, classes, 1, 1))
            ctx.task(
                f"{self.stem}.grad",
                "softmax",
                "backward",
                grad_space,
                bindings,
                self.name,
                attrs,
                result_dim=(1, 1, 1, 1),
            )

        ctx.on_backward(backward)
        return probability
