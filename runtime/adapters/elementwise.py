"""Adapters of the data task and the elementwise ops: `filterA`, `filterNL`, `gelu`, `dropout`,
`reshape`, `set_zero` and the optimizer `update`.

`update` changes its `params` and optimizer-state views in place (read_write privilege); the
Adam step count is the global step, so a resumed run continues the same bias correction.
"""

from __future__ import annotations

from legion_nn.layers.common_access import per_token_labels
from legion_nn.micro_batches import in_step_batch
from runtime.adapters.registry import adapter, in_place, written_in_place
from runtime.kernels import affine, dropout, gelu, nonlinear, update


@adapter("data.forward")
def _data(task, piece, views, dims, ctx):
    # The plan loads each tensor's home cells as pieces of their own, so a piece may hold either.
    # a micro-batch's data task loads its rows of the step's batch (`in_step_batch`)
    rows = piece.translate(in_step_batch(task, (0,) * piece.ndim, piece.hi)[0])
    out = {}
    if "raw_data" in views:
        out["raw_data"] = ctx.inputs[rows.to_slices()]
    if "labels" in views and views["labels"].size:
        if per_token_labels(dims["labels"]):
            out["labels"] = ctx.labels[rows.to_slices()]
        else:
            out["labels"] = ctx.labels[rows.lo[0] : rows.hi[0]].reshape(views["labels"].shape)
    return out


@adapter("filterA.forward")
def _affine(task, piece, views, dims, ctx):
    y = written_in_place(task, views, ctx, "output")
    found = affine.filterA_forward(views["input"], views["a"], views["b"], out=y)
    return {} if y is not None else {"output": found}


@adapter("filterA.backward")
def _affine_grad(task, piece, views, dims, ctx):
    need_dx = "input.delta" in views
    dx = written_in_place(task, views, ctx, "input.delta") if need_dx else None
    found, da, db = affine.filterA_backward(
        views["output.delta"], views["input"], views["a"], need_dx=need_dx, out=dx
    )
    out = {"a.delta": da, "b.delta": db}
    if need_dx and dx is None:
        out["input.delta"] = found
    return out


@adapter("filterNL.forward")
def _nonlinear(task, piece, views, dims, ctx):
    y = written_in_place(task, views, ctx, "output")
    found = nonlinear.filterNL_forward(views["input"], task.attrs["fn"], out=y)
    return {} if y is not None else {"output": found}


@adapter("filterNL.backward")
def _nonlinear_grad(task, piece, views, dims, ctx):
    dx = written_in_place(task, views, ctx, "input.delta")
    found = nonlinear.filterNL_backward(
        views["output.delta"], views["output"], task.attrs["fn"], out=dx
    )
    return {} if dx is not None else {"input.delta": found}


@adapter("gelu.forward")
def _gelu(task, piece, views, dims, ctx):
    y, add = in_place(task, views, ctx, "output")
    found = gelu.gelu_forward(views["input"], task.attrs["approximate"], out=y, add=add)
    return {} if y is not None else {"output": found}


@adapter("gelu.backward")
def _gelu_grad(task, piece, views, dims, ctx):
    dx, add = in_place(task, views, ctx, "input.delta")
    found = gelu.gelu_backward(
        views["output.delta"], views["input"], task.attrs["approximate"], out=dx, add=add
    )
    return {} if dx is not None else {"input.delta": found}


@adapter("dropout.forward")
def _dropout(task, piece, views, dims, ctx):
    if not ctx.training:
        return {"output": views["input"]}
    y = dropout.dropout_forward(
        views["input"],
        task.attrs["ratio"],
        task.attrs["seed"],
        ctx.step,
        *in_step_batch(task, piece.lo, dims["input"]),
    )
    return {"output": y}


@adapter("dropout.backward")
def _dropout_grad(task, piece, views, dims, ctx):
    dx = dropout.dropout_backward(
        views["output.delta"],
        task.attrs["ratio"],
        task.attrs["seed"],
        ctx.step,
        *in_step_batch(task, piece.lo, dims["output.delta"]),
    )
    return {"input.delta": dx}


@adapter("reshape.forward")
def _reshape(task, piece, views, dims, ctx):
    return {"output": views["input"].reshape(views["output"].shape)}


@adapter("reshape.backward")
def _reshape_grad(task, piece, views, dims, ctx):
    return {"input.delta": views["output.delta"].reshape(views["input.delta"].shape)}


@adapter("set_zero.set_zero")
def _set_zero(task, piece, views, dims, ctx):
    views["output"][...] = 0
    return {}


@adapter("update.update")
def _update(task, piece, views, dims, ctx):
    step = update.optimizer_step(task.attrs, views, ctx.step, ctx.lr_scale, ctx.grad_scale)
    step.apply(views["gradient"])
    return {}
