"""`batchnorm`: spatial (per channel over N, H, W) or vanilla (per feature over N).

Normalising needs statistics of the whole batch, which a partition splits, so the layer lowers to
tasks whose privileges say exactly that:

- `<g>.batchnorm.stats` reduces [Σx, Σx²] of its piece into `<g>.batchnorm.stats` (2, C, 1, 1)
  (vanilla: (2, C, H, W)); partitioned over the batch this is an all-reduce;
- `<g>.batchnorm` normalises its piece with the statistics, `gamma` and `beta` (in evaluation, the
  runtime normalises with `<g>.running` instead, which the task therefore also reads);
- `<g>.batchnorm.running` folds the batch statistics into `<g>.running` (state, for inference);
- backward, `<g>.batchnorm.grad` reduces Σdy and Σdy·x̂ into `beta.delta` and `gamma.delta`, and
  `<g>.batchnorm.stats.grad` computes the input gradient from those totals. It is named as the
  backward of the statistics' task (whose space it has): a unit's backward tasks are its forward
  tasks' `.grad`s (`partitioner.strategy.find_units`), and a task of none runs whole on one rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from legion_nn import registry
from legion_nn.access import channel_boxes, channel_rect, elementwise_boxes
from legion_nn.layers.base import Layer, Shape, layer_kind
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RW, RD = Privilege.READ, Privilege.WRITE, Privilege.READ_WRITE, Privilege.REDUCE


def _batchnorm_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    # the statistics and parameters of the piece's channels (vanilla: and positions)
    positions = dims["stats"][2:] != (1, 1)
    stats, param = channel_rect(piece, 2, positions), channel_rect(piece, 1, positions)
    return {
        "input": piece,
        "output": piece,
        "output.delta": piece,
        "input.delta": piece,
        "stats": stats,
        "running": stats,
        "gamma": param,
        "beta": param,
        "gamma.delta": param,
        "beta.delta": param,
    }


def _batchnorm_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`_batchnorm_rects` over arrays of pieces."""
    positions = dims["stats"][2:] != (1, 1)
    stats, param = channel_boxes(lo, hi, 2, positions), channel_boxes(lo, hi, 1, positions)
    entries = {"stats": stats, "running": stats, "gamma": param, "beta": param}
    entries |= {"gamma.delta": param, "beta.delta": param}
    return {role: entries.get(role, (lo, hi)) for role in dims}


def _running_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    return {"stats": piece, "running": piece}


def _record(op: str, flops: dict[str, float], splittable=registry.EVERY_DIM, running=False) -> None:
    registry.register(
        op,
        phases={
            phase: {
                "access": _running_rects if running else _batchnorm_rects,
                "box_map": elementwise_boxes if running else _batchnorm_boxes,
                "flops": registry.per_element(count),
                "adapter": f"{op}.{phase}",
            }
            for phase, count in flops.items()
        },
        splittable=splittable,
        homing=registry.GRID,
        packed_role=None,
        owner_role=None,
        passes=None,
        sums_over=0,
    )


# FLOPs per element: Σx and Σx² (a square, two adds); (x − mean)·inv_std·gamma + beta; backward
# Σdy and Σdy·x̂ with x̂ recomputed; the input gradient gamma·inv_std·(dy − mean dy − x̂·mean dy·x̂)
# with x̂ recomputed; folding a statistic into its running value m·r + (1 − m)·s
_record("batchnorm_stats", {"forward": 3})
_record("batchnorm", {"forward": 4, "backward": 5})
_record("batchnorm_input", {"backward": 6})
# mean and var stay together: the statistics' rows are not cut
_record("batchnorm_running", {"forward": 3}, splittable=(1, 2, 3), running=True)


@layer_kind("batchnorm")
@dataclass
class BatchNorm(Layer):
    spatial: bool = True
    eps: float = 1e-5
    momentum: float = 0.9

    def out_shape(self, shape: Shape) -> Shape:
        return shape

    def lower(self, ctx, x: str, shape: Shape) -> str:
        c, h, w = shape
        dims = (ctx.batch, c, h, w)
        per = (c, 1, 1) if self.spatial else (c, h, w)
        count = ctx.batch * h * w if self.spatial else ctx.batch
        gamma = ctx.param(f"{self.name}.gamma", (1,) + per, "const:1")
        beta = ctx.param(f"{self.name}.beta", (1,) + per, "zeros")
        stats = ctx.tensor(f"{self.stem}.stats", (2,) + per, "stat", dtype="float64")
        running = ctx.tensor(
            f"{self.name}.running", (2,) + per, "state", dtype="float64", init="rows:0,1"
        )
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        attrs = {"eps": float(self.eps), "count": count, "spatial": self.spatial}
        ctx.task(
            f"{self.stem}.stats",
            "batchnorm_stats",
            "forward",
            space,
            [("input", x, R_), ("stats", stats, RD)],
            self.name,
            attrs,
        )
        ctx.task(
            self.stem,
            "batchnorm",
            "forward",
            space,
            [
                ("input", x, R_),
                ("stats", stats, R_),
                ("gamma", gamma, R_),
                ("beta", beta, R_),
                ("running", running, R_),
                ("output", y, W_),
            ],
            self.name,
            attrs,
        )
        ctx.task(
            f"{self.stem}.running",
            "batchnorm_running",
            "forward",
            Rect.from_dims(ctx.dims(stats)),
            [("stats", stats, R_), ("running", running, RW)],
            self.name,
            {"momentum": float(self.momentum), "count": count, "spatial": self.spatial},
        )

        def backward() -> None:
            dy = ctx.grad(y)
            ctx.task(
                f"{self.stem}.grad",
                "batchnorm",
                "backward",
                space,
                [
                    ("output.delta", dy, R_),
                    ("input", x, R_),
                    ("stats", stats, R_),
                    ("gamma.delta", ctx.grad(gamma), RD),
                    ("beta.delta", ctx.grad(beta), RD),
                ],
                self.name,
                attrs,
            )
            if ctx.needs_grad(x):
                ctx.task(
                    f"{self.stem}.stats.grad",
                    "batchnorm_input",
                    "backward",
                    space,
                    [
                        ("output.delta", dy, R_),
                        ("input", x, R_),
                        ("stats", stats, R_),
                        ("gamma", gamma, R_),
                        ("gamma.delta", ctx.grad(gamma), R_),
                        ("beta.delta", ctx.grad(beta), R_),
                        ("input.delta", ctx.grad(x), RD),
                    ],
                    self.name,
                    attrs,
                )
            ctx.update(gamma, f"update_{self.name}.gamma", self.name)
            ctx.update(beta, f"update_{self.name}.beta", self.name)

        ctx.on_backward(backward)
        return y
