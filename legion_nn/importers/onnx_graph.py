"""What the ONNX reader (`onnx_model`) and writer (`onnx_export`) share about a graph: its data
input's shape and batch, the names of its layers and of its initializers' aliases, and the one-line
error they raise."""

from __future__ import annotations

import re
from pathlib import Path

from legion_nn.errors import LegionNNError

#: onnx.TensorProto's integer types: an input of them holds token ids
TOKEN_TYPES = (2, 3, 4, 5, 6, 7, 12, 13)


class OnnxError(LegionNNError):
    """A model legion-nn cannot read: one line naming the file and the node."""


def sample_shape(path: Path, value) -> tuple[int, ...]:
    """The per-sample shape of the model's data input `value`, or one line saying why not."""
    dims = value.type.tensor_type.shape.dim
    known = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    if value.type.tensor_type.elem_type in TOKEN_TYPES:  # token ids (batch, T)
        if len(known) != 2 or known[1] is None or known[1] < 1:
            shown = [d.dim_value or d.dim_param or "?" for d in dims]
            raise OnnxError(
                f"{path}: input {value.name!r} of token ids has shape {shown}; "
                "legion-nn needs [batch, T] with the sequence length T known"
            )
        return (int(known[1]),)
    if len(known) not in (2, 4) or any(v is None or v < 1 for v in known[1:]):
        shown = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
        raise OnnxError(
            f"{path}: input {value.name!r} has shape {shown}; legion-nn needs "
            "[batch, C, H, W] or [batch, features] with every dim but the batch known"
        )
    rest = tuple(int(v) for v in known[1:])
    return rest if len(rest) == 3 else (rest[0], 1, 1)


def fixed_batch(graph) -> int | None:
    """The declared batch of the model's data input, or None where it is dynamic."""
    stored = {t.name for t in graph.initializer}
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name not in stored and dims:
            return dims[0].dim_value if dims[0].HasField("dim_value") else None
    return None


def initializer_aliases(graph) -> dict[str, str]:
    """Identity nodes of initializers (PyTorch's exporter writes one initializer for parameters
    that start equal, such as zero biases, and an Identity per use): each output's name, mapped
    to the initializer it passes on. Each is a parameter of its own, starting from that value."""
    found: dict[str, str] = {}
    stored = {t.name for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Identity":
            source = found.get(node.input[0], node.input[0])
            if source in stored:
                found[node.output[0]] = source
    return found


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def node_attributes(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


#: names the reader gives layers of its own (the data input's group, an appended loss)
RESERVED_NAMES = frozenset({"data", "softmax"})


def layer_names(graph, aliases: dict[str, str]) -> list[str]:
    """Each of `layer_nodes`' names, readable and distinct, as the module path a user knows:
    the path its parameters' names carry (`layer1.0.conv1` of `layer1.0.conv1.weight`), else
    its scoped node name's (`/layer1/layer1.0/relu_1/Relu`: `layer1.0.relu_1`), else its node
    name, each in the characters legion-nn's names allow (letters, digits, `_` and `.`); an
    unnamed node is its op and place (`conv_12`), and a name taken already gets `_1`, `_2`, …"""
    params = {t.name for t in graph.initializer} | set(aliases)
    taken = set(RESERVED_NAMES)
    names = []
    for index, node in enumerate(layer_nodes(graph, aliases)):
        name = _module_path(node, params) or f"{node.op_type.lower()}_{index}"
        unique, count = name, 0
        while unique in taken:
            count += 1
            unique = f"{name}_{count}"
        taken.add(unique)
        names.append(unique)
    return names


def _module_path(node, params: set[str]) -> str:
    for value in node.input:
        if value in params and "." in value:
            path = _allowed(value.rsplit(".", 1)[0])
            if path:
                return path
    if node.name.startswith("/"):
        path = ""
        for scope in node.name.strip("/").split("/")[:-1]:  # the last is the op's own
            path = scope if not path or scope.startswith(f"{path}.") else f"{path}.{scope}"
        return _allowed(path)
    return _allowed(node.name)


def _allowed(name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.]+", "_", name)
    return re.sub(r"\.{2,}", ".", name).strip("._")


def layer_nodes(graph, aliases: dict[str, str]) -> list:
    """The nodes that become layers, in order (a node's index among them names its layer): not
    constants, nor the Identity nodes of initializers (`initializer_aliases`)."""
    return [
        n
        for n in graph.node
        if n.op_type != "Constant" and not (n.op_type == "Identity" and n.output[0] in aliases)
    ]
