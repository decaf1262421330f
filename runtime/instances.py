"""Physical instances: how the runtime lays out each tensor in memory.

Tasks name logical rects; an instance maps a logical rect to a view of its physical array. Two
storage orders (`StorageOrder`; not the plan's `partitioner.layout.Layout`, which says which
ranks hold which cells) exist:

- `logical`: the array is the tensor in its logical dims (activations (N, C, H, W), ...);
- `filter_packed`: 8-D filter weights (K, 1, 1, C, R, S, P, Q) kept as (P, R, Q, K, S, C), the
  layout the filter kernels compute in (`runtime.kernels.layout`). Each (position, window row)
  block is one contiguous K×(S·C) matrix, so the kernels read weights and accumulate weight
  gradients in place, with no weight-sized conversion or temporary on any step. A rect's slices
  map its logical axes onto the packed ones: a piece of output positions (P, Q) or of output
  channels (K) is a view that the kernels take as it is.

A filter's weights, their gradient and their optimizer state share the order, because the update
task combines them elementwise. Checkpoints see logical arrays (`to_logical`), so they do not
depend on the order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.op_records import PACKED_AXES, packed_tensors
from legion_nn.rect import Rect

#: packed axis i holds logical axis PACKED_FROM_LOGICAL[i]; logical axes 1 and 2 are unit axes.
#: The kernels' `layout.WEIGHT_AXES` (a test holds them equal), read from the op records so
#: that knowing a plan's storage orders loads no kernel: planning imports no Numba
PACKED_FROM_LOGICAL = PACKED_AXES[:6]


@dataclass(frozen=True)
class StorageOrder:
    """The order a tensor's array stores its axes in: "logical" or "filter_packed"."""

    name: str

    def shape(self, dims: tuple[int, ...]) -> tuple[int, ...]:
        if self.name == "logical":
            return tuple(dims)
        return tuple(dims[axis] for axis in PACKED_FROM_LOGICAL)

    def slices(self, rect: Rect) -> tuple[slice, ...]:
        logical = rect.to_slices()
        if self.name == "logical":
            return logical
        return tuple(logical[axis] for axis in PACKED_FROM_LOGICAL)

    def from_logical(self, array: np.ndarray) -> np.ndarray:
        if self.name == "logical":
            return array
        from runtime.kernels.layout import pack_weights

        return pack_weights(array)

    def to_logical(self, array: np.ndarray) -> np.ndarray:
        if self.name == "logical":
            return array
        from runtime.kernels.layout import unpack_weights

        return unpack_weights(array)


LOGICAL = StorageOrder("logical")
FILTER_PACKED = StorageOrder("filter_packed")


def choose_storage_orders(graph: TaskGraph) -> dict[str, StorageOrder]:
    """The packed layout for `legion_nn.op_records.packed_tensors`, the logical one elsewhere."""
    packed = packed_tensors(graph.tasks)
    return {name: FILTER_PACKED if name in packed else LOGICAL for name in graph.tensors}
