"""`dense`: a linear map of every token's features, y (N, T, O) = x (N, T, K)·weights (K, O) + b.

This is PyTorch's `nn.Linear` on a sequence, ONNX's MatMul of an activation by an initializer; the
weights are stored (K, O) as that MatMul reads them. (`linear` is the classifier's: it flattens a
sample's (C, H, W).)

Its space is the output times the features it sums over, (N, T, O, K). Cut along O, a piece owns
some output features and reads all of its tokens' input: Megatron's column-parallel linear. Cut
along K, it reads its part of the input and of the weights and writes a partial sum of its output,
to which only the piece starting the sum adds the bias: the row-parallel linear. Cut along N or T
it is data or sequence parallel, and the weights' gradient is a reduction over the pieces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

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
#: the dims of the space: tokens' batch and positions, output features, and the summed features
AXES = "NSF-"


def _dense_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    """A piece of (N, T, O) × (K,): its tokens' and features' output, its tokens' input over its
    part of K, the weights of that part for its features, and the bias where that part starts
    the sum."""
    if piece.is_empty():
        inputs, output = Rect.empty(3), Rect.empty(3)
        weights, bias = Rect.empty(2), Rect.empty(1)
    else:
        (n0, t0, o0, k0), (n1, t1, o1, k1) = piece.lo, piece.hi
        output = Rect((n0, t0, o0), (n1, t1, o1))
        inputs = Rect((n0, t0, k0), (n1, t1, k1))
        weights = Rect((k0, o0), (k1, o1))
        bias = Rect((o0,), (o1,)) if k0 == 0 else Rect.empty(1)
    return product_roles(inputs, weights, bias, output)


def _dense_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`_dense_rects` over arrays of pieces."""
    starts = lo[:, 3] == 0
    bias = (np.where(starts, lo[:, 2], 0)[:, None], np.where(starts, hi[:, 2], 0)[:, None])
    found = product_roles(
        (lo[:, [0, 1, 3]], hi[:, [0, 1, 3]]),
        (lo[:, [3, 2]], hi[:, [3, 2]]),
        bias,
        (lo[:, :3], hi[:, :3]),
    )
    return {role: found[role] for role in dims}


record_product("dense", _dense_rects, _dense_boxes, sums_over=1, defers=True)


@layer_kind("dense")
@dataclass
class Dense(Layer):
    RANKS = (2,)

    out: int = 1
    bias: bool = True
    init_std: float | None = None

    def __post_init__(self) -> None:
        positive(self.out, "out")

    def out_shape(self, shape: Shape) -> Shape:
        return (shape[0], self.out)

    def lower(self, ctx, x: str, shape: Shape) -> str:
        tokens, features = shape
        init = f"normal:{self.init_std}" if self.init_std is not None else f"he:{features}"
        weights = ctx.param(f"{self.name}.weights", (features, self.out), init)
        bias = ctx.param(f"{self.name}.b", (self.out,), "zeros") if self.bias else None
        dims = (ctx.batch, tokens, self.out)
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims + (features,))
        inputs = [("input", x, R_), ("weights", weights, R_)]
        if bias:
            inputs.append(("b", bias, R_))
        attrs = {"axes": AXES}
        outputs = [("output", y, W_)]
        result = Rect.from_dims(dims)
        ctx.task(
            self.stem, "dense", "forward", space, inputs + outputs, self.name, attrs, result=result
        )

        def backward() -> None:
            need_dx = ctx.needs_grad(x)
            bindings = [("output.delta", ctx.grad(y), R_)] + inputs
            if need_dx:
                bindings.append(("input.delta", ctx.grad(x), RD))
            bindings.append(("weights.delta", ctx.grad(weights), RD))
            if bias:
                bindings.append(("b.delta", ctx.grad(bias), RD))
            grad_attrs = {**attrs, "need_dx": need_dx}
            ctx.task(
                f"{self.stem}.grad",
                "dense",
                "backward",
                space,
                bindings,
                self.name,
                grad_attrs,
                result=result,
            )
            ctx.update(weights, f"update_{self.name}.weights", self.name)
            if bias:
                ctx.update(bias, f"update_{self.name}.b", self.name)

        ctx.on_backward(backward)
        return y
