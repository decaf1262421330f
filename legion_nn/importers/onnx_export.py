"""`save_onnx`: an ONNX model written back with the values training ended with.

The model legion-nn read (`onnx_model.load_onnx`) is re-walked node by node, as the importer
walked it, so each parameter goes back into the initializer it came from, in ONNX's layout: a
Gemm's or MatMul's weights transposed back where the importer transposed them, BatchNormalization's
running mean and variance from the layer's `running` state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from legion_nn.importers.onnx_graph import (
    initializer_aliases,
    layer_names,
    layer_nodes,
    node_attributes,
)


def save_onnx(source: str | Path, arrays: dict[str, np.ndarray], out: str | Path) -> None:
    """The model at `source` with its initializers (and BatchNormalization's running mean and
    variance) replaced by `arrays`, legion-nn's logical values by tensor name (as training ends
    with them), written to `out` atomically; it passes `onnx.checker`."""
    import onnx
    from onnx import numpy_helper

    from legion_nn.atomic import atomic_write

    model = onnx.load(str(source))
    graph = model.graph
    stored = {t.name: t for t in graph.initializer}
    aliases = initializer_aliases(graph)
    values: dict[str, np.ndarray] = {}

    def stored_dims(name: str) -> tuple[int, ...]:
        return tuple(stored[aliases.get(name, name)].dims)

    def put(name: str, value: np.ndarray, transposed: bool = False) -> None:
        dims = stored_dims(name)
        values[name] = value.reshape(dims[::-1]).T if transposed else value.reshape(dims)

    names = layer_names(graph, aliases)
    for index, node in enumerate(layer_nodes(graph, aliases)):
        inputs = [i for i in node.input if aliases.get(i, i) in stored and i in arrays]
        if node.op_type == "Gemm" and not node_attributes(node).get("transB", 0):
            put(node.input[1], arrays[node.input[1]], transposed=True)
            inputs = inputs[1:]
        elif node.op_type == "MatMul" and node.input[1] in arrays:
            # a linear layer's (M, K, 1, 1) was transposed; a dense layer keeps MatMul's (K, M)
            weights = arrays[node.input[1]]
            put(node.input[1], weights, transposed=weights.ndim != len(stored_dims(node.input[1])))
            inputs = []
        elif node.op_type == "BatchNormalization":
            running = arrays[f"{names[index]}.running"]
            put(node.input[3], running[0])
            put(node.input[4], running[1])
        for name in inputs:
            put(name, arrays[name])
    for index, tensor in enumerate(graph.initializer):
        if tensor.name in values:
            dtype = numpy_helper.to_array(tensor).dtype
            graph.initializer[index].CopyFrom(
                numpy_helper.from_array(values[tensor.name].astype(dtype), tensor.name)
            )
    # parameters that started as one shared initializer (PyTorch's exporter merges equal ones)
    # have trained apart: each becomes an initializer of its own, in place of its Identity
    trained_apart = [name for name in values if name in aliases]
    for name in trained_apart:
        dtype = numpy_helper.to_array(stored[aliases[name]]).dtype
        graph.initializer.append(numpy_helper.from_array(values[name].astype(dtype), name))
    kept = [n for n in graph.node if not (n.op_type == "Identity" and n.output[0] in trained_apart)]
    del graph.node[:]
    graph.node.extend(kept)
    onnx.checker.check_model(model)
    with atomic_write(out, "wb") as file:
        file.write(model.SerializeToString())
