"""Adapters of the merge ops, `add` and `concat` (`legion_nn.layers.merge`).

A concat piece gets, of each input, the channels it covers (an empty view where it covers none),
which land in its output at their offset less the piece's first channel.
"""

from __future__ import annotations

import numpy as np

from legion_nn.layers.merge import channel_offsets, input_role
from runtime.adapters.registry import adapter


def _inputs(task) -> range:
    return range(task.attrs["count"] if task.op == "add" else len(task.attrs["channels"]))


@adapter("add.forward")
def _add(task, piece, views, dims, ctx):
    out = np.add(views["input0"], views["input1"])
    for index in _inputs(task)[2:]:
        out += views[input_role(index)]
    return {"output": out}


@adapter("add.backward")
def _add_grad(task, piece, views, dims, ctx):
    dy = views["output.delta"]
    return {
        f"{input_role(i)}.delta": dy for i in _inputs(task) if f"{input_role(i)}.delta" in views
    }


def _channels(task, piece, index: int) -> slice:
    """Where input `index`'s channels lie in the piece's output view."""
    offsets = channel_offsets(task.attrs)
    first = max(piece.lo[1], offsets[index]) - piece.lo[1]
    last = min(piece.hi[1], offsets[index + 1]) - piece.lo[1]
    return slice(first, max(first, last))


@adapter("concat.forward")
def _concat(task, piece, views, dims, ctx):
    out = np.empty(piece.shape, views["output"].dtype)
    for index in _inputs(task):
        part = _channels(task, piece, index)
        if part.stop > part.start:
            out[:, part] = views[input_role(index)]
    return {"output": out}


@adapter("concat.backward")
def _concat_grad(task, piece, views, dims, ctx):
    dy = views["output.delta"]
    out = {}
    for index in _inputs(task):
        role = f"{input_role(index)}.delta"
        part = _channels(task, piece, index)
        if role in views and part.stop > part.start:
            out[role] = dy[:, part]
    return out
