"""Adapters of the sequence ops: `embedding`, `dense` and `layernorm`
(`legion_nn.layers.embedding`, `.dense`, `.layernorm`).

An embedding piece holds some features of the table (`weights[:, d0:d1]`), so its gradient is
the scatter-add into those columns of every row.
"""

from __future__ import annotations

from runtime.adapters.registry import adapter, in_place, micro_batches_joined
from runtime.kernels import dense, embedding, layernorm


@adapter("embedding.forward")
def _embedding(task, piece, views, dims, ctx):
    return {"output": embedding.embedding_forward(views["input"], views["weights"])}


@adapter("embedding.backward")
def _embedding_grad(task, piece, views, dims, ctx):
    grad = embedding.embedding_backward(views["input"], views["output.delta"], task.attrs["vocab"])
    return {"weights.delta": grad}


@adapter("dense.forward")
def _dense(task, piece, views, dims, ctx):
    y, add = in_place(task, views, ctx, "output")
    if y is not None:  # no output-sized temporary, no copy
        dense.dense_forward(views["input"], views["weights"], views.get("b"), out=y, add=add)
        return {}
    return {"output": dense.dense_forward(views["input"], views["weights"], views.get("b"))}


@adapter("dense.backward")
def _dense_grad(task, piece, views, dims, ctx):
    views = micro_batches_joined(task, views)  # deferred weight gradients: every micro-batch
    need_dx = task.attrs["need_dx"]
    dx, add_dx = in_place(task, views, ctx, "input.delta") if need_dx else (None, False)
    if not task.attrs.get("need_dw", True):  # each micro-batch's input gradient alone
        shape = views["input.delta"].shape
        got_dx = dense.dense_input_grad(views["output.delta"], views["weights"], shape, dx, add_dx)
        return {} if dx is not None else {"input.delta": got_dx}
    need_db = "b.delta" in views and views["b.delta"].size > 0
    dw, add_dw = in_place(task, views, ctx, "weights.delta")
    got_dx, got_dw, db = dense.dense_backward(
        views["output.delta"],
        views["input"],
        views["weights"] if "weights" in views else views["weights.delta"],  # for its shape
        need_dx=need_dx,
        need_db=need_db,
        dw=dw,
        add_dw=add_dw,
        dx=dx,
        add_dx=add_dx,
    )
    out = {}
    if dw is None:
        out["weights.delta"] = got_dw
    if need_dx and dx is None:
        out["input.delta"] = got_dx
    if db is not None:
        out["b.delta"] = db
    return out


@adapter("layernorm.forward")
def _layernorm(task, piece, views, dims, ctx):
    y = layernorm.layernorm_forward(
        views["input"], views["gamma"], views["beta"], task.attrs["eps"]
    )
    return {"output": y}


@adapter("layernorm.backward")
def _layernorm_grad(task, piece, views, dims, ctx):
    dx, dgamma, dbeta = layernorm.layernorm_backward(
        views["output.delta"],
        views["input"],
        views["gamma"],
        task.attrs["eps"],
        need_dx="input.delta" in views,
    )
    out = {"gamma.delta": dgamma, "beta.delta": dbeta}
    if dx is not None:
        out["input.delta"] = dx
    return out
