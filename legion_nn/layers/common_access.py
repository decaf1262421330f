"""Access maps of the tasks every network has, whatever its layers: `data`, `set_zero` and
`update`.

`data` writes a piece of the batch and, from the piece at the origin of the non-batch dims only,
its labels, so each label has exactly one writer however the batch is cut. `set_zero` and `update`
are elementwise over their tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from legion_nn.access import register
from legion_nn.rect import Rect


@register("data", "forward")
def _data_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    labels = Rect.empty(len(dims["labels"]))
    if not piece.is_empty() and all(v == 0 for v in piece.lo[1:]):
        labels = Rect(
            (piece.lo[0],) + (0,) * (len(dims["labels"]) - 1),
            (piece.hi[0],) + tuple(dims["labels"][1:]),
        )
    return {"raw_data": piece, "labels": labels}


@register("set_zero", "set_zero")
def _set_zero_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    return {"output": piece}


@register("update", "update")
def _update_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    return {role: piece for role in dims}
