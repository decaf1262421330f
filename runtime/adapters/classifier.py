"""Adapters of the classifier ops: `linear`, `softmax`, `evaluate` and `accuracy`.

The linear weight gradient is as large as the weights, so when its view is contiguous it is
accumulated in place by one GEMM rather than returned and added, or, where the update is fused
into the task, never stored: its blocks step the weights (`StepContext.steps`).
"""

from __future__ import annotations

import numpy as np

from runtime.adapters.registry import adapter
from runtime.kernels import linear, softmax


@adapter("linear.forward")
def _linear(task, piece, views, dims, ctx):
    return {"output": linear.linear_forward(views["input"], views["weights"], views.get("b"))}


@adapter("linear.backward")
def _linear_grad(task, piece, views, dims, ctx):
    need_dx, grad = task.attrs["need_dx"], views.get("weights.delta")
    dy, x, weights = views["output.delta"], views["input"], views["weights"]
    step = ctx.steps.get("weights.delta")
    out = {}
    if step is not None or grad.flags.c_contiguous:
        m = dy.shape[1]
        if need_dx:  # first: a fused step changes the weights it reads
            out["input.delta"] = linear.linear_input_grad(dy, weights, x.shape)
        if "b.delta" in views:
            out["b.delta"] = dy.sum(axis=0, dtype=np.float64).astype(dy.dtype).reshape(1, m, 1, 1)
        if step is not None:  # the update fused into this task: the gradient is not stored
            linear.linear_weight_grad_step(dy, x, step)
        else:  # reduce straight into the gradient: no weight-sized temporary
            linear.linear_weight_grad_accumulate(dy, x, grad, "weights.delta" not in ctx.fresh)
        return out
    dx, dw, db = linear.linear_backward(dy, x, weights, need_dx=need_dx, need_db="b.delta" in views)
    out["weights.delta"] = dw
    if dx is not None:
        out["input.delta"] = dx
    if db is not None:
        out["b.delta"] = db
    return out


@adapter("softmax.forward")
def _softmax(task, piece, views, dims, ctx):
    prob, loss = softmax.softmax_forward(views["input"], views["labels"], task.attrs["batch_total"])
    return {"probability": prob, "output": loss}


@adapter("softmax.backward")
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


@adapter("evaluate.forward")
def _evaluate(task, piece, views, dims, ctx):
    return {"output": softmax.evaluate_forward(views["probability"], views["labels"])}


@adapter("accuracy.forward")
def _accuracy(task, piece, views, dims, ctx):
    ctx.futures[task.name] = softmax.accuracy(views["input"])
    return {}
