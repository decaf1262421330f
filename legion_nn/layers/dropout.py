"""`dropout`: inverted dropout whose mask is a hash of (seed, step, global element index).

No mask tensor exists: forward and backward recompute it, and because it depends on an element's
global index rather than on which rank holds it, every partition draws the same mask as the
single-process run.
"""

from __future__ import annotations

from dataclasses import dataclass

from legion_nn.access import elementwise, register
from legion_nn.layers.base import Layer, Shape, layer_kind
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


register("dropout", "forward")(elementwise)
register("dropout", "backward")(elementwise)


@layer_kind("dropout")
@dataclass
class Dropout(Layer):
    ratio: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
            raise TypeError(f"ratio must be a number in [0, 1), got {self.ratio!r}")
        if not 0 <= self.ratio < 1:
            raise ValueError(f"ratio must be in [0, 1), got {self.ratio!r}")

    def out_shape(self, shape: Shape) -> Shape:
        return shape

    def lower(self, ctx, x: str, shape: Shape) -> str:
        dims = (ctx.batch,) + tuple(shape)
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        attrs = {"ratio": float(self.ratio), "seed": int(self.seed)}
        ctx.task(
            self.stem,
            "dropout",
            "forward",
            space,
            [("input", x, R_), ("output", y, W_)],
            self.name,
            attrs,
        )

        def backward() -> None:
            if ctx.tensors[x].kind == "data":
                return
            bindings = [("output.delta", ctx.grad(y), R_), ("input.delta", ctx.grad(x), RD)]
            ctx.task(f"{self.stem}.grad", "dropout", "backward", space, bindings, self.name, attrs)

        ctx.on_backward(backward)
        return y
