"""Records of the tasks every network has, whatever its layers: `data`, `set_zero` and `update`.

`data` writes a piece of the batch and, from the piece at the origin of the non-batch dims only,
its labels, so each label has exactly one writer however the batch is cut; a language model's
batch of token ids has a target per token, which its piece writes. `set_zero` and `update`
are elementwise over their tensor. `data` and `set_zero` move memory and count no FLOPs (a blind
spot of the model); an update counts per element 2 (sgd), 4 (momentum), 10 (adam).

`data` and `update` run where the tensors they write live (the batch's home, the parameter's);
`set_zero` is homed when the tensor it zeroes is resident, and otherwise follows a grid. An
update's `params` tensor owns its gradient and optimizer state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from legion_nn import registry
from legion_nn.access import elementwise_boxes
from legion_nn.rect import Rect


def per_token_labels(labels: tuple[int, ...]) -> bool:
    """Whether the `data` task's labels, of dims `labels`, are a target per token, (N, T),
    rather than a class per sample, (N, 1, 1, 1)."""
    return len(labels) == 2


def _data_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    if per_token_labels(dims["labels"]):  # each target written with its token
        return {"raw_data": piece, "labels": piece}
    labels = Rect.empty(len(dims["labels"]))
    if not piece.is_empty() and all(v == 0 for v in piece.lo[1:]):
        labels = Rect(
            (piece.lo[0],) + (0,) * (len(dims["labels"]) - 1),
            (piece.hi[0],) + tuple(dims["labels"][1:]),
        )
    return {"raw_data": piece, "labels": labels}


def _set_zero_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    return {"output": piece}


def _update_rects(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    return {role: piece for role in dims}


UPDATE_FLOPS = {"sgd": 2, "momentum": 4, "adam": 10}


def _update_flops(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> float:
    return UPDATE_FLOPS[attrs.get("optimizer", "sgd")]


registry.register(
    "data",
    phases={
        "forward": {
            "access": _data_rects,
            "flops": registry.per_element(0),
            "adapter": "data.forward",
        }
    },
    splittable=registry.EVERY_DIM,
    homing=registry.HOME,
    packed_role=None,
    owner_role=None,
    passes=None,
    sums_over=0,
)
registry.register(
    "set_zero",
    phases={
        "set_zero": {
            "access": _set_zero_rects,
            "box_map": elementwise_boxes,
            "flops": registry.per_element(0),
            "adapter": "set_zero.set_zero",
        }
    },
    splittable=registry.EVERY_DIM,
    homing=registry.WITH_TENSOR,
    packed_role=None,
    owner_role=None,
    passes=None,
    sums_over=0,
)
registry.register(
    "update",
    phases={
        "update": {"access": _update_rects, "flops": _update_flops, "adapter": "update.update"}
    },
    splittable=registry.EVERY_DIM,
    homing=registry.HOME,
    packed_role=None,
    owner_role="params",
    passes=None,
    sums_over=0,
)
