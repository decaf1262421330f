"""`linear`: y (N, M, 1, 1) = x (N, C, H, W) contracted with weights (M, C, H, W), plus an
optional bias (1, M, 1, 1).

Linear layers are numbered through the network from 1, as in the seed: the first is task
`<group>.linear1` with weights `<group>.weights1`, updated by `update_W1` (bias `<group>.b1`,
`update_b1`). A piece of the output (samples × features) reads its samples' whole input and its
features' weights; its backward reduces into the input gradient of its samples, so splitting the
features over ranks makes the input gradient a reduction, and splitting the batch makes the weight
gradient one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from legion_nn import registry
from legion_nn.access import batch_rows, columns
from legion_nn.layers.base import Layer, Shape, backward_factor, layer_kind, positive
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


def _linear_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    inputs = batch_rows(piece, dims["input"])
    if piece.is_empty():
        weights, bias = Rect.empty(4), Rect.empty(4)
    else:
        m0, m1 = piece.lo[1], piece.hi[1]
        weights = Rect((m0, 0, 0, 0), (m1,) + tuple(dims["weights"][1:]))
        bias = Rect((0, m0, 0, 0), (1, m1, 1, 1))
    return {
        "input": inputs,
        "weights": weights,
        "b": bias,
        "output": piece,
        "output.delta": piece,
        "input.delta": inputs,
        "weights.delta": weights,
        "b.delta": bias,
    }


def _linear_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`_linear_rects` over arrays of pieces."""
    n = len(lo)
    rest = dims["input"][1:]
    inputs = (columns(n, lo[:, 0], *(0 for _ in rest)), columns(n, hi[:, 0], *rest))
    m0, m1 = lo[:, 1], hi[:, 1]
    weights = (columns(n, m0, 0, 0, 0), columns(n, m1, *dims["weights"][1:]))
    bias = (columns(n, 0, m0, 0, 0), columns(n, 1, m1, 1, 1))
    found = {
        "input": inputs,
        "weights": weights,
        "b": bias,
        "output": (lo, hi),
        "output.delta": (lo, hi),
        "input.delta": inputs,
        "weights.delta": weights,
        "b.delta": bias,
    }
    return {role: found[role] for role in dims}


def _fan_in(dims: Mapping[str, tuple]) -> int:
    """Inputs one output reads: C·H·W of a sample."""
    _, c, h, w = dims["input"]
    return c * h * w


registry.register(
    "linear",
    phases={
        "forward": {
            "access": _linear_rects,
            "box_map": _linear_boxes,
            "flops": lambda attrs, dims: 2 * _fan_in(dims),
            "adapter": "linear.forward",
        },
        "backward": {
            "access": _linear_rects,
            "box_map": _linear_boxes,
            "flops": lambda attrs, dims: backward_factor(attrs) * _fan_in(dims),
            "adapter": "linear.backward",
        },
    },
    splittable=registry.EVERY_DIM,
    homing=registry.GRID,
    packed_role=None,
    owner_role=None,
    passes=None,
)


@layer_kind("linear")
@dataclass
class Linear(Layer):
    out: int = 1
    bias: bool = False
    init_std: float | None = None

    def __post_init__(self) -> None:
        positive(self.out, "out")

    def out_shape(self, shape: Shape) -> Shape:
        return (self.out, 1, 1)

    def lower(self, ctx, x: str, shape: Shape) -> str:
        ctx.linear_count += 1
        index = ctx.linear_count
        fan_in = shape[0] * shape[1] * shape[2]
        init = f"normal:{self.init_std}" if self.init_std is not None else f"he:{fan_in}"
        stem = f"{self.name}.linear{index}"
        weights = ctx.param(f"{self.name}.weights{index}", (self.out,) + tuple(shape), init)
        bias = (
            ctx.param(f"{self.name}.b{index}", (1, self.out, 1, 1), "zeros") if self.bias else None
        )
        dims = (ctx.batch, self.out, 1, 1)
        y = ctx.tensor(f"{stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        inputs = [("input", x, R_), ("weights", weights, R_)]
        if bias:
            inputs.append(("b", bias, R_))
        ctx.task(
            stem,
            "linear",
            "forward",
            space,
            inputs + [("output", y, W_)],
            self.name,
            dist_roles=("input",),
        )

        def backward() -> None:
            need_dx = ctx.needs_grad(x)
            bindings = [("output.delta", ctx.grad(y), R_)] + inputs
            if need_dx:
                bindings.append(("input.delta", ctx.grad(x), RD))
            bindings.append(("weights.delta", ctx.grad(weights), RD))
            if bias:
                bindings.append(("b.delta", ctx.grad(bias), RD))
            ctx.task(
                f"{stem}.grad",
                "linear",
                "backward",
                space,
                bindings,
                self.name,
                {"need_dx": need_dx},
                dist_roles=("input",),
            )
            ctx.update(weights, f"update_W{index}", self.name)
            if bias:
                ctx.update(bias, f"update_b{index}", self.name)

        ctx.on_backward(backward)
        return y
