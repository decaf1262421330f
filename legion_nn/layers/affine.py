"""`filterA`: out = a·x + b with a scalar `a` (1,) and an untied bias `b` (1, K, P, Q).

It iterates over its output; a piece reads the same rect of its input, all of `a`, and the bias
entries of its channels and positions. The backward reduces into `a.delta` from every piece.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from legion_nn import registry
from legion_nn.layers.base import Layer, Shape, layer_kind
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


def _affine_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    if piece.is_empty():
        scalar, bias = Rect.empty(1), Rect.empty(4)
    else:
        scalar = Rect((0,), (1,))
        bias = Rect((0,) + piece.lo[1:], (1,) + piece.hi[1:])
    return {
        "input": piece,
        "a": scalar,
        "b": bias,
        "output": piece,
        "output.delta": piece,
        "input.delta": piece,
        "a.delta": scalar,
        "b.delta": bias,
    }


# a multiply and an add per element forward; backward the input gradient and two reductions
registry.register(
    "filterA",
    phases={
        "forward": {
            "access": _affine_rects,
            "flops": registry.per_element(2),
            "adapter": "filterA.forward",
        },
        "backward": {
            "access": _affine_rects,
            "flops": registry.per_element(4),
            "adapter": "filterA.backward",
        },
    },
    splittable=registry.EVERY_DIM,
    homing=registry.GRID,
    packed_role=None,
    owner_role=None,
    passes=None,
    sums_over=0,
)


@layer_kind("filterA")
@dataclass
class FilterA(Layer):
    a_init: float = 1.0

    def out_shape(self, shape: Shape) -> Shape:
        return shape

    def lower(self, ctx, x: str, shape: Shape) -> str:
        dims = (ctx.batch,) + tuple(shape)
        a = ctx.param(f"{self.name}.a", (1,), f"const:{self.a_init}")
        b = ctx.param(f"{self.name}.b", (1,) + tuple(shape), "zeros")
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        inputs = [("input", x, R_), ("a", a, R_), ("b", b, R_)]
        ctx.task(self.stem, "filterA", "forward", space, inputs + [("output", y, W_)], self.name)

        def backward() -> None:
            bindings = [("output.delta", ctx.grad(y), R_), ("input", x, R_), ("a", a, R_)]
            if ctx.needs_grad(x):
                bindings.append(("input.delta", ctx.grad(x), RD))
            bindings += [("a.delta", ctx.grad(a), RD), ("b.delta", ctx.grad(b), RD)]
            ctx.task(f"{self.stem}.grad", "filterA", "backward", space, bindings, self.name)
            ctx.update(a, f"update_{self.name}.a", self.name)
            ctx.update(b, f"update_{self.name}.b", self.name)

        ctx.on_backward(backward)
        return y
