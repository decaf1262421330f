"""`reshape` and `flatten`: a per-sample change of shape, (C, H, W) -> (C', H', W').

A sample's elements keep their row-major order, which a rect cannot express once split below the
sample, so these tasks split over the batch only.
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


def _reshape_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    # The forward binds input/output, the backward their gradients; the rects are the same.
    inputs = batch_rows(piece, dims["input"] if "input" in dims else dims["input.delta"])
    outputs = batch_rows(piece, dims["output"] if "output" in dims else dims["output.delta"])
    return {"input": inputs, "output": outputs, "output.delta": outputs, "input.delta": inputs}


# a copy: one move per element, counted so that the task is costed as the kernel it runs
registry.register(
    "reshape",
    phases={
        phase: {
            "access": _reshape_rects,
            "flops": registry.per_element(1),
            "adapter": f"reshape.{phase}",
        }
        for phase in ("forward", "backward")
    },
    splittable=(0,),
    homing=registry.GRID,
    packed_role=None,
    owner_role=None,
    passes=None,
    sums_over=0,
)


@layer_kind("reshape")
@dataclass
class Reshape(Layer):
    OP_NAME = "reshape"
    shape: Any = None

    def __post_init__(self) -> None:
        if not (
            isinstance(self.shape, (list, tuple))
            and len(self.shape) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in self.shape)
        ):
            raise ValueError(f"shape must be [C, H, W] of positive ints, got {self.shape!r}")
        self.shape = tuple(self.shape)

    def out_shape(self, shape: Shape) -> Shape:
        size_in = shape[0] * shape[1] * shape[2]
        size_out = self.shape[0] * self.shape[1] * self.shape[2]
        if size_in != size_out:
            raise ShapeError(
                f"{self.label}: cannot reshape {list(shape)} ({size_in} values) to "
                f"{list(self.shape)} ({size_out} values); use [{size_in}, 1, 1] to flatten"
            )
        return tuple(self.shape)  # type: ignore[return-value]

    def lower(self, ctx, x: str, shape: Shape) -> str:
        dims = (ctx.batch,) + self.out_shape(shape)
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        ctx.task(
            self.stem, "reshape", "forward", space, [("input", x, R_), ("output", y, W_)], self.name
        )

        def backward() -> None:
            if not ctx.needs_grad(x):
                return
            bindings = [("output.delta", ctx.grad(y), R_), ("input.delta", ctx.grad(x), RD)]
            ctx.task(f"{self.stem}.grad", "reshape", "backward", space, bindings, self.name)

        ctx.on_backward(backward)
        return y


@layer_kind("flatten")
@dataclass
class Flatten(Reshape):
    OP_NAME = "reshape"

    def __post_init__(self) -> None:
        if self.shape is not None:
            raise ValueError("flatten takes no shape; use reshape to choose one")

    def out_shape(self, shape: Shape) -> Shape:
        return (shape[0] * shape[1] * shape[2], 1, 1)
