"""ONNX models: a graph of supported ops read into a `Network`, its initializers the parameters.

`load_onnx(path)` reads the model with the `onnx` package, checks it (`onnx.checker`), and maps
each node onto a layer (the per-sample input comes from the declared input; its batch dim, fixed
or dynamic, is left to the lowering's batch):

| ONNX | layer | parameters |
|---|---|---|
| Conv (dilation 1, equal strides) | `conv` (tied; `groups` its group) | W (K, C/g, R, S) → (K, 1, 1, C/g, R, S, 1, 1), B (K) → (1, K, 1, 1) |
| LRN | `lrn` | |
| Mul by a parameter of one value per channel (Unsqueezed or Reshaped), and an Add of another after it | `channel_affine` | the two → scale and shift (1, C, 1, 1) |
| Reshape (N, g, C/g, H, W), Transpose (0, 2, 1, 3, 4), Reshape (N, C, H, W) | `channel_shuffle` (groups g) | |
| Gemm (alpha = beta = 1, transA 0) | `linear` over the flattened input | B (M, K) or (K, M) with transB 0 → (M, K, 1, 1), C → (1, M, 1, 1) |
| MatMul, and an Add of a constant after it | `linear` | B (K, M) → (M, K, 1, 1), the Add's constant the bias |
| Relu, Tanh, Sigmoid | `filterNL` | |
| MaxPool (ceil_mode 0, dilation 1) | `maxpool` | |
| AveragePool (padding not counted), GlobalAveragePool | `avgpool` (the whole plane) | |
| BatchNormalization | `batchnorm` (per channel) | scale, B → gamma, beta (1, C, 1, 1); mean and var the running statistics (state) |
| Add of two data tensors of one shape, Sum of several | `add` (a residual connection) | |
| Concat (axis 1) | `concat` | |
| Dropout | `dropout` (its ratio) | |
| Flatten (axis 1), Reshape (per sample) | `flatten`, `reshape` | |
| Identity | nothing | |
| Softmax, LogSoftmax (the output) | `softmax` with cross-entropy, then `evaluate` | |

Before mapping, everything computable without the data is folded (`onnx_fold`: shape arithmetic,
masks, ConstantOfShape, position indices), so the nodes left are those that read data or
parameters. A model of token ids (an integer input [batch, T]) maps its transformer ops as
`onnx_sequence` lists: embeddings, dense layers, LayerNormalization, heads, products of two
activations, the causal softmax and GELU however it is spelled.

A model whose output is logits (no Softmax at the end) gets `softmax` and `evaluate` appended, so
it trains on the mean cross-entropy over the batch. Parameters keep their initializer names
(`Network.param_names` renames the layers' own), and `Network.initial` holds their values (and
BatchNormalization's running statistics) in legion-nn's logical layouts, by those names, which
training starts from.

The graph need not be a chain: each node's layer reads the groups that made its inputs
(`Layer.inputs`), so ResNet's shortcuts and Inception's branches are kept as they are. Anything
else (another op, a dilated Conv, an Add broadcasting a tensor, a second output) is refused in
one line naming the node, its op type and what is supported. `onnx_export.save_onnx` writes the
same model back with trained values.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from legion_nn.errors import ShapeError, read_input
from legion_nn.importers.onnx_channels import ChannelOps
from legion_nn.importers.onnx_fold import (
    Folded,
    FoldError,
    fold,
    model_opsets,
    parameters,
)
from legion_nn.importers.onnx_graph import (
    OnnxError,
    first_line,
    fixed_batch,
    initializer_aliases,
    layer_names,
    layer_nodes,
    node_attributes,
    sample_shape,
)
from legion_nn.importers.onnx_image import ImageOps
from legion_nn.importers.onnx_sequence import SequenceOps
from legion_nn.layers import (
    Add,
    Concat,
    Dropout,
    Evaluate,
    FilterNL,
    Flatten,
    Reshape,
    Softmax,
)
from legion_nn.layers.base import Layer
from legion_nn.network import INPUT, Network, class_count

SUPPORTED = (
    "Conv",
    "LRN",
    "Mul by one parameter per channel (and an Add of one after it)",
    "Reshape, Transpose, Reshape (a channel shuffle)",
    "Gemm",
    "MatMul",
    "Add (two tensors of one shape, or a constant after MatMul)",
    "Sum (tensors of one shape)",
    "Concat (axis 1)",
    "Relu",
    "Tanh",
    "Sigmoid",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "BatchNormalization",
    "Dropout",
    "Flatten",
    "Reshape",
    "Identity",
    "Softmax",
    "LogSoftmax",
    "Gather (an embedding)",
    "LayerNormalization",
    "MatMul of two activations",
    "Split (features)",
    "Reshape and Transpose (heads)",
    "Where (a causal mask)",
    "elementwise ops computing GELU",
)
NONLINEAR = {"Relu": "relu", "Tanh": "tanh", "Sigmoid": "sigmoid"}


def load_onnx(path: str | Path) -> Network:
    """The network an ONNX model describes (see the module docstring)."""
    import onnx
    from google.protobuf.message import DecodeError
    from onnx import numpy_helper

    path = Path(path)
    data = read_input(path, binary=True)
    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeWarning) as exc:
        raise OnnxError(f"{path}: not an ONNX model ({first_line(exc)})") from None
    if not model.graph.node or not model.graph.input:
        raise OnnxError(f"{path}: not an ONNX model (no graph nodes or inputs)")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise OnnxError(f"{path}: not a valid ONNX model: {first_line(exc)}") from None
    stored = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name not in stored:  # its shape is checked before anything is folded from it
            sample_shape(path, value)
    try:
        folded = fold(model, fixed_batch(model.graph))
    except FoldError as exc:
        node = exc.node
        raise OnnxError(
            f"{path}: node {node.name or node.output[0]!r} ({node.op_type}): {exc}"
        ) from None
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    constants.update(folded.constants)
    for alias, source in initializer_aliases(model.graph).items():
        constants[alias] = constants[source]
    return _Reader(path, model, constants, folded).read()


class _Reader(ImageOps, ChannelOps, SequenceOps):
    def __init__(self, path: Path, model, constants: dict[str, np.ndarray], folded: Folded) -> None:
        self.path, self.model, self.constants = path, model, constants
        self.aliases = initializer_aliases(model.graph)
        self.batched, self.batches = folded.batched, folded.batches
        #: the parameters: float initializers, and the names their Identity nodes pass them on as
        self.params = parameters(model.graph)
        self.params |= {alias for alias, source in self.aliases.items() if source in self.params}
        #: values that are a parameter under another shape (an Unsqueeze of it): its name
        self.viewed: dict[str, str] = {}
        #: the nodes to read (folding left them), each named by its place among every node
        #: that could be a layer (`layer_nodes`: as `onnx_export` walks them)
        self.nodes = [
            n for n in folded.nodes if n.op_type != "Identity" or n.output[0] not in self.aliases
        ]
        self.index_of = {id(n): i for i, n in enumerate(layer_nodes(model.graph, self.aliases))}
        #: each such node's layer name, by that place (`layer_names`)
        self.layer_names = layer_names(model.graph, self.aliases)
        self.consumers: dict[str, list] = {}
        for node in self.nodes:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        #: nodes a pattern read with an earlier one
        self.claimed: set[int] = set()
        #: values that are a parameter read at constant rows (positions): (its name, the rows)
        self.rows: dict[str, tuple[str, np.ndarray]] = {}
        #: values that are heads transposed (Kᵀ): a MatMul reading one multiplies by its transpose
        self.transposed: set[str] = set()
        #: values that are a parameter Expanded over the batch (a class token): its name
        self.expanded: dict[str, str] = {}
        self.sample: tuple[int, ...] = ()
        self.outputs = {value.name for value in model.graph.output}
        self.opsets = model_opsets(model)
        self.layers: list[Layer] = []
        self.shape: tuple[int, int, int] = (1, 1, 1)  # the current layer's per-sample output
        #: per ONNX value, the group whose output it is and its per-sample shape
        self.values: dict[str, tuple[str, tuple[int, int, int]]] = {}
        #: the groups the next layer added reads, where not the layer before it
        self.reads: tuple[str, ...] = ()
        self.param_names: dict[str, str] = {}
        self.initial: dict[str, np.ndarray] = {}
        self.linear_count = 0
        self.classes = 0

    def fail(self, node, message: str) -> OnnxError:
        name = node.name or node.output[0]
        return OnnxError(f"{self.path}: node {name!r} ({node.op_type}): {message}")

    def read(self) -> Network:
        graph = self.model.graph
        inputs = [i for i in graph.input if i.name not in self.constants]
        if len(inputs) != 1:
            names = ", ".join(i.name for i in inputs)
            raise OnnxError(f"{self.path}: needs one data input, has {len(inputs)} ({names})")
        sample = sample_shape(self.path, inputs[0])
        self.sample = sample
        self.values[inputs[0].name] = (INPUT, sample)
        nodes = self.nodes
        for node in nodes:  # before any layer that reads one, wherever it stands in the graph
            if self._parameter_view(node):
                self.claimed.add(id(node))
        ends_in_softmax = False
        for position, node in enumerate(nodes):
            if id(node) in self.claimed:
                continue
            index = self.index_of[id(node)]
            data = [
                i for i in node.input if i and i not in self.constants and i not in self.batched
            ]
            try:
                if self._channel_shuffle(node, data) or self._sequence(node, data, position):
                    ends_in_softmax = False
                    continue
            except ShapeError as exc:
                raise self.fail(node, str(exc)) from None
            unknown = [i for i in data if i not in self.values]
            if unknown or not data:
                raise self.fail(
                    node,
                    f"reads {unknown[0]!r}, which no node before it makes"
                    if unknown
                    else "reads only constants",
                )
            made = len(self.layers)
            following = nodes[position + 1] if position + 1 < len(nodes) else None
            try:
                if node.op_type in ("Add", "Sum", "Concat") and len(data) > 1:
                    self._merge(node, data, index)
                else:
                    if len(data) > 1:
                        raise self.fail(node, f"reads {len(data)} tensors; supported: one")
                    self._read(data[0])
                    fused = self._matmul_add(node, index)
                    if fused is None:
                        fused = self._channel_affine(node)
                    if fused is not None:
                        node = fused
                    else:
                        self._node(node, index, following is None)
            except ShapeError as exc:
                raise self.fail(node, str(exc)) from None
            ends_in_softmax = node.op_type in ("Softmax", "LogSoftmax")
            made_here = self.layers[made:]
            self.values[node.output[0]] = (
                (made_here[-1].name, self.shape) if made_here else self.values[data[0]]
            )
        outputs = [o.name for o in graph.output]
        last = self.layers[-1].name if self.layers else INPUT
        if len(outputs) != 1 or self.values.get(outputs[0], ("",))[0] != last:
            raise OnnxError(
                f"{self.path}: its outputs {outputs} are not the one output of its last node"
            )
        if not ends_in_softmax:  # logits: cross-entropy and evaluate appended
            self._add(Softmax("softmax"), Evaluate("softmax"))
        return Network(
            re.sub(r"[^A-Za-z0-9_.-]+", "_", self.path.stem) or "onnx",
            sample,
            self.classes,
            self.layers,
            param_names=self.param_names,
            initial=self.initial,
            source=str(self.path),
            appended_loss=not ends_in_softmax,
            input_name=inputs[0].name,
            output_name=outputs[0],
            output_shape=_output_shape(graph.output[0]),
        )

    def _read(self, value: str) -> None:
        """Make `value` the next layer's input."""
        group, self.shape = self.values[value]
        previous = self.layers[-1].name if self.layers else INPUT
        self.reads = () if group == previous else (group,)

    def _matmul_add(self, node, index: int):
        """A MatMul and the Add of its bias after it, as one linear layer; the Add, or None."""
        if node.op_type != "MatMul" or node.input[1] not in self.constants:
            return None
        weights = self.constants[node.input[1]]
        after, bias = self._bias_after(node, weights.shape[-1])
        if after is None:
            return None
        self.claimed.add(id(after))
        self._linear(node, weights.T, bias, index)
        return after

    def _merge(self, node, data: list[str], index: int) -> None:
        """An Add of two data tensors, or a Concat of several along the channels."""
        if len(set(data)) != len(data):
            raise self.fail(node, "reads one tensor twice; supported: distinct inputs")
        groups = [self.values[v][0] for v in data]
        shapes = [self.values[v][1] for v in data]
        name = self.layer_names[index]
        if node.op_type in ("Add", "Sum"):
            if len(set(shapes)) != 1:
                raise self.fail(
                    node, f"adds shapes {[list(s) for s in shapes]}; broadcasting is not supported"
                )
            layer = Add(name, inputs=groups)
        else:
            if node_attributes(node).get("axis") != 1:
                raise self.fail(
                    node, f"axis {node_attributes(node).get('axis')}; only axis 1 is supported"
                )
            layer = Concat(name, inputs=groups)
        self.shape = layer.out_shape(tuple(shapes))
        self.layers.append(layer)

    def _add(self, *layers: Layer) -> None:
        for layer in layers:
            if self.reads:
                layer.inputs, self.reads = self.reads, ()
            if layer.KIND == "softmax":
                self.classes = class_count(self.shape)  # the scores it reads
            self.shape = layer.out_shape(self.shape)
            self.layers.append(layer)

    def _made(self, value: str) -> None:
        """`value` is the output of the layer added last."""
        self.values[value] = (self.layers[-1].name, self.shape)

    def _append_merge(self, layer: Layer, shapes: tuple) -> None:
        self.shape = layer.out_shape(shapes)
        self.layers.append(layer)

    def keeps_batch(self, first: int) -> bool:
        """Whether a Reshape target's first entry is the batch: 0 or −1, or a model's fixed
        batch."""
        return first in (0, -1) or self.batches[0] == self.batches[1] == first

    def name_of(self, node) -> str:
        return self.layer_names[self.index_of[id(node)]]

    def attributes(self, node) -> dict:
        return node_attributes(node)

    def _param(self, ours: str, theirs: str, value: np.ndarray) -> None:
        self.param_names[ours] = theirs
        self.initial[theirs] = value

    def _node(self, node, index: int, last: bool) -> None:
        op, attrs, name = node.op_type, node_attributes(node), self.layer_names[index]
        if self._image_node(node, attrs, name, index):
            return
        if op in NONLINEAR:
            self._add(FilterNL(name, fn=NONLINEAR[op]))
        elif op == "Dropout":
            ratio = attrs.get("ratio", 0.5)
            if len(node.input) > 1 and node.input[1] in self.constants:
                ratio = float(self.constants[node.input[1]])
            self._add(Dropout(name, ratio=float(ratio)))
        elif op == "Flatten":
            if attrs.get("axis", 1) != 1:
                raise self.fail(node, "only axis 1 (per sample) is supported")
            self._add(Flatten(name))
        elif op == "Reshape":
            self._add(Reshape(name, shape=self._reshaped(node)))
        elif op == "Identity":
            return
        elif op in ("Softmax", "LogSoftmax"):
            if not last:
                raise self.fail(node, "a softmax is supported only as the model's output")
            self._add(Softmax(name), Evaluate(name))
        else:
            raise self.fail(node, f"op not supported; supported: {', '.join(SUPPORTED)}")

    def _reshaped(self, node) -> tuple[int, int, int]:
        target = self.constants.get(node.input[1])
        if target is None:
            raise self.fail(node, "its shape must be a constant")
        sizes = [int(v) for v in target.reshape(-1)]
        if not sizes or not self.keeps_batch(sizes[0]):
            raise self.fail(node, f"shape {sizes}: the first dim must keep the batch (0 or -1)")
        per = sizes[1:]
        if per.count(-1) > 1 or any(v == 0 for v in per):
            raise self.fail(node, f"shape {sizes} is not supported")
        if len(per) > 3:
            raise self.fail(node, f"shape {sizes}: at most 3 dims per sample")
        if -1 in per:
            known = int(np.prod([v for v in per if v != -1]))
            per[per.index(-1)] = int(np.prod(self.shape)) // max(known, 1)
        return tuple(per + [1] * (3 - len(per)))  # type: ignore[return-value]


def _output_shape(value) -> tuple[int, ...]:
    """The per-sample shape of the model's output `value` where every dim past the batch is
    known, else ()."""
    dims = value.type.tensor_type.shape.dim[1:]
    if not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
        return ()
    return tuple(int(d.dim_value) for d in dims)
