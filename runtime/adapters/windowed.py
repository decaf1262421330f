"""Adapters of the windowed ops: `filter`, `conv`, `group_conv`, `maxpool` and `avgpool`.

Each gets the clipped halo of its piece plus the zero padding of its own border
(`window_padding`), so an interior piece runs without padding and a border piece with its side of
it. Filter weights kept in the packed instance (6-D views, see `runtime.instances`) go straight to
the packed kernels, and their gradients accumulate in place there. `group_conv` weights stay in
the logical layout: its views start at the piece's first output channel, first group and first
input channel of a group (`legion_nn.layers.group_conv`), which the piece kernels take as given.
"""

from __future__ import annotations

import numpy as np

from legion_nn.access import input_dims, window_padding
from legion_nn.rect import Rect
from runtime.adapters.registry import Dims, adapter, written_in_place
from runtime.kernels import _checks, conv, filter_packed, group_conv, layout, pool


def _pads(task, piece: Rect, dims: Dims) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) zero padding of this piece's halo."""
    _, _, height, width = input_dims(dims)
    kernel = task.attrs["kernel"]
    rows_stride, cols_stride = _checks.pair("stride", task.attrs["stride"])
    top, _, left, _ = task.attrs["pad"]
    rows = window_padding(piece.lo[2], piece.hi[2], rows_stride, top, kernel[0], height)
    cols = window_padding(piece.lo[3], piece.hi[3], cols_stride, left, kernel[1], width)
    return rows + cols


def _packed_filter_forward(task, piece, views, dims, out=None) -> np.ndarray:
    """The filter of a piece, weights in the packed instance (see runtime.instances), converted
    back into `out` where given (the step's buffer)."""
    xp = layout.pack_activations(views["input"])
    yp = filter_packed.forward_packed(
        xp, views["filters"], task.attrs["stride"], _pads(task, piece, dims)
    )
    return layout.unpack_activations(yp, out)


def _packed_filter_backward(task, piece, views, dims, ctx) -> dict[str, np.ndarray]:
    """dx and dw of a piece; dw accumulates straight into the packed gradient when it can, or
    is written there where it is the first contribution (`StepContext.fresh`), or steps the
    weights where the update is fused into the task (`StepContext.steps`)."""
    pads, stride = _pads(task, piece, dims), task.attrs["stride"]
    x, weights = views["input"], views["filters"]
    dyp, xp = layout.pack_activations(views["output.delta"]), layout.pack_activations(x)
    out: dict[str, np.ndarray] = {}
    if task.attrs["need_dx"]:  # first: a fused step (below) changes the weights it reads
        dx = written_in_place(task, views, ctx, "input.delta")
        if task.op == "conv" and conv.runs_pointwise(task.attrs["kernel"], task.attrs["pad"]):
            found = conv.pointwise_backward_data(
                views["output.delta"], weights, x.shape[2:], stride, out=dx
            )
        else:
            dxp = filter_packed.backward_data_packed(dyp, weights, x.shape[2:], stride, pads)
            found = layout.unpack_activations(dxp, dx)
        if dx is None:
            out["input.delta"] = found
    channels = _piece_channels(task, piece)
    window = tuple(task.attrs["kernel"])
    untied = task.attrs["untied"]
    step = ctx.steps.get("filters.delta")
    if step is not None:  # the update fused into this task: the gradient is not stored
        filter_packed.backward_filter_packed(
            dyp, xp, window, stride, pads, untied, channels, step=step
        )
        return out
    grad = views.get("filters.delta")
    if grad is None:  # the sparse update's channels lie outside this piece's
        return out
    if filter_packed.accumulates_in_place(grad):  # a reduction done by the kernel, in place
        filter_packed.backward_filter_packed(
            dyp,
            xp,
            window,
            stride,
            pads,
            untied,
            channels,
            out=grad,
            accumulate="filters.delta" not in ctx.fresh,
        )
    else:  # a sub-block of input channels: reduce through a temporary of its size
        out["filters.delta"] = filter_packed.backward_filter_packed(
            dyp, xp, window, stride, pads, untied, channels
        )
    return out


def _piece_channels(task, piece: Rect) -> tuple[int, int] | None:
    """The sparse update's input channels (`channels`) within the piece's, counted from the
    piece's first: its views hold input channels [piece.lo[4], piece.hi[4])."""
    channels = task.attrs.get("channels")
    if channels is None:
        return None
    first, last = piece.lo[4], piece.hi[4]
    return (max(channels[0], first) - first, min(channels[1], last) - first)


@adapter("filter.forward")
def _filter(task, piece, views, dims, ctx):
    # every executor keeps filter weights packed (`runtime.instances.choose_storage_orders`)
    y = written_in_place(task, views, ctx, "output")
    found = _packed_filter_forward(task, piece, views, dims, y)
    return {} if y is not None else {"output": found}


@adapter("filter.backward")
def _filter_grad(task, piece, views, dims, ctx):
    return _packed_filter_backward(task, piece, views, dims, ctx)


@adapter("conv.forward")
def _conv(task, piece, views, dims, ctx):
    """A tied filter plus a bias per output channel; a 1×1 one without padding as a product
    per sample (`conv.pointwise_forward`)."""
    attrs = task.attrs
    if conv.runs_pointwise(attrs["kernel"], attrs["pad"]):
        y = conv.pointwise_forward(views["input"], views["filters"], attrs["stride"])
    else:
        y = _packed_filter_forward(task, piece, views, dims)
    if "b" in views:
        y += views["b"]
    return {"output": y}


@adapter("conv.backward")
def _conv_grad(task, piece, views, dims, ctx):
    out = _filter_grad(task, piece, views, dims, ctx)
    if "b.delta" in views:
        out["b.delta"] = _bias_grad(views["output.delta"], views["b.delta"].shape)
    return out


def _bias_grad(dy: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A per-channel bias's gradient: dy summed over samples and positions (in float64)."""
    return dy.sum(axis=(0, 2, 3), dtype=np.float64).astype(dy.dtype).reshape(shape)


def _group_layout(task, piece: Rect, dims: Dims) -> tuple[int, int, int]:
    """(k0, Kg, Cg): the piece's first output channel, and channels per group out and in."""
    filters = dims["filters"]
    return piece.lo[1], filters[0] // task.attrs["groups"], filters[3]


def _empty_halo(piece: Rect, views) -> bool:
    # a piece whose every window lies in the padding reads no input: its output is the bias
    return "input" not in views and not piece.is_empty()


@adapter("group_conv.forward")
def _group_conv(task, piece, views, dims, ctx):
    b = views.get("b")
    if _empty_halo(piece, views):
        y = np.zeros(tuple(piece.shape[:4]), views["filters"].dtype)
        return {"output": y + b if b is not None else y}
    k0, kg, cg = _group_layout(task, piece, dims)
    y = group_conv.group_conv_forward_piece(
        views["input"],
        views["filters"],
        b,
        k0,
        kg,
        cg,
        task.attrs["stride"],
        _pads(task, piece, dims),
    )
    return {"output": y}


@adapter("group_conv.backward")
def _group_conv_grad(task, piece, views, dims, ctx):
    dy = views["output.delta"]
    out: dict[str, np.ndarray] = {}
    if _empty_halo(piece, views):
        if "filters.delta" in views:
            out["filters.delta"] = np.zeros_like(views["filters.delta"])
        db = _bias_grad(dy, (1, dy.shape[1], 1, 1))
    else:
        k0, kg, cg = _group_layout(task, piece, dims)
        need_dx = task.attrs["need_dx"] and "input.delta" in views
        dx, dw, db = group_conv.group_conv_backward_piece(
            dy,
            views["input"],
            views["filters"],
            k0,
            kg,
            cg,
            task.attrs["stride"],
            _pads(task, piece, dims),
            need_dx=need_dx,
        )
        if need_dx:
            out["input.delta"] = dx
        if "filters.delta" in views:
            out["filters.delta"] = dw
    if "b.delta" in views:  # the kernel's sum of dy, as `_bias_grad` forms it
        out["b.delta"] = db.reshape(views["b.delta"].shape)
    return out


def _pooling(forward):
    """The forward adapter of a pooling kernel (`maxpool_forward`, `avgpool_forward`)."""

    def run(task, piece, views, dims, ctx):
        pads = _pads(task, piece, dims)
        y = forward(views["input"], task.attrs["kernel"], task.attrs["stride"], pads)
        return {"output": y}

    return run


adapter("maxpool.forward")(_pooling(pool.maxpool_forward))
adapter("avgpool.forward")(_pooling(pool.avgpool_forward))


@adapter("maxpool.backward")
def _pool_grad(task, piece, views, dims, ctx):
    pads = _pads(task, piece, dims)
    dx = pool.maxpool_backward(
        views["output.delta"], views["input"], task.attrs["kernel"], task.attrs["stride"], pads
    )
    return {"input.delta": dx}


@adapter("avgpool.backward")
def _average_grad(task, piece, views, dims, ctx):
    pads = _pads(task, piece, dims)
    shape = views["input.delta"].shape
    dx = pool.avgpool_backward(
        views["output.delta"], shape, task.attrs["kernel"], task.attrs["stride"], pads
    )
    return {"input.delta": dx}
