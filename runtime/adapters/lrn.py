"""Adapters of `lrn`: local response normalization across channels.

A piece's views are its access map's rects, so a piece cut through the channels gets the
channel halo of its windows, clipped to the tensor. The kernels need to know which tensor
channel each view starts at (a view clipped at channel 0 or C must be clipped, not padded, as
the whole tensor is): the map gives it, from the same piece and dims the runtime cut the views
with.
"""

from __future__ import annotations

from legion_nn.op_records import access_rects
from runtime.adapters.registry import adapter
from runtime.kernels import lrn


def _attrs(task) -> tuple:
    a = task.attrs
    return a["size"], a["alpha"], a["beta"], a["bias"]


@adapter("lrn.forward")
def _lrn(task, piece, views, dims, ctx):
    rects = access_rects(task, dims, piece)
    y = lrn.lrn_forward_piece(
        views["input"],
        rects["input"].lo[1],
        piece.lo[1],
        piece.hi[1],
        dims["input"][1],
        *_attrs(task),
    )
    return {"output": y}


@adapter("lrn.backward")
def _lrn_grad(task, piece, views, dims, ctx):
    rects = access_rects(task, dims, piece)
    dx = lrn.lrn_backward_piece(
        views["output.delta"],
        rects["output.delta"].lo[1],
        views["input"],
        rects["input"].lo[1],
        piece.lo[1],
        piece.hi[1],
        dims["input"][1],
        *_attrs(task),
    )
    return {"input.delta": dx}
