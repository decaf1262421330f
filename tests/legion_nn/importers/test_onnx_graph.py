"""What the ONNX reader and writer share (`legion_nn.importers.onnx_graph`): layer names."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from legion_nn.importers.onnx_graph import initializer_aliases, layer_names
from legion_nn.networks import load_network
from tests.paths import FIXTURES


def _graph(nodes, initializers=()):
    return helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros(2, np.float32), name) for name in initializers],
    )


def test_layers_are_named_by_their_module_paths():
    """A parameter's name carries its module's path; a scoped node name (PyTorch's exporter)
    joins its scopes, each of which may repeat the path before it; a plain name is kept in the
    characters legion-nn allows; an unnamed node is its op and place; names taken get a count."""
    nodes = [
        helper.make_node("Conv", ["x", "layer1.0.conv1.weight"], ["a"], name="/whatever/Conv"),
        helper.make_node("Relu", ["a"], ["b"], name="/layer1/layer1.0/relu/Relu"),
        helper.make_node("Relu", ["b"], ["c"], name="/layer1/layer1.0/relu_1/Relu"),
        helper.make_node("Add", ["b", "c"], ["d"], name="/layer1/layer1.0/Add"),
        helper.make_node("Relu", ["d"], ["e"], name="head:relu (1)"),
        helper.make_node("Relu", ["e"], ["f"]),
        helper.make_node("Relu", ["f"], ["g"], name="/layer1/layer1.0/relu/Relu_1"),
        helper.make_node("Relu", ["g"], ["h"], name="softmax"),
        helper.make_node("Relu", ["h"], ["i"], name="/Relu"),
    ]
    graph = _graph(nodes, ["layer1.0.conv1.weight"])
    assert layer_names(graph, initializer_aliases(graph)) == [
        "layer1.0.conv1",
        "layer1.0.relu",
        "layer1.0.relu_1",
        "layer1.0",
        "head_relu_1",
        "relu_5",
        "layer1.0.relu_2",  # the module called twice: the second call counts past the first's
        "softmax_1",  # the reader's own loss layer is called softmax
        "relu_8",
    ]


def test_a_pytorch_export_names_its_layers_by_their_modules():
    """tiny_gpt.onnx (PyTorch's exporter): its blocks' layers read as the model's modules."""
    names = [layer.name for layer in load_network(str(FIXTURES / "tiny_gpt.onnx")).layers]
    assert {"blocks.0.ln1", "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.1.ln2"} <= set(names)
    assert len(set(names) - {"softmax"}) == len(names) - names.count("softmax")
