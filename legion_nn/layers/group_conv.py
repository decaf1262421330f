"""`group_conv`: the op of a `conv` layer with `groups` > 1 (ONNX Conv's `group`).

Output channel k belongs to group k // Kg (Kg = K/g) and sums over that group's Cg = C/g input
channels only. Weights keep the filter's 8-D shape, (K, 1, 1, Cg, R, S, 1, 1): axis 3 counts the
input channels of one group. The op's space is (N, K, P, Q, Cg), the output times the input
channels of a group, so the built-in strategies see it exactly as they see a conv's (N, K, P, Q,
C): `model` cuts output channels, and a cut of dim 4 sums partial outputs.

A piece (n0..n1, k0..k1, p0..p1, q0..q1, c0..c1) spans groups g0 = k0 // Kg to g1 = (k1 − 1) //
Kg + 1 and reads input channels [g0·Cg + c0, (g1 − 1)·Cg + c1): exactly its channels when it
lies in one group or covers whole groups, else also the channels between its groups' parts (a
rect cannot skip them; their gradient comes back zero). Rows and columns are the window's halo,
as for `filter`. It reads filters (k0..k1, 0, 0, c0..c1, R, S, 0..1, 0..1) and the bias of its
output channels if it starts the sum (c0 = 0); its backward reduces into the same rects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from legion_nn import registry
from legion_nn.access import columns, window_spans
from legion_nn.layers.base import backward_factor
from legion_nn.layers.filter import _input_halo, _passes, _per_channel, _window
from legion_nn.rect import Rect

OP = "group_conv"

ROLES4 = ("input", "output", "output.delta", "input.delta", "b", "b.delta")


def _groups(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> tuple[int, int]:
    """(Kg, Cg): output and input channels per group."""
    filters = dims["filters"] if "filters" in dims else dims["filters.delta"]
    return filters[0] // attrs["groups"], filters[3]


def group_conv_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    """The access map of a piece of a `group_conv` task (the module docstring)."""
    if piece.is_empty():
        empty = {role: Rect.empty(4) for role in ROLES4}
        return {**empty, "filters": Rect.empty(8), "filters.delta": Rect.empty(8)}
    input_dims = dims["input"] if "input" in dims else dims["input.delta"]
    kernel_r, kernel_s = attrs["kernel"]
    kg, cg = _groups(attrs, dims)
    k0, c0 = piece.lo[1], piece.lo[4]
    k1, c1 = piece.hi[1], piece.hi[4]
    g0, g1 = k0 // kg, (k1 - 1) // kg + 1
    output = Rect(piece.lo[:4], piece.hi[:4])
    halo = _input_halo(attrs, input_dims, piece, (g0 * cg + c0, (g1 - 1) * cg + c1))
    weights = Rect((k0, 0, 0, c0, 0, 0, 0, 0), (k1, 1, 1, c1, kernel_r, kernel_s, 1, 1))
    # the bias is added once, by the piece starting the sum over a group's input channels
    bias = Rect((0, k0, 0, 0), (1, k1, 1, 1)) if c0 == 0 else Rect.empty(4)
    return {
        "input": halo,
        "filters": weights,
        "output": output,
        "output.delta": output,
        "input.delta": halo,
        "filters.delta": weights,
        "b": bias,
        "b.delta": bias,
    }


def group_conv_boxes(attrs: Mapping[str, Any], dims: Mapping[str, tuple], lo, hi) -> dict:
    """`group_conv_rects` over arrays of pieces."""
    n = len(lo)
    _, _, h_in, w_in = dims["input"] if "input" in dims else dims["input.delta"]
    kernel_r, kernel_s = attrs["kernel"]
    stride = attrs["stride"]
    top, _, left, _ = attrs["pad"]
    kg, cg = _groups(attrs, dims)
    n0, k0, p0, q0, c0 = lo.T
    n1, k1, p1, q1, c1 = hi.T
    g0, g1 = k0 // kg, (k1 - 1) // kg + 1
    rows = window_spans(p0, p1, stride, top, kernel_r, h_in)
    cols = window_spans(q0, q1, stride, left, kernel_s, w_in)
    halo = (
        columns(n, n0, g0 * cg + c0, rows[0], cols[0]),
        columns(n, n1, (g1 - 1) * cg + c1, rows[1], cols[1]),
    )
    weights = (
        columns(n, k0, 0, 0, c0, 0, 0, 0, 0),
        columns(n, k1, 1, 1, c1, kernel_r, kernel_s, 1, 1),
    )
    bias = (columns(n, 0, k0, 0, 0), columns(n, 1, k1, 1, 1))
    bias[0][c0 != 0] = 0
    bias[1][c0 != 0] = 0
    found = {
        "input": halo,
        "filters": weights,
        "output": (lo[:, :4], hi[:, :4]),
        "output.delta": (lo[:, :4], hi[:, :4]),
        "input.delta": halo,
        "filters.delta": weights,
        "b": bias,
        "b.delta": bias,
    }
    return {role: found[role] for role in dims}


def _forward_flops(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> float:
    return 2 * _window(dims) + _per_channel(1, dims)


def _backward_flops(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> float:
    return backward_factor(attrs) * _window(dims) + _per_channel(1, dims)


registry.register(
    OP,
    phases={
        "forward": {
            "access": group_conv_rects,
            "box_map": group_conv_boxes,
            "flops": _forward_flops,
            "adapter": f"{OP}.forward",
        },
        "backward": {
            "access": group_conv_rects,
            "box_map": group_conv_boxes,
            "flops": _backward_flops,
            "adapter": f"{OP}.backward",
        },
    },
    splittable=registry.EVERY_DIM,
    homing=registry.GRID,
    # the kernels read plain (K, 1, 1, Cg, R, S, 1, 1) weights, group by group
    packed_role=None,
    owner_role=None,
    passes=_passes,
    sums_over=1,
)
