"""`evaluate`: four statistics of the batch, all sums, and `evaluate.accuracy`, their fraction.

`<group>.evaluate.output` (4, 1, 1, 1) holds [loss sum, top-1 correct, top-5 correct, rows]: a row
is a sample, or a token of a language model's scores (N, T, classes).
Being sums, they reduce with + across batch pieces, so a partitioned run needs no special case.
`<group>.evaluate.accuracy` reads them and returns the top-1 fraction as the task's value (a
Legion future); it writes no tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from legion_nn import registry
from legion_nn.access import class_axis, class_rows, label_rows, row_space, whole
from legion_nn.errors import ShapeError
from legion_nn.layers.base import Layer, Shape, layer_kind, sequence_axes
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

STATISTICS = ("loss_sum", "top1", "top5", "count")
R_, RD = Privilege.READ, Privilege.REDUCE


def _evaluate_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    return {
        "probability": class_rows(piece, dims["probability"]),
        "labels": label_rows(piece, dims["labels"]),
        "output": whole(dims["output"], piece),
    }


def _accuracy_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    return {"input": whole(dims["input"], piece)}


def _evaluate_flops(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> float:
    """Per row: the loss term and the top-1 and top-5 comparisons over its classes."""
    scores = dims["probability"]
    return 6 * scores[class_axis(len(scores))]


registry.register(
    "evaluate",
    phases={
        "forward": {
            "access": _evaluate_rects,
            "flops": _evaluate_flops,
            "adapter": "evaluate.forward",
        }
    },
    splittable=registry.EVERY_DIM,
    homing=registry.GRID,
    packed_role=None,
    owner_role=None,
    passes=None,
    sums_over=0,
)

# a fraction of four numbers: no FLOPs worth counting
registry.register(
    "accuracy",
    phases={
        "forward": {
            "access": _accuracy_rects,
            "flops": registry.per_element(0),
            "adapter": "accuracy.forward",
        }
    },
    splittable=registry.EVERY_DIM,
    homing=registry.GRID,
    packed_role=None,
    owner_role=None,
    passes=None,
    sums_over=0,
)


@layer_kind("evaluate")
@dataclass
class Evaluate(Layer):
    RANKS = (2, 3)

    def out_shape(self, shape: Shape) -> Shape:
        return shape

    def lower(self, ctx, x: str, shape: Shape) -> str:
        if ctx.probability is None:
            raise ShapeError(f"{self.label}: needs a softmax layer before it")
        stats = ctx.tensor(
            f"{self.stem}.output", (len(STATISTICS), 1, 1, 1), "stat", dtype="float64"
        )
        ctx.task(
            self.stem,
            "evaluate",
            "forward",
            row_space(ctx.dims(ctx.probability)),
            [
                ("probability", ctx.probability, R_),
                ("labels", ctx.labels, R_),
                ("output", stats, RD),
            ],
            self.name,
            {"statistics": list(STATISTICS), **sequence_axes(shape)},
            result=Rect.from_dims(ctx.dims(stats)),
        )
        ctx.task(
            f"{self.stem}.accuracy",
            "accuracy",
            "forward",
            Rect((0,), (1,)),
            [("input", stats, R_)],
            self.name,
        )
        return x
