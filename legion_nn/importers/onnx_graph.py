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


def layer_name(node, index: int) -> str:
    """A layer (group) name from the node's: its characters legion-nn's names allow, and its
    position, so that names stay distinct."""
    name = re.sub(r"[^A-Za-z0-9_]+", "_", node.name).strip("_")
    return f"{name or node.op_type.lower()}_{index}"


def layer_nodes(graph, aliases: dict[str, str]) -> list:
    """The nodes that become layers, in order (a node's index among them names its layer): not
    constants, nor the Identity nodes of initializers (`initializer_aliases`)."""
    return [
        n
        for n in graph.node
        if n.op_type != "Constant" and not (n.op_type == "Identity" and n.output[0] in aliases)
    ]
