"""The record of imported functions (`chainer.<Type>`): batch rows for what carries the batch, the
rest whole, and FLOPs by type.

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

FLOPs per element of a task's space (its first batch-carrying tensor, outputs first: a function's
output, a loss's scores) come from the type, `FLOPS`, stated per direction: a convolution's from
its weights (C·R·S inputs per output, backward twice that for the data and weight gradients, plus
the bias), a linear function's likewise, a pooling's from its window; elementwise functions a few
each. A function of another type is opaque: the dump gives its buffers and nothing of its work, so
it is costed at `OPAQUE_FLOPS` per element, an explicit estimate of a few operations. So is a
convolution or linear function whose weights' shape the importer could not infer.

Imported graphs are planned and costed, not run: the record names no kernel adapter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from legion_nn import registry
from legion_nn.access import batch_rows, whole
from legion_nn.rect import Rect

NAMESPACE = "chainer"
BATCH, WHOLE, NONE = "batch", "whole", "none"
CLASSES = (BATCH, WHOLE, NONE)
ACCESS_KEY = "access"
#: the dump's attributes of the function
ATTRS_KEY = "chainer"


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


#: FLOPs per element of an opaque function: a few operations, as the elementwise functions cost
OPAQUE_FLOPS = 8.0

Flops = Callable[[Mapping[str, Any], Mapping[str, tuple]], float]


def _constant(forward: float, backward: float) -> dict[str, Flops]:
    return {"forward": registry.per_element(forward), "backward": registry.per_element(backward)}


def _weighted(role: str, rank: int) -> dict[str, Flops]:
    """A product with weights of `rank` dims (outputs first): 2·fan-in per output and a bias
    add forward, twice the products backward (data and weight gradients)."""

    def count(factor: int) -> Flops:
        def flops(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> float:
            if len(dims.get(role, ())) != rank:
                return OPAQUE_FLOPS
            bias = 1 if "b" in dims else 0
            return factor * math.prod(dims[role][1:]) + bias

        return flops

    return {"forward": count(2), "backward": count(4)}


def _pooling() -> dict[str, Flops]:
    """A comparison (or an add) per window element, each way."""

    def flops(attrs: Mapping[str, Any], dims: Mapping[str, tuple]) -> float:
        window = attrs[ATTRS_KEY]
        return window["kh"] * window["kw"]

    return {"forward": flops, "backward": flops}


#: FLOPs per element of the space, by type and direction
FLOPS: dict[str, dict[str, Flops]] = {
    "Add": _constant(1, 2),  # backward adds the gradient into both inputs
    "BiasAdd": _constant(1, 1),
    "Sum": _constant(1, 1),
    "ReLU": _constant(1, 2),
    "LeakyReLU": _constant(2, 2),
    "Sigmoid": _constant(4, 3),  # exp, add, divide (negate); backward y·(1 − y)·dy
    "Tanh": _constant(4, 3),
    "Dropout": _constant(2, 1),
    "Reshape": _constant(1, 1),  # a copy
    "MaxPooling2D": _pooling(),
    "AveragePooling2D": _pooling(),
    "Convolution2DFunction": _weighted("filters", 4),
    "LinearFunction": _weighted("weights", 2),
    "SoftmaxCrossEntropy": _constant(5, 2),  # per class as the softmax layer
}


def _record(op: str, flops: Mapping[str, Flops]) -> None:
    registry.register(
        op,
        phases={
            phase: {"access": batch_parallel, "flops": flops[phase], "adapter": None}
            for phase in ("forward", "backward")
        },
        splittable=batch_dims,
        homing=registry.GRID,
        packed_role=None,
        owner_role=None,
        passes=None,
        sums_over=0,
    )


for _type, _flops in FLOPS.items():
    _record(f"{NAMESPACE}.{_type}", _flops)
# every other type: opaque
_record(NAMESPACE, _constant(OPAQUE_FLOPS, OPAQUE_FLOPS))
