"""Adapters of the per-channel ops, `channel_affine` and `channel_shuffle`
(`legion_nn.layers.channel`).

A `channel_affine` piece gets the parameter entries of its own channels, so the kernel's
per-channel arrays line up with its views as they are. A `channel_shuffle` piece gets the
bounding box of the channels it gathers from, not the channels' own rect: the access map (read
as `lrn`'s adapters read it) says where that box starts, and the gather subtracts it.
"""

from __future__ import annotations

from legion_nn.layers.channel import shuffle_destinations, shuffle_sources
from legion_nn.op_records import access_rects
from runtime.adapters.registry import adapter
from runtime.kernels import channel


@adapter("channel_affine.forward")
def _affine(task, piece, views, dims, ctx):
    y = channel.channel_affine_forward(views["input"], views["scale"], views.get("shift"))
    return {"output": y}


@adapter("channel_affine.backward")
def _affine_grad(task, piece, views, dims, ctx):
    need_dx = "input.delta" in views
    dx, dscale, dshift = channel.channel_affine_backward(
        views["output.delta"], views["input"], views["scale"], need_dx=need_dx
    )
    out = {"scale.delta": dscale}
    if "shift.delta" in views:
        out["shift.delta"] = dshift
    if need_dx:
        out["input.delta"] = dx
    return out


@adapter("channel_shuffle.forward")
def _shuffle(task, piece, views, dims, ctx):
    groups, channels = task.attrs["groups"], dims["input"][1]
    first = access_rects(task, dims, piece)["input"].lo[1]
    wanted = shuffle_sources(channels, groups, piece.lo[1], piece.hi[1])
    y = channel.gather_channels(views["input"], wanted, first)
    return {"output": y}


@adapter("channel_shuffle.backward")
def _shuffle_grad(task, piece, views, dims, ctx):
    groups, channels = task.attrs["groups"], dims["output.delta"][1]
    first = access_rects(task, dims, piece)["output.delta"].lo[1]
    wanted = shuffle_destinations(channels, groups, piece.lo[1], piece.hi[1])
    dx = channel.gather_channels(views["output.delta"], wanted, first)
    return {"input.delta": dx}
