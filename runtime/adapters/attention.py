"""Adapters of attention's ops: `slice`, `split_heads`, `merge_heads`, `matmul`, `row_softmax`,
`position`, and of the layers between images and tokens: `image_tokens`, `class_token`,
`select_token` (`legion_nn.layers.attention`, `.embedding`, `.tokens`).

A `merge_heads` piece whose features start or end inside a head gets that head whole (its access
map reads the heads its features fall in) and keeps the features it covers.
"""

from __future__ import annotations

import numpy as np

from legion_nn.layers.merge import input_role
from runtime.adapters.registry import adapter, in_place
from runtime.kernels import attention


def _heads(features: np.ndarray, size: int) -> np.ndarray:
    """(n, t, h·size) as (n, h, t, size)."""
    n, t, width = features.shape
    return features.reshape(n, t, width // size, size).transpose(0, 2, 1, 3)


def _features(heads: np.ndarray) -> np.ndarray:
    """(n, h, t, size) as (n, t, h·size)."""
    n, h, t, size = heads.shape
    return heads.transpose(0, 2, 1, 3).reshape(n, t, h * size)


def _columns(task, piece) -> slice:
    """Where a merge_heads piece's features lie in the heads its access map reads."""
    first = piece.lo[2] % task.attrs["head_size"]
    return slice(first, first + piece.hi[2] - piece.lo[2])


@adapter("slice.forward")
def _slice(task, piece, views, dims, ctx):
    return {"output": views["input"]}


@adapter("slice.backward")
def _slice_grad(task, piece, views, dims, ctx):
    return {"input.delta": views["output.delta"]}


@adapter("split_heads.forward")
def _split(task, piece, views, dims, ctx):
    return {"output": _heads(views["input"], task.attrs["head_size"])}


@adapter("split_heads.backward")
def _split_grad(task, piece, views, dims, ctx):
    return {"input.delta": _features(views["output.delta"])}


@adapter("merge_heads.forward")
def _merge(task, piece, views, dims, ctx):
    return {"output": _features(views["input"])[:, :, _columns(task, piece)]}


@adapter("merge_heads.backward")
def _merge_grad(task, piece, views, dims, ctx):
    dy = views["output.delta"]
    heads = views["input.delta"]
    out = np.zeros((heads.shape[0], heads.shape[2], heads.shape[1] * heads.shape[3]), dy.dtype)
    out[:, :, _columns(task, piece)] = dy
    return {"input.delta": _heads(out, heads.shape[3])}


@adapter("matmul.forward")
def _matmul(task, piece, views, dims, ctx):
    y, add = in_place(task, views, ctx, "output")
    found = attention.matmul_forward(
        views[input_role(0)],
        views[input_role(1)],
        task.attrs["transpose_b"],
        task.attrs["scale"],
        out=y,
        add=add,
    )
    return {} if y is not None else {"output": found}


@adapter("matmul.backward")
def _matmul_grad(task, piece, views, dims, ctx):
    a_grad, b_grad = f"{input_role(0)}.delta", f"{input_role(1)}.delta"
    da, add_da = in_place(task, views, ctx, a_grad)
    db, add_db = in_place(task, views, ctx, b_grad)
    got_da, got_db = attention.matmul_backward(
        views["output.delta"],
        views[input_role(0)],
        views[input_role(1)],
        task.attrs["transpose_b"],
        task.attrs["scale"],
        need_da=a_grad in views,
        need_db=b_grad in views,
        da=da,
        add_da=add_da,
        db=db,
        add_db=add_db,
    )
    found = {a_grad: got_da if da is None else None, b_grad: got_db if db is None else None}
    return {role: g for role, g in found.items() if g is not None}


@adapter("row_softmax.forward")
def _row_softmax(task, piece, views, dims, ctx):
    y = attention.row_softmax_forward(views["input"], task.attrs["causal"], piece.lo[2])
    return {"output": y}


@adapter("row_softmax.backward")
def _row_softmax_grad(task, piece, views, dims, ctx):
    return {"input.delta": attention.row_softmax_backward(views["output.delta"], views["output"])}


@adapter("position.forward")
def _position(task, piece, views, dims, ctx):
    return {"output": views["input"] + views["weights"]}


@adapter("position.backward")
def _position_grad(task, piece, views, dims, ctx):
    dy = views["output.delta"]
    out = {"weights.delta": dy.sum(axis=0)}
    if "input.delta" in views:
        out["input.delta"] = dy
    return out


@adapter("image_tokens.forward")
def _image_tokens(task, piece, views, dims, ctx):
    x = views["input"]
    n, c, rows, width = x.shape
    first = piece.lo[1] % width  # where the piece starts in the first row it reads
    tokens = x.transpose(0, 2, 3, 1).reshape(n, rows * width, c)
    return {"output": tokens[:, first : first + piece.hi[1] - piece.lo[1]]}


@adapter("image_tokens.backward")
def _image_tokens_grad(task, piece, views, dims, ctx):
    dy = views["output.delta"]
    n, c, rows, width = views["input.delta"].shape
    first = piece.lo[1] % width  # where the piece starts in the first row it reads
    tokens = np.zeros((n, rows * width, c), dy.dtype)
    tokens[:, first : first + dy.shape[1]] = dy
    return {"input.delta": tokens.reshape(n, rows, width, c).transpose(0, 3, 1, 2)}


@adapter("class_token.forward")
def _class_token(task, piece, views, dims, ctx):
    out = np.empty(piece.shape, views["output"].dtype)
    first = 1 if piece.lo[1] == 0 else 0
    if first:
        out[:, 0] = views["weights"]
    out[:, first:] = views["input"]
    return {"output": out}


@adapter("class_token.backward")
def _class_token_grad(task, piece, views, dims, ctx):
    dy = views["output.delta"]
    first = 1 if piece.lo[1] == 0 else 0
    out = {}
    if "input.delta" in views:
        out["input.delta"] = dy[:, first:]
    if first:
        out["weights.delta"] = dy[:, 0].sum(axis=0)
    return out


@adapter("select_token.forward")
def _select_token(task, piece, views, dims, ctx):
    return {"output": views["input"].reshape(views["output"].shape)}


@adapter("select_token.backward")
def _select_token_grad(task, piece, views, dims, ctx):
    return {"input.delta": views["output.delta"].reshape(views["input.delta"].shape)}
