"""Adapters of the classifier ops: `linear`, `softmax`, `evaluate` and `accuracy`.

The linear weight gradient is as large as the weights, so when its view is contiguous it is
accumulated in place by one GEMM rather than returned and added, or, where the update is fused
into the task, never stored: its blocks step the weights (`StepContext.steps`).
"""

from __future__ import annotations

import numpy as np

from legion_nn.access import class_axis
from runtime.adapters.registry import adapter, micro_batches_joined
from runtime.kernels import linear, softmax


@adapter("linear.forward")
def _linear(task, piece, views, dims, ctx):
    return {"output": linear.linear_forward(views["input"], views["weights"], views.get("b"))}


@adapter("linear.backward")
def _linear_grad(task, piece, views, dims, ctx):
    views = micro_batches_joined(task, views)  # deferred weight gradients: every micro-batch
    dy, x, weights = views["output.delta"], views.get("input"), views.get("weights")
    need_dx = task.attrs["need_dx"]
    if not task.attrs.get("need_dw", True):  # each micro-batch's input gradient alone
        return {"input.delta": linear.linear_input_grad(dy, weights, views["input.delta"].shape)}
    grad = views.get("weights.delta")
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
    shaped = grad if weights is None else weights  # a deferred gradient reads no weights
    dx, dw, db = linear.linear_backward(dy, x, shaped, need_dx=need_dx, need_db="b.delta" in views)
    out["weights.delta"] = dw
    if dx is not None:
        out["input.delta"] = dx
    if db is not None:
        out["b.delta"] = db
    return out


def _per_row(scores: np.ndarray) -> np.ndarray:
    """Scores of a language model, (n, T, classes), as the kernels' (n·T, classes, 1, 1)."""
    return scores if scores.ndim == 4 else scores.reshape(-1, scores.shape[-1], 1, 1)


def _row_labels(labels: np.ndarray) -> np.ndarray:
    return labels if labels.ndim == 4 else labels.reshape(-1, 1, 1, 1)


@adapter("softmax.forward")
def _softmax(task, piece, views, dims, ctx):
    scores = views["input"]
    prob, loss = softmax.softmax_forward(
        _per_row(scores), _row_labels(views["labels"]), task.attrs["batch_total"]
    )
    return {"probability": prob.reshape(scores.shape), "output": loss}


@adapter("softmax.backward")
def _softmax_grad(task, piece, views, dims, ctx):
    prob, labels = views["probability"], views["labels"]
    total = task.attrs["batch_total"]
    axis = class_axis(prob.ndim)
    if piece.lo[axis] == 0 and piece.hi[axis] == dims["probability"][axis]:
        dx = softmax.softmax_backward(_per_row(prob), _row_labels(labels), total)
        return {"input.delta": dx.reshape(prob.shape)}
    # A piece holding some classes only: (p - onehot) / rows restricted to its columns.
    dx = _per_row(prob) / total
    local = labels.reshape(-1).astype(np.int64) - piece.lo[axis]
    rows = np.nonzero((local >= 0) & (local < prob.shape[axis]))[0]
    dx[rows, local[rows], 0, 0] -= 1.0 / total
    return {"input.delta": dx.reshape(prob.shape)}


@adapter("evaluate.forward")
def _evaluate(task, piece, views, dims, ctx):
    prob = _per_row(views["probability"])
    return {"output": softmax.evaluate_forward(prob, _row_labels(views["labels"]))}


@adapter("accuracy.forward")
def _accuracy(task, piece, views, dims, ctx):
    ctx.futures[task.name] = softmax.accuracy(views["input"])
    return {}
