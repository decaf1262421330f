"""`linear`: y (N, M, 1, 1) = x (N, C, H, W) contracted with weights (M, C, H, W), plus an
optional bias (1, M, 1, 1).

Its space is the output times the dims it sums over, (N, M, 1, 1, C, H, W): a piece cut along
C, H or W (Megatron's row-parallel linear) reads its part of the input and of the weights and
writes a partial sum of its output, to which only the piece starting the sum adds the bias.

Linear layers are numbered through the network from 1, as in the seed: the first is task
`<group>.linear1` with weights `<group>.weights1`, updated by `update_W1` (bias `<group>.b1`,
`update_b1`). A piece whole along (C, H, W) reads its samples' whole input and its features'
weights; its backward reduces into the input gradient of its samples, so splitting the features
over ranks makes the input gradient a reduction, and splitting the batch makes the weight
gradient one; splitting (C, H, W) makes neither one (each piece has its own part of both) and the
output a reduction instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from legion_nn.access import columns
from legion_nn.layers.base import (
    Layer,
    Shape,
    layer_kind,
    positive,
    product_roles,
    record_product,
)
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


def _linear_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    """A piece of (N, M, 1, 1) × (C, H, W): its samples' and features' output, the input and
    weights over its part of (C, H, W), and the bias where that part starts the sum."""
    if piece.is_empty():
        empty = Rect.empty(4)
        inputs = output = weights = bias = empty
    else:
        (n0, m0), (n1, m1) = piece.lo[:2], piece.hi[:2]
        sum_lo, sum_hi = piece.lo[4:], piece.hi[4:]
        output = Rect(piece.lo[:4], piece.hi[:4])
        inputs = Rect((n0,) + sum_lo, (n1,) + sum_hi)
        weights = Rect((m0,) + sum_lo, (m1,) + sum_hi)
        starts = not any(sum_lo)  # the bias is added once, by the piece starting the sum
        bias = Rect((0, m0, 0, 0), (1, m1, 1, 1)) if starts else Rect.empty(4)
    return product_roles(inputs, weights, bias, output)


def _linear_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`_linear_rects` over arrays of pieces."""
    n = len(lo)
    output = (lo[:, :4], hi[:, :4])
    inputs = (np.concatenate((lo[:, :1], lo[:, 4:]), 1), np.concatenate((hi[:, :1], hi[:, 4:]), 1))
    weights = (
        np.concatenate((lo[:, 1:2], lo[:, 4:]), 1),
        np.concatenate((hi[:, 1:2], hi[:, 4:]), 1),
    )
    starts = ~lo[:, 4:].any(axis=1)
    bias = (columns(n, 0, lo[:, 1], 0, 0), columns(n, 1, hi[:, 1], 1, 1))
    bias[0][~starts] = 0
    bias[1][~starts] = 0
    found = product_roles(inputs, weights, bias, output)
    return {role: found[role] for role in dims}


record_product(
    "linear", _linear_rects, _linear_boxes, sums_over=3, steps="weights.delta", defers=True
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
        result = Rect.from_dims(dims)
        space = Rect.from_dims(dims + tuple(shape))  # the output × the dims it sums over
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
            result=result,
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
                result=result,
            )
            ctx.update(weights, f"update_W{index}", self.name)
            if bias:
                ctx.update(bias, f"update_b{index}", self.name)

        ctx.on_backward(backward)
        return y
