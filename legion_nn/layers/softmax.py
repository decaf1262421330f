"""`softmax` with cross-entropy: class probabilities and the scalar loss.

Scores are (N, classes, 1, 1), a class per sample, or (N, T, classes), a language model's next
token at every position; the loss is the mean over every sample (token) of the global batch.

The forward iterates over the rows, (N, 1, 1, 1) or (N, T, 1), since a row's classes cannot be
split; its result is the seed's (1, 1, 1, 1) loss, which every piece reduces into (so it is zeroed
first). Probabilities are written piece by piece.

The backward iterates over the scores and computes (p − onehot(label)) / rows; like every
backward task it keeps its forward task's `result_dim` (the seed's [1 1 1 1]). As in the seed,
it reads the loss gradient `output.delta` with an empty rect: the loss is the root of the
backward pass, its gradient is 1 by definition and is never materialised.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from legion_nn import registry
from legion_nn.access import class_axis, class_rows, label_rows, row_space
from legion_nn.errors import ShapeError
from legion_nn.layers.base import Layer, Shape, layer_kind, sequence_axes
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


def _scalar(piece: Rect, ndim: int = 4) -> Rect:
    return Rect.empty(ndim) if piece.is_empty() else Rect((0,) * ndim, (1,) * ndim)


def _softmax_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    rows = class_rows(piece, dims["input"])
    return {
        "input": rows,
        "labels": label_rows(piece, dims["labels"]),
        "probability": rows,
        "output": _scalar(piece),
    }


def _softmax_grad_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    return {
        "output.delta": Rect.empty(4),
        "probability": piece,
        "labels": label_rows(piece, dims["labels"]),
        "input.delta": piece,
    }


def _forward_flops(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> float:
    """Per row: max, exp, sum, divide and the loss term over its classes."""
    scores = dims["input"]
    return 5 * scores[class_axis(len(scores))]


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
    RANKS = (2, 3)

    def out_shape(self, shape: Shape) -> Shape:
        if len(shape) == 3 and shape[1:] != (1, 1):
            raise ShapeError(
                f"{self.label}: needs class scores of shape [classes, 1, 1] or [T, classes], got "
                f"{list(shape)}; put a linear layer (or a flatten) before it"
            )
        return shape

    def lower(self, ctx, x: str, shape: Shape) -> str:
        scores = (ctx.batch,) + tuple(shape)
        probability = ctx.tensor(f"{self.stem}.probability", scores, "activation")
        loss = ctx.tensor(f"{self.stem}.output", (1, 1, 1, 1), "stat")
        space = row_space(scores)
        attrs = {"batch_total": space.volume, **sequence_axes(shape)}
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
            ctx.task(
                f"{self.stem}.grad",
                "softmax",
                "backward",
                Rect.from_dims(scores),
                bindings,
                self.name,
                attrs,
                result_dim=(1, 1, 1, 1),
            )

        ctx.on_backward(backward)
        return probability
