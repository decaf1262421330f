"""Every op's record, loaded: import this module to look ops up with all families registered.

The records live one module per op family (`legion_nn.layers.*`, whose package imports them all,
and `legion_nn.importers.batch_access` for imported graphs); `legion_nn.registry` holds the table
and the lookups. The partitioner, the runtime and the graph files import the lookups from here, so
that no op of a graph they load is missing because its family was not imported yet.
"""

import legion_nn.importers.batch_access
import legion_nn.layers  # noqa: F401  (registers the layers' records)
from legion_nn.registry import (
    EVERY_DIM,
    GRID,
    HOME,
    PACKED_AXES,
    WITH_TENSOR,
    BoxMap,
    OpRecord,
    RegistryError,
    access_map,
    access_rects,
    axis_roles,
    box_map,
    find_record,
    flops_per_element,
    has_access_map,
    output_ndim,
    packed_tensors,
    piece_requirements,
    rate_passes,
    record_of,
    records,
    reduction_dims,
    splittable_dims,
    stepped_role,
    storage_order,
)

__all__ = [
    "EVERY_DIM",
    "GRID",
    "HOME",
    "PACKED_AXES",
    "WITH_TENSOR",
    "BoxMap",
    "OpRecord",
    "RegistryError",
    "access_map",
    "access_rects",
    "axis_roles",
    "box_map",
    "find_record",
    "flops_per_element",
    "has_access_map",
    "output_ndim",
    "packed_tensors",
    "piece_requirements",
    "rate_passes",
    "record_of",
    "records",
    "reduction_dims",
    "splittable_dims",
    "stepped_role",
    "storage_order",
]
