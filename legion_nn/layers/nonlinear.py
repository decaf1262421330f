"""`filterNL`: an elementwise nonlinearity (relu, tanh, sigmoid); `relu` is its short spelling.

The backward reads the forward *output*, from which all three derivatives follow
(relu: y > 0, tanh: 1 − y², sigmoid: y(1 − y)), so the input need not be kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from legion_nn.access import elementwise, register
from legion_nn.layers.base import Layer, Shape, layer_kind
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

FUNCTIONS = ("relu", "tanh", "sigmoid")
R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


register("filterNL", "forward")(elementwise)
register("filterNL", "backward")(elementwise)


@layer_kind("filterNL")
@dataclass
class FilterNL(Layer):
    OP_NAME = "filterNL"
    fn: str = "relu"

    def __post_init__(self) -> None:
        if self.fn not in FUNCTIONS:
            raise ValueError(f"fn must be one of {', '.join(FUNCTIONS)}, got {self.fn!r}")

    def out_shape(self, shape: Shape) -> Shape:
        return shape

    def lower(self, ctx, x: str, shape: Shape) -> str:
        dims = (ctx.batch,) + tuple(shape)
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        attrs = {"fn": self.fn}
        ctx.task(
            self.stem,
            "filterNL",
            "forward",
            space,
            [("input", x, R_), ("output", y, W_)],
            self.name,
            attrs,
        )

        def backward() -> None:
            if ctx.tensors[x].kind == "data":
                return
            bindings = [
                ("output.delta", ctx.grad(y), R_),
                ("output", y, R_),
                ("input.delta", ctx.grad(x), RD),
            ]
            ctx.task(f"{self.stem}.grad", "filterNL", "backward", space, bindings, self.name, attrs)

        ctx.on_backward(backward)
        return y


@layer_kind("relu")
@dataclass
class Relu(FilterNL):
    def __post_init__(self) -> None:
        if self.fn != "relu":
            raise ValueError(f"a relu layer computes relu; use filterNL for {self.fn!r}")
