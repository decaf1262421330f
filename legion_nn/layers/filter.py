"""`filter` (untied or tied 8-D filters) and `conv` (a tied filter with a per-channel bias).

Filter weights are 8-D, (K, 1, 1, C, R, S, P, Q): K output channels, C input channels, an R×S
window and P×Q weight sets, one per output position when untied (a locally connected layer),
P = Q = 1 when tied (an ordinary convolution). Axes 1 and 2 are unit axes in every seed layer;
legion-nn keeps them so weights stay in the seed's shape. A grouped convolution (`conv` with
`groups` > 1) keeps the same 8-D shape with axis 3 counting the input channels of one group, C/g,
and lowers to op `group_conv` (`legion_nn.layers.group_conv`); with one group it is this module's
`conv`, unchanged.

Both ops iterate over the output times the input channels they sum over, (N, K, P, Q, C). A
piece of input channels [c0, c1) reads those channels of the input and of the weights and writes
a partial sum of its output (the piece with c0 = 0 adds conv's bias). A piece of rows [p0, p1)
reads input rows [p0·s − pad_top, (p1−1)·s − pad_top + R) clipped to the input: the halo. It reads the weight sets
of its own positions when untied (so spatial partitioning keeps untied weights local) and all of
them when tied. Its backward reduces into the same input halo and weight rect; with
`update_channels` [lo, hi) the weight gradient and the update cover only those input channels
(a sparse update), and the kernels skip the other channels' work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from legion_nn import registry
from legion_nn.access import columns, window_span, window_spans
from legion_nn.errors import ShapeError
from legion_nn.layers.base import (
    Layer,
    Shape,
    backward_factor,
    layer_kind,
    padding,
    pair,
    positive,
    window_out,
)
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

R_, W_, RD = Privilege.READ, Privilege.WRITE, Privilege.REDUCE


def _input_halo(
    attrs: Mapping[str, Any], input_dims: tuple, piece: Rect, channels: tuple[int, int]
) -> Rect:
    """What a (non-empty) piece of a filter's space reads of its input: its samples, the input
    `channels` [lo, hi), and the rows and columns its windows reach, clipped to the input; empty
    where they reach none (every window in the padding)."""
    _, _, h_in, w_in = input_dims
    kernel_r, kernel_s = attrs["kernel"]
    stride = attrs["stride"]
    top, _, left, _ = attrs["pad"]
    rows = window_span(piece.lo[2], piece.hi[2], stride, top, kernel_r, h_in)
    cols = window_span(piece.lo[3], piece.hi[3], stride, left, kernel_s, w_in)
    if rows == (0, 0) or cols == (0, 0):
        return Rect.empty(4)
    lo, hi = channels
    return Rect((piece.lo[0], lo, rows[0], cols[0]), (piece.hi[0], hi, rows[1], cols[1]))


def _filter_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    kernel_r, kernel_s = attrs["kernel"]
    if piece.is_empty():
        empty4, empty8 = Rect.empty(4), Rect.empty(8)
        return {
            "input": empty4,
            "filters": empty8,
            "output": empty4,
            "output.delta": empty4,
            "input.delta": empty4,
            "filters.delta": empty8,
            "b": empty4,
            "b.delta": empty4,
        }
    _, k0, p0, q0, c0 = piece.lo
    _, k1, p1, q1, c1 = piece.hi
    output = Rect(piece.lo[:4], piece.hi[:4])
    halo = _input_halo(attrs, dims["input"], piece, (c0, c1))
    untied = attrs["untied"]
    pos_lo = (p0, q0) if untied else (0, 0)
    pos_hi = (p1, q1) if untied else (1, 1)
    weights = Rect((k0, 0, 0, c0, 0, 0) + pos_lo, (k1, 1, 1, c1, kernel_r, kernel_s) + pos_hi)
    c_lo, c_hi = attrs.get("channels") or (c0, c1)
    c_lo, c_hi = max(c_lo, c0), min(c_hi, c1)
    delta = Rect((k0, 0, 0, c_lo, 0, 0) + pos_lo, (k1, 1, 1, c_hi, kernel_r, kernel_s) + pos_hi)
    if c_hi <= c_lo:
        delta = Rect.empty(8)
    # the bias is added once, by the piece starting the sum over input channels
    bias = Rect((0, k0, 0, 0), (1, k1, 1, 1)) if c0 == 0 else Rect.empty(4)
    return {
        "input": halo,
        "filters": weights,
        "output": output,
        "output.delta": output,
        "input.delta": halo,
        "filters.delta": delta,
        "b": bias,
        "b.delta": bias,
    }


def _filter_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`_filter_rects` over arrays of pieces."""
    n = len(lo)
    _, _, h_in, w_in = dims["input"]
    kernel_r, kernel_s = attrs["kernel"]
    stride = attrs["stride"]
    top, _, left, _ = attrs["pad"]
    n0, k0, p0, q0, c0 = lo.T
    n1, k1, p1, q1, c1 = hi.T
    rows = window_spans(p0, p1, stride, top, kernel_r, h_in)
    cols = window_spans(q0, q1, stride, left, kernel_s, w_in)
    halo = (columns(n, n0, c0, rows[0], cols[0]), columns(n, n1, c1, rows[1], cols[1]))
    if attrs["untied"]:
        pos_lo, pos_hi = (p0, q0), (p1, q1)
    else:
        pos_lo, pos_hi = (0, 0), (1, 1)
    c_lo, c_hi = attrs.get("channels") or (c0, c1)
    c_lo, c_hi = np.maximum(c_lo, c0), np.minimum(c_hi, c1)
    weights = (
        columns(n, k0, 0, 0, c0, 0, 0, *pos_lo),
        columns(n, k1, 1, 1, c1, kernel_r, kernel_s, *pos_hi),
    )
    delta = (
        columns(n, k0, 0, 0, c_lo, 0, 0, *pos_lo),
        columns(n, k1, 1, 1, c_hi, kernel_r, kernel_s, *pos_hi),
    )
    bias = (columns(n, 0, k0, 0, 0), columns(n, 1, k1, 1, 1))
    for role_lo, role_hi, empty in ((*delta, c_hi <= c_lo), (*bias, c0 != 0)):
        role_lo[empty] = 0
        role_hi[empty] = 0
    found = {
        "input": halo,
        "filters": weights,
        "output": (lo[:, :4], hi[:, :4]),
        "output.delta": (lo[:, :4], hi[:, :4]),
        "input.delta": halo,
        "filters.delta": delta,
        "b": bias,
        "b.delta": bias,
    }
    return {role: found[role] for role in dims}


def _window(dims: Mapping[str, tuple]) -> int:
    """Inputs one output element reads of one input channel: R·S."""
    filters = dims["filters"]
    return filters[4] * filters[5]


def _per_channel(bias_flops: int, dims: Mapping[str, tuple]) -> float:
    """A bias's FLOPs per output element, spread over the input channels of the space."""
    return bias_flops / dims["filters"][3]


def _passes(attrs: Mapping[str, Any], phase: str) -> tuple[str, tuple[tuple[str, float], ...]]:
    """Rates differ tied and untied; a backward splits its FLOPs over the data and filter passes."""
    variant = "untied" if attrs.get("untied") else "tied"
    if phase == "forward":
        return variant, (("forward", 1.0),)
    if attrs.get("need_dx", True):
        return variant, (("backward_data", 0.5), ("backward_filter", 0.5))
    return variant, (("backward_filter", 1.0),)


def _record(op: str, bias_flops: int) -> None:
    """`conv` adds its bias: one more FLOP per output element each way."""
    registry.register(
        op,
        phases={
            "forward": {
                "access": _filter_rects,
                "box_map": _filter_boxes,
                "flops": lambda attrs, dims: 2 * _window(dims) + _per_channel(bias_flops, dims),
                "adapter": f"{op}.forward",
            },
            "backward": {
                "access": _filter_rects,
                "box_map": _filter_boxes,
                "flops": lambda attrs, dims: (
                    backward_factor(attrs) * _window(dims) + _per_channel(bias_flops, dims)
                ),
                "adapter": f"{op}.backward",
                # untied weights: the kernel steps them block by block; a tied filter's
                # gradient is summed over every position before any of it is final
                "steps": lambda attrs: "filters.delta" if attrs.get("untied") else None,
            },
        },
        splittable=registry.EVERY_DIM,
        homing=registry.GRID,
        packed_role="filters",
        owner_role=None,
        passes=_passes,
        sums_over=1,
    )


_record("filter", bias_flops=0)
_record("conv", bias_flops=1)


@layer_kind("filter")
@dataclass
class Filter(Layer):
    out_channels: int = 1
    kernel: Any = 3
    untied: bool = True
    stride: int = 1
    pad: Any = 0
    update_channels: list[int] | None = field(default=None)
    init_std: float | None = None

    def __post_init__(self) -> None:
        positive(self.out_channels, "out_channels")
        self.kernel = pair(self.kernel, "kernel")
        positive(self.stride, "stride")
        self.pad = padding(self.pad)
        if not isinstance(self.untied, bool):
            raise TypeError(f"untied must be true or false, got {self.untied!r}")
        if self.update_channels is not None:
            lo_hi = self.update_channels
            if (
                not isinstance(lo_hi, (list, tuple))
                or len(lo_hi) != 2
                or not 0 <= lo_hi[0] < lo_hi[1]
            ):
                raise ValueError(
                    f"update_channels must be [lo, hi) with 0 <= lo < hi, got {lo_hi!r}"
                )
            self.update_channels = [int(lo_hi[0]), int(lo_hi[1])]

    def out_shape(self, shape: Shape) -> Shape:
        rows, cols = window_out(self, shape, self.kernel, (self.stride, self.stride), self.pad)
        if self.update_channels is not None and self.update_channels[1] > shape[0]:
            raise ShapeError(
                f"{self.label}: update_channels {self.update_channels} exceed its "
                f"{shape[0]} input channels; use a range within [0, {shape[0]})"
            )
        return (self.out_channels, rows, cols)

    def weight_dims(self, shape: Shape) -> tuple[int, ...]:
        _, rows, cols = self.out_shape(shape)
        positions = (rows, cols) if self.untied else (1, 1)
        return (self.out_channels, 1, 1, self._summed(shape)) + tuple(self.kernel) + positions

    def _op(self) -> str:
        return self.KIND

    def _summed(self, shape: Shape) -> int:
        """The input channels each output channel sums over."""
        return shape[0]

    def attrs(self) -> dict[str, Any]:
        return {
            "kernel": list(self.kernel),
            "stride": self.stride,
            "pad": list(self.pad),
            "untied": self.untied,
        }

    def init(self, shape: Shape) -> str:
        if self.init_std is not None:
            return f"normal:{self.init_std}"
        return f"he:{self._summed(shape) * self.kernel[0] * self.kernel[1]}"

    def lower(self, ctx, x: str, shape: Shape) -> str:
        batch = ctx.batch
        k, rows, cols = self.out_shape(shape)
        weights = ctx.param(f"{self.name}.W", self.weight_dims(shape), self.init(shape))
        bias = self._bias(ctx)
        y = ctx.tensor(f"{self.stem}.output", (batch, k, rows, cols), "activation")
        result = Rect.from_dims((batch, k, rows, cols))
        # × the input channels summed
        space = Rect.from_dims((batch, k, rows, cols, self._summed(shape)))
        attrs = self.attrs()
        op = self._op()
        inputs = [("input", x, R_), ("filters", weights, R_)]
        if bias:
            inputs.append(("b", bias, R_))
        ctx.task(
            self.stem,
            op,
            "forward",
            space,
            inputs + [("output", y, W_)],
            self.name,
            attrs,
            dist_roles=("input", "filters"),
            result=result,
        )

        def backward() -> None:
            need_dx = ctx.needs_grad(x)
            grad_attrs = {**attrs, "need_dx": need_dx, "channels": self.update_channels}
            bindings = [("output.delta", ctx.grad(y), R_)] + inputs
            if need_dx:
                bindings.append(("input.delta", ctx.grad(x), RD))
            bindings.append(("filters.delta", ctx.grad(weights), RD))
            if bias:
                bindings.append(("b.delta", ctx.grad(bias), RD))
            ctx.task(
                f"{self.stem}.grad",
                op,
                "backward",
                space,
                bindings,
                self.name,
                grad_attrs,
                dist_roles=("input", "filters"),
                result=result,
            )
            ctx.update(weights, f"update_{self.name}.W", self.name, self._update_rect(ctx, weights))
            if bias:
                ctx.update(bias, f"update_{self.name}.b", self.name)

        ctx.on_backward(backward)
        return y

    def _bias(self, ctx) -> str | None:
        return None

    def _update_rect(self, ctx, weights: str) -> Rect | None:
        if self.update_channels is None:
            return None
        dims = ctx.dims(weights)
        lo, hi = self.update_channels
        return Rect((0, 0, 0, lo, 0, 0, 0, 0), dims[:3] + (hi,) + dims[4:])


@layer_kind("conv")
@dataclass
class Conv(Filter):
    """A tied filter plus a bias per output channel (the notebook's and VGG19's convolution)."""

    untied: bool = False
    bias: bool = True
    #: channel groups (ONNX Conv's `group`; depthwise when it equals the input channels): output
    #: channel k reads only the input channels of group k // (out_channels / groups)
    groups: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.untied:
            raise ValueError("conv is the tied filter; use a filter layer for untied weights")
        positive(self.groups, "groups")
        if self.out_channels % self.groups:
            raise ValueError(
                f"{self.label}: groups {self.groups} must divide out_channels {self.out_channels}"
            )
        if self.groups > 1 and self.update_channels is not None:
            # a range of input channels names different weights in every group
            raise ValueError(f"{self.label}: update_channels needs groups 1, got {self.groups}")

    def out_shape(self, shape: Shape) -> Shape:
        if len(shape) == 3 and shape[0] % self.groups:
            raise ShapeError(
                f"{self.label}: groups {self.groups} must divide its {shape[0]} input channels "
                f"(input shape {list(shape)})"
            )
        return super().out_shape(shape)

    def _summed(self, shape: Shape) -> int:
        return shape[0] // self.groups

    def _op(self) -> str:
        # one group is the plain conv with its packed kernels, and its graph stays as it was
        return "group_conv" if self.groups > 1 else self.KIND

    def attrs(self) -> dict[str, Any]:
        attrs = super().attrs()
        if self.groups > 1:
            attrs["groups"] = self.groups
        return attrs

    def to_spec(self) -> dict[str, Any]:
        spec = super().to_spec()
        if self.groups == 1:  # specs, and the checkpoints that hash them, stay as they were
            del spec["groups"]
        return spec

    def _bias(self, ctx) -> str | None:
        if not self.bias:
            return None
        return ctx.param(f"{self.name}.b", (1, self.out_channels, 1, 1), "zeros")
