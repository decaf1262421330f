"""`maxpool` and `avgpool`: the maximum, or the mean over its real cells, of each window; a piece
reads the halo of its window rows/columns.

The backward routes each output gradient to its window's maximum (or shares it among the window's
cells), reducing into the input halo, so overlapping windows (stride < window) and pieces that
share halo rows simply add. `avgpool`'s backward needs no input values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from legion_nn import registry
from legion_nn.access import columns, input_dims, window_span, window_spans
from legion_nn.layers.base import Layer, Shape, layer_kind, padding, pair, window_out
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


def _pool_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    _, _, h_in, w_in = input_dims(dims)
    (kh, kw), (sh, sw) = attrs["kernel"], attrs["stride"]
    top, _, left, _ = attrs["pad"]
    halo = Rect.empty(4)
    if not piece.is_empty():
        rows = window_span(piece.lo[2], piece.hi[2], sh, top, kh, h_in)
        cols = window_span(piece.lo[3], piece.hi[3], sw, left, kw, w_in)
        if rows != (0, 0) and cols != (0, 0):
            halo = Rect(
                (piece.lo[0], piece.lo[1], rows[0], cols[0]),
                (piece.hi[0], piece.hi[1], rows[1], cols[1]),
            )
    return {"input": halo, "output": piece, "output.delta": piece, "input.delta": halo}


def _pool_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`_pool_rects` over arrays of pieces."""
    n = len(lo)
    _, _, h_in, w_in = input_dims(dims)
    (kh, kw), (sh, sw) = attrs["kernel"], attrs["stride"]
    top, _, left, _ = attrs["pad"]
    rows = window_spans(lo[:, 2], hi[:, 2], sh, top, kh, h_in)
    cols = window_spans(lo[:, 3], hi[:, 3], sw, left, kw, w_in)
    halo = (
        columns(n, lo[:, 0], lo[:, 1], rows[0], cols[0]),
        columns(n, hi[:, 0], hi[:, 1], rows[1], cols[1]),
    )
    found = {"input": halo, "output": (lo, hi), "output.delta": (lo, hi), "input.delta": halo}
    return {role: found[role] for role in dims}


def _window(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> float:
    """A comparison per window element forward, a scan of the window backward."""
    return attrs["kernel"][0] * attrs["kernel"][1]


for _op in ("maxpool", "avgpool"):
    registry.register(
        _op,
        phases={
            phase: {
                "access": _pool_rects,
                "box_map": _pool_boxes,
                "flops": _window,  # a comparison or an add per window element, each way
                "adapter": f"{_op}.{phase}",
            }
            for phase in ("forward", "backward")
        },
        splittable=registry.EVERY_DIM,
        homing=registry.GRID,
        packed_role=None,
        owner_role=None,
        passes=None,
        sums_over=0,
    )


@layer_kind("maxpool")
@dataclass
class MaxPool(Layer):
    #: whether its backward reads the input (the argmax) or only the output's gradient
    BACKWARD_READS_INPUT: ClassVar[bool] = True

    kernel: Any = 2
    stride: Any = None
    pad: Any = 0

    def __post_init__(self) -> None:
        self.kernel = pair(self.kernel, "kernel")
        self.stride = self.kernel if self.stride is None else pair(self.stride, "stride")
        self.pad = padding(self.pad)

    def out_shape(self, shape: Shape) -> Shape:
        rows, cols = window_out(self, shape, self.kernel, self.stride, self.pad)
        return (shape[0], rows, cols)

    def lower(self, ctx, x: str, shape: Shape) -> str:
        dims = (ctx.batch,) + self.out_shape(shape)
        y = ctx.tensor(f"{self.stem}.output", dims, "activation")
        space = Rect.from_dims(dims)
        attrs = {"kernel": list(self.kernel), "stride": list(self.stride), "pad": list(self.pad)}
        ctx.task(
            self.stem,
            self.KIND,
            "forward",
            space,
            [("input", x, R_), ("output", y, W_)],
            self.name,
            attrs,
            dist_roles=("input",),
        )

        def backward() -> None:
            if not ctx.needs_grad(x):
                return
            bindings = [("output.delta", ctx.grad(y), R_)]
            if self.BACKWARD_READS_INPUT:
                bindings.append(("input", x, R_))
            bindings.append(("input.delta", ctx.grad(x), RD))
            ctx.task(
                f"{self.stem}.grad",
                self.KIND,
                "backward",
                space,
                bindings,
                self.name,
                attrs,
                dist_roles=("input",),
            )

        ctx.on_backward(backward)
        return y


@layer_kind("avgpool")
@dataclass
class AvgPool(MaxPool):
    """The mean of each window over its real cells (padding is not counted)."""

    BACKWARD_READS_INPUT: ClassVar[bool] = False
