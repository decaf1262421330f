"""Constant folding of an ONNX graph: every value that can be computed without the data.

A node is *static* when every input it reads is: a Constant, an initializer that is not a
parameter (integers and booleans: masks, indices, shapes; a float initializer is a parameter and
is never folded through), the output of a static node, or a data tensor that it only measures
(Shape, whose dims shape inference finds with the batch set).
Static nodes are evaluated with onnx's reference evaluator (`onnx.reference`), each on its own,
twice: at two batch sizes where the batch is dynamic. A value equal in both is a constant; one
that differs depends on the batch, such as the target [batch, T, H, Dh] of a Reshape, and keeps
both evaluations, from which the reader tells where the batch is.

Everything else (the nodes that read data or parameters) is left, in order, for the reader.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: the two batch sizes a dynamic batch is folded at
BATCHES = (2, 3)
FLOATS = (1, 10, 11, 16)  # onnx.TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16


@dataclass
class Folded:
    #: static values equal at both batch sizes, by name
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    #: static values that depend on the batch: their value at each of `batches`
    batched: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    batches: tuple[int, int] = BATCHES
    #: the nodes that read data or parameters, in graph order
    nodes: list = field(default_factory=list)


class FoldError(Exception):
    """A static node the reference evaluator cannot compute, or a shape nothing gives: the
    reader names the node."""

    def __init__(self, node, message: str) -> None:
        super().__init__(message)
        self.node = node


def parameters(graph) -> set[str]:
    """The initializers that are parameters: the float ones."""
    return {t.name for t in graph.initializer if t.data_type in FLOATS}


def fold(model, batch: int | None) -> Folded:
    """Fold `model`'s static nodes; `batch` is its input's fixed batch, or None when dynamic."""
    from onnx import numpy_helper

    graph = model.graph
    batches = BATCHES if batch is None else (batch, batch)
    opsets = model_opsets(model)
    params = parameters(graph)
    # a fixed batch is folded once: both runs are the one
    runs: dict[int, dict[str, np.ndarray]] = {size: {} for size in batches}
    for tensor in graph.initializer:
        if tensor.name not in params:
            value = numpy_helper.to_array(tensor)
            for run in runs.values():
                run[tensor.name] = value
    shapes = {size: _shapes(model, size) for size in runs}
    first = runs[batches[0]]
    folded = Folded(batches=batches)
    for node in graph.node:
        reads = [name for name in node.input if name]
        measured = node.op_type == "Shape" and bool(reads) and reads[0] not in first
        if not measured and not all(name in first for name in reads):
            folded.nodes.append(node)
            continue
        for size, run in runs.items():
            if measured:
                feed = {reads[0]: np.zeros(_concrete(node, shapes[size].get(reads[0])))}
            else:
                feed = {name: run[name] for name in reads}
            try:
                values = evaluate(node, feed, opsets)
            except Exception as exc:  # noqa: BLE001  (the evaluator's own, named in one line)
                text = str(exc).strip().splitlines()
                raise FoldError(
                    node, f"cannot fold: {text[0] if text else type(exc).__name__}"
                ) from None
            for name, value in zip(node.output, values):
                run[name] = np.asarray(value)
    second = runs[batches[1]]
    for name, value in first.items():
        other = second[name]
        if other is value or (value.shape == other.shape and np.array_equal(value, other)):
            folded.constants[name] = value
        else:
            folded.batched[name] = (value, other)
    return folded


def evaluate(node, feed: dict[str, np.ndarray], opsets: dict[str, int]) -> list[np.ndarray]:
    """`node`'s outputs from `feed` by onnx's reference evaluator, as the opsets define the op:
    the node alone as a model importing them (a node by itself is read at the newest opset)."""
    import onnx
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    untyped = onnx.TypeProto()
    graph = helper.make_graph(
        [node],
        "fold",
        [helper.make_value_info(name, untyped) for name in feed],
        [helper.make_value_info(name, untyped) for name in node.output],
    )
    imports = [helper.make_opsetid(domain, version) for domain, version in opsets.items()]
    return ReferenceEvaluator(helper.make_model(graph, opset_imports=imports)).run(None, feed)


def model_opsets(model) -> dict[str, int]:
    """The opset of each domain the model imports: a node is evaluated as its version defines
    it (opset 9's Unsqueeze takes its axes as an attribute, 13's as an input)."""
    return {entry.domain: entry.version for entry in model.opset_import}


def _concrete(node, dims: list[int | None] | None) -> list[int]:
    """A measured tensor's shape, which shape inference must know whole."""
    if dims is None or any(d is None for d in dims):
        raise FoldError(node, f"the shape of {node.input[0]!r} is not known ({dims})")
    return dims


def _shapes(model, batch: int) -> dict[str, list[int | None]]:
    """Every value's shape at `batch` that shape inference, propagating constants, finds (None
    for a dim it gives no number): the model's data inputs are given the batch first, so that
    shapes computed from the batch (a Reshape to [batch, T, D]) are known too."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    stored = {t.name for t in copy.graph.initializer}
    types = onnx.TensorProto
    floats = {types.FLOAT, types.FLOAT16, types.DOUBLE, types.BFLOAT16}
    # float initializers (weights) enter as typed inputs: their shapes are what inference needs,
    # and it would otherwise serialize every weight, twice a model
    listed = {value.name for value in copy.graph.input}
    weights = [t for t in copy.graph.initializer if t.data_type in floats]
    for tensor in weights:
        if tensor.name not in listed:
            copy.graph.input.append(
                onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims)
            )
    kept = [t for t in copy.graph.initializer if t.data_type not in floats]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    for value in copy.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name not in stored and dims and not dims[0].HasField("dim_value"):
            dims[0].dim_value = batch
    try:
        inferred = onnx.shape_inference.infer_shapes(copy, data_prop=True)
    except onnx.shape_inference.InferenceError:
        inferred = copy
    found = {}
    for info in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        if not info.type.tensor_type.HasField("shape"):
            continue
        dims = info.type.tensor_type.shape.dim
        found[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    return found
