"""The access map of imported functions: batch rows for what carries the batch, the rest whole.

An imported function (a `chainer.<Type>` task) is opaque: a dump records the buffers a function
reads and writes, not how its output elements depend on its inputs. What is known is which tensors
carry the batch B: the non-parameters whose byte size is a multiple of B and more than one element
(`chainer_graph.is_batch_carrying`, the memory analysis's scaling rule). Their dim 0 is the batch,
whether the importer inferred their shape or, not knowing it, shaped them (B, bytes/B/itemsize).
Taking every function to compute each sample from that sample alone, as data parallelism does, a
piece of a task over batch rows [b0, b1) touches:

- `batch`: rows [b0, b1) of every batch-carrying tensor it reads, writes or reduces into;
- `whole`: all of every other tensor: parameters are read whole, parameter gradients are reduced
  whole (so the pieces' contributions are summed: an all-reduce of replicated gradients), and a
  batch-free output of a function over the batch (the loss) is reduced whole, a sum over the
  pieces' rows, to the one rank that owns it;
- `none`: nothing of a tensor the task names but does not touch (the loss gradient, one by
  definition and never materialised).

The importer records each role's class in the task's `attrs["access"]` and gives the privileges
(reduce for every gradient a backward function outputs, so a variable feeding two functions
accumulates both gradients; reduce for a batch-free output over the batch). A task touching no
batch-carrying tensor has no dim to cut and runs whole on one rank. Only the batch may be cut:
channel or spatial splits need per-type maps, which can be registered as `chainer.<Type>` and
take precedence over this one. A function that mixes samples (batch normalisation's statistics)
is computed per piece over its own rows, as unsynchronised data-parallel batch normalisation is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from legion_nn.access import batch_rows, register, whole
from legion_nn.rect import Rect

NAMESPACE = "chainer"
BATCH, WHOLE, NONE = "batch", "whole", "none"
CLASSES = (BATCH, WHOLE, NONE)
ACCESS_KEY = "access"


def batch_parallel(attrs: Mapping[str, Any], dims: Mapping[str, tuple], piece: Rect) -> dict:
    """Each role's rect for the piece, by the role's class in `attrs["access"]`."""
    classes = attrs[ACCESS_KEY]
    out = {}
    for role, shape in dims.items():
        kind = classes[role]
        if kind == BATCH:
            out[role] = batch_rows(piece, shape)
        elif kind == WHOLE:
            out[role] = whole(shape, piece)
        elif kind == NONE:
            out[role] = Rect.empty(len(shape))
        else:
            raise ValueError(f"role {role}: access class {kind!r} is not one of {CLASSES}")
    return out


def batch_dims(attrs: Mapping[str, Any]) -> tuple[int, ...]:
    """The batch (dim 0 of the space) where the task touches rows of some tensor, else nothing."""
    return (0,) if BATCH in attrs[ACCESS_KEY].values() else ()


for _phase in ("forward", "backward"):
    register(NAMESPACE, _phase, splittable=batch_dims)(batch_parallel)
