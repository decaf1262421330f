"""Kernel adapters: how each (op, phase) runs one piece of a task on NumPy views.

An adapter gets the task, the piece of its space, the views of its requirements' rects (by role),
the dims of the tensors bound to each role, and the step context. It returns the arrays to store
by role: a `write` requirement's view is overwritten with them, a `reduce` requirement's view
accumulates them; `read_write` requirements are updated in place by the adapter. Because the
views are exactly the rects of the access map, the same adapters serve the local executor (one
piece per task) and the MPI executor (a rank's pieces, with halos received from other ranks).

Windowed ops get the clipped halo plus the padding of their own border (`window_padding`), so an
interior piece is computed without padding and a border piece with its side of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from legion_nn.access import window_padding
from legion_nn.ir import Task
from legion_nn.rect import Rect
from runtime.kernels import (
    affine,
    batchnorm,
    dropout,
    filter_packed,
    layout,
    linear,
    nonlinear,
    pool,
    softmax,
    update,
)
from runtime.kernels import conv as conv_kernels
from runtime.kernels import filter as filter_kernels


@dataclass
class StepContext:
    """What a step's tasks need besides tensors: its number, its batch, and returned values."""

    step: int
    #: False for evaluation: dropout passes its input through, batchnorm uses running statistics
    training: bool = True
    inputs: np.ndarray | None = None
    labels: np.ndarray | None = None
    futures: dict[str, Any] = field(default_factory=dict)


Views = Mapping[str, np.ndarray]
Dims = Mapping[str, tuple[int, ...]]
Adapter = Callable[[Task, Rect, Views, Dims, StepContext], dict[str, np.ndarray]]
ADAPTERS: dict[tuple[str, str], Adapter] = {}


def adapter(op: str, phase: str):
    def wrap(fn: Adapter) -> Adapter:
        ADAPTERS[(op, phase)] = fn
        return fn

    return wrap


def run_piece(task: Task, piece: Rect, views: Views, dims: Dims, ctx: StepContext) -> dict:
    try:
        fn = ADAPTERS[(task.op, task.phase)]
    except KeyError:
        raise NotImplementedError(f"no kernel for op {task.op!r} in phase {task.phase!r}") from None
    return fn(task, piece, views, dims, ctx)


def _pads(task: Task, piece: Rect, dims: Dims) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) zero padding of this piece's halo."""
    _, _, height, width = dims["input"]
    kernel = task.attrs["kernel"]
    stride = task.attrs["stride"]
    rows_stride, cols_stride = (stride, stride) if isinstance(stride, int) else stride
    top, _, left, _ = task.attrs["pad"]
    rows = window_padding(piece.lo[2], piece.hi[2], rows_stride, top, kernel[0], height)
    cols = window_padding(piece.lo[3], piece.hi[3], cols_stride, left, kernel[1], width)
    return rows + cols


@adapter("data", "forward")
def _data(task, piece, views, dims, ctx):
    out = {"raw_data": ctx.inputs[piece.to_slices()]}
    if views["labels"].size:
        out["labels"] = ctx.labels[piece.lo[0] : piece.hi[0]].reshape(views["labels"].shape)
    return out


def _packed_filter_forward(task, piece, views, dims) -> np.ndarray:
    """The filter of a piece, weights in the packed instance (see runtime.instances)."""
    xp = layout.pack_activations(views["input"])
    yp = filter_packed.forward_packed(
        xp, views["filters"], task.attrs["stride"], _pads(task, piece, dims)
    )
    return layout.unpack_activations(yp)


def _packed_filter_backward(task, piece, views, dims) -> dict[str, np.ndarray]:
    """dx and dw of a piece; dw accumulates straight into the packed gradient when it can."""
    pads, stride = _pads(task, piece, dims), task.attrs["stride"]
    x, weights = views["input"], views["filters"]
    dyp, xp = layout.pack_activations(views["output.delta"]), layout.pack_activations(x)
    out: dict[str, np.ndarray] = {}
    if task.attrs["need_dx"]:
        dxp = filter_packed.backward_data_packed(dyp, weights, x.shape[2:], stride, pads)
        out["input.delta"] = layout.unpack_activations(dxp)
    channels = task.attrs.get("channels")
    window = tuple(task.attrs["kernel"])
    untied = task.attrs["untied"]
    grad = views["filters.delta"]
    if grad.flags.c_contiguous:  # a reduction done by the kernel itself, in place
        filter_packed.backward_filter_packed(
            dyp,
            xp,
            window,
            stride,
            pads,
            untied,
            channels and tuple(channels),
            out=grad,
            accumulate=True,
        )
    else:  # a sub-block of channels or positions: reduce through a temporary of its size
        out["filters.delta"] = filter_packed.backward_filter_packed(
            dyp, xp, window, stride, pads, untied, channels and tuple(channels)
        )
    return out


@adapter("filter", "forward")
def _filter(task, piece, views, dims, ctx):
    if views["filters"].ndim == 6:
        return {"output": _packed_filter_forward(task, piece, views, dims)}
    pads = _pads(task, piece, dims)
    y = filter_kernels.filter_forward(views["input"], views["filters"], task.attrs["stride"], pads)
    return {"output": y}


@adapter("filter", "backward")
def _filter_grad(task, piece, views, dims, ctx):
    if views["filters"].ndim == 6:
        return _packed_filter_backward(task, piece, views, dims)
    pads = _pads(task, piece, dims)
    channels = task.attrs.get("channels")
    dx, dw = filter_kernels.filter_backward(
        views["output.delta"],
        views["input"],
        views["filters"],
        task.attrs["stride"],
        pads,
        channels=tuple(channels) if channels else None,
        need_dx=task.attrs["need_dx"],
    )
    out = {"filters.delta": dw}
    if dx is not None:
        out["input.delta"] = dx
    return out


@adapter("conv", "forward")
def _conv(task, piece, views, dims, ctx):
    if views["filters"].ndim == 6:
        y = _packed_filter_forward(task, piece, views, dims)
        if "b" in views:
            y += views["b"]
        return {"output": y}
    pads = _pads(task, piece, dims)
    weights, stride = views["filters"], task.attrs["stride"]
    if "b" not in views:
        return {"output": filter_kernels.filter_forward(views["input"], weights, stride, pads)}
    return {"output": conv_kernels.conv_forward(views["input"], weights, views["b"], stride, pads)}


@adapter("conv", "backward")
def _conv_grad(task, piece, views, dims, ctx):
    if views["filters"].ndim == 6:
        out = _packed_filter_backward(task, piece, views, dims)
        if "b.delta" in views:
            dy = views["output.delta"]
            out["b.delta"] = (
                dy.sum(axis=(0, 2, 3), dtype=np.float64)
                .astype(dy.dtype)
                .reshape(views["b.delta"].shape)
            )
        return out
    pads = _pads(task, piece, dims)
    need_dx = task.attrs["need_dx"]
    out = {}
    if "b.delta" in views:
        dx, dw, db = conv_kernels.conv_backward(
            views["output.delta"],
            views["input"],
            views["filters"],
            task.attrs["stride"],
            pads,
            need_dx=need_dx,
        )
        out["b.delta"] = db
    else:
        dx, dw = filter_kernels.filter_backward(
            views["output.delta"],
            views["input"],
            views["filters"],
            task.attrs["stride"],
            pads,
            need_dx=need_dx,
        )
    out["filters.delta"] = dw
    if dx is not None:
        out["input.delta"] = dx
    return out


@adapter("filterA", "forward")
def _affine(task, piece, views, dims, ctx):
    return {"output": affine.filterA_forward(views["input"], views["a"], views["b"])}


@adapter("filterA", "backward")
def _affine_grad(task, piece, views, dims, ctx):
    need_dx = "input.delta" in views
    dx, da, db = affine.filterA_backward(
        views["output.delta"], views["input"], views["a"], need_dx=need_dx
    )
    out = {"a.delta": da, "b.delta": db}
    if need_dx:
        out["input.delta"] = dx
    return out


@adapter("filterNL", "forward")
def _nonlinear(task, piece, views, dims, ctx):
    return {"output": nonlinear.filterNL_forward(views["input"], task.attrs["fn"])}


@adapter("filterNL", "backward")
def _nonlinear_grad(task, piece, views, dims, ctx):
    dx = nonlinear.filterNL_backward(views["output.delta"], views["output"], task.attrs["fn"])
    return {"input.delta": dx}


@adapter("linear", "forward")
def _linear(task, piece, views, dims, ctx):
    return {"output": linear.linear_forward(views["input"], views["weights"], views.get("b"))}


@adapter("linear", "backward")
def _linear_grad(task, piece, views, dims, ctx):
    need_dx, grad = task.attrs["need_dx"], views["weights.delta"]
    dy, x, weights = views["output.delta"], views["input"], views["weights"]
    out = {}
    if grad.flags.c_contiguous:  # reduce straight into the gradient: no weight-sized temporary
        linear.linear_weight_grad_accumulate(dy, x, grad)
        n, m = dy.shape[0], dy.shape[1]
        if need_dx:
            dx = np.dot(dy.reshape(n, m), weights.reshape(m, -1)).reshape(x.shape)
            out["input.delta"] = dx
        if "b.delta" in views:
            out["b.delta"] = dy.sum(axis=0, dtype=np.float64).astype(dy.dtype).reshape(1, m, 1, 1)
        return out
    dx, dw, db = linear.linear_backward(dy, x, weights, need_dx=need_dx, need_db="b.delta" in views)
    out["weights.delta"] = dw
    if dx is not None:
        out["input.delta"] = dx
    if db is not None:
        out["b.delta"] = db
    return out


@adapter("softmax", "forward")
def _softmax(task, piece, views, dims, ctx):
    prob, loss = softmax.softmax_forward(views["input"], views["labels"], task.attrs["batch_total"])
    return {"probability": prob, "output": loss}


@adapter("softmax", "backward")
def _softmax_grad(task, piece, views, dims, ctx):
    prob, labels = views["probability"], views["labels"]
    total = task.attrs["batch_total"]
    classes = dims["probability"][1]
    if piece.lo[1] == 0 and piece.hi[1] == classes:
        return {"input.delta": softmax.softmax_backward(prob, labels, total)}
    # A piece holding some classes only: (p - onehot) / N restricted to its columns.
    dx = prob / total
    local = labels.reshape(-1).astype(np.int64) - piece.lo[1]
    rows = np.nonzero((local >= 0) & (local < prob.shape[1]))[0]
    dx[rows, local[rows], 0, 0] -= 1.0 / total
    return {"input.delta": dx}


@adapter("evaluate", "forward")
def _evaluate(task, piece, views, dims, ctx):
    return {"output": softmax.evaluate_forward(views["probability"], views["labels"])}


@adapter("accuracy", "forward")
def _accuracy(task, piece, views, dims, ctx):
    ctx.futures[task.name] = softmax.accuracy(views["input"])
    return {}


@adapter("maxpool", "forward")
def _pool(task, piece, views, dims, ctx):
    pads = _pads(task, piece, dims)
    y = pool.maxpool_forward(views["input"], task.attrs["kernel"], task.attrs["stride"], pads)
    return {"output": y}


@adapter("maxpool", "backward")
def _pool_grad(task, piece, views, dims, ctx):
    pads = _pads(task, piece, dims)
    dx = pool.maxpool_backward(
        views["output.delta"], views["input"], task.attrs["kernel"], task.attrs["stride"], pads
    )
    return {"input.delta": dx}


@adapter("dropout", "forward")
def _dropout(task, piece, views, dims, ctx):
    if not ctx.training:
        return {"output": views["input"]}
    y = dropout.dropout_forward(
        views["input"],
        task.attrs["ratio"],
        task.attrs["seed"],
        ctx.step,
        piece.lo,
        dims["input"],
    )
    return {"output": y}


@adapter("dropout", "backward")
def _dropout_grad(task, piece, views, dims, ctx):
    dx = dropout.dropout_backward(
        views["output.delta"],
        task.attrs["ratio"],
        task.attrs["seed"],
        ctx.step,
        piece.lo,
        dims["output.delta"],
    )
    return {"input.delta": dx}


def _per_feature(x: np.ndarray, spatial: bool) -> np.ndarray:
    """Vanilla batchnorm normalises each (c, h, w) over the batch: spatial batchnorm on (N, CHW)."""
    return x if spatial else x.reshape(x.shape[0], -1, 1, 1)


def _stats_view(stats: np.ndarray, spatial: bool) -> np.ndarray:
    return stats if spatial else stats.reshape(stats.shape[0], -1, 1, 1)


@adapter("batchnorm_stats", "forward")
def _bn_stats(task, piece, views, dims, ctx):
    spatial = task.attrs["spatial"]
    stats = batchnorm.batchnorm_stats(_per_feature(views["input"], spatial))
    return {"stats": stats.reshape(views["stats"].shape)}


@adapter("batchnorm", "forward")
def _bn(task, piece, views, dims, ctx):
    spatial, x = task.attrs["spatial"], views["input"]
    if not ctx.training:
        y = batchnorm.batchnorm_inference(
            _per_feature(x, spatial),
            _stats_view(views["running"], spatial),
            _stats_view(views["gamma"], spatial),
            _stats_view(views["beta"], spatial),
            task.attrs["eps"],
        )
        return {"output": y.reshape(x.shape)}
    y = batchnorm.batchnorm_forward(
        _per_feature(x, spatial),
        _stats_view(views["stats"], spatial),
        task.attrs["count"],
        _stats_view(views["gamma"], spatial),
        _stats_view(views["beta"], spatial),
        task.attrs["eps"],
    )
    return {"output": y.reshape(x.shape)}


@adapter("batchnorm_running", "forward")
def _bn_running(task, piece, views, dims, ctx):
    if not ctx.training:
        return {}
    spatial = task.attrs.get("spatial", True)
    running = _stats_view(views["running"], spatial)
    running[...] = batchnorm.batchnorm_running(
        running, _stats_view(views["stats"], spatial), task.attrs["count"], task.attrs["momentum"]
    )
    return {}


@adapter("batchnorm", "backward")
def _bn_param_grad(task, piece, views, dims, ctx):
    spatial = task.attrs["spatial"]
    dgamma, dbeta = batchnorm.batchnorm_param_backward(
        _per_feature(views["output.delta"], spatial),
        _per_feature(views["input"], spatial),
        _stats_view(views["stats"], spatial),
        task.attrs["count"],
        task.attrs["eps"],
    )
    shape = views["gamma.delta"].shape
    return {"gamma.delta": dgamma.reshape(shape), "beta.delta": dbeta.reshape(shape)}


@adapter("batchnorm_input", "backward")
def _bn_input_grad(task, piece, views, dims, ctx):
    spatial, x = task.attrs["spatial"], views["input"]
    dx = batchnorm.batchnorm_input_backward(
        _per_feature(views["output.delta"], spatial),
        _per_feature(x, spatial),
        _stats_view(views["stats"], spatial),
        task.attrs["count"],
        _stats_view(views["gamma"], spatial),
        _stats_view(views["gamma.delta"], spatial),
        _stats_view(views["beta.delta"], spatial),
        task.attrs["eps"],
    )
    return {"input.delta": dx.reshape(x.shape)}


@adapter("reshape", "forward")
def _reshape(task, piece, views, dims, ctx):
    return {"output": views["input"].reshape(views["output"].shape)}


@adapter("reshape", "backward")
def _reshape_grad(task, piece, views, dims, ctx):
    return {"input.delta": views["output.delta"].reshape(views["input.delta"].shape)}


@adapter("set_zero", "set_zero")
def _set_zero(task, piece, views, dims, ctx):
    views["output"][...] = 0
    return {}


@adapter("update", "update")
def _update(task, piece, views, dims, ctx):
    attrs, params, grad = task.attrs, views["params"], views["gradient"]
    if attrs["optimizer"] == "sgd":
        update.sgd_update(params, grad, attrs["lr"])
    elif attrs["optimizer"] == "momentum":
        update.momentum_update(params, grad, views["velocity"], attrs["lr"], attrs["momentum"])
    else:
        update.adam_update(
            params,
            grad,
            views["m"],
            views["v"],
            attrs["lr"],
            attrs["beta1"],
            attrs["beta2"],
            attrs["eps"],
            ctx.step + 1,
        )
    return {}
