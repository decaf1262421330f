"""Kernel adapters: how each (op, phase) runs one piece of a task on NumPy views.

An adapter gets the task, the piece of its space, the views of its requirements' rects (by role),
the dims of the tensors bound to each role, and the step context. It returns the arrays to store
by role: a `write` requirement's view is overwritten with them, a `reduce` requirement's view
accumulates them; `read_write` requirements are updated in place by the adapter. Because the
views are exactly the rects of the access map, the same adapters serve a whole task (one piece)
and a rank's pieces (with halos received from other ranks).

Windowed ops get the clipped halo plus the padding of their own border (`window_padding`), so an
interior piece is computed without padding and a border piece with its side of it.
"""

from legion_nn.op_records import records
from runtime.adapters import (  # noqa: F401
    attention,
    channel,
    classifier,
    elementwise,
    lrn,
    merge,
    normalization,
    sequence,
    windowed,
)
from runtime.adapters.registry import (
    ADAPTERS,
    BY_OP,
    StepContext,
    adapter,
    resolve_adapters,
    run_piece,
)

BY_OP.update(resolve_adapters(records(), ADAPTERS))

__all__ = ["ADAPTERS", "BY_OP", "StepContext", "adapter", "run_piece"]
