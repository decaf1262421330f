"""`Network`: an ordered list of named layers over a per-sample input, and its lowering.

The Python API::

    net = Network("tiny", input=(1, 20, 20), classes=10, layers=[
        Filter("L0", out_channels=8, kernel=5), FilterA(), FilterNL(fn="relu"),
        Linear("classifier", out=10), Softmax(), Evaluate()])
    graph = net.lower(batch=32)

A layer reads the output of the one before it unless its `inputs` names other groups, so a
residual block is written in line::

    Conv("b1", out_channels=16, kernel=3, pad=1), Relu("b1r"), Conv("b2", out_channels=16,
    kernel=3, pad=1), Add("res", inputs=["b2", "L0"]), Relu("out")

Shapes are inferred layer by layer when the network is built; a layer that cannot take its input
raises `ShapeError` naming the layer, the shapes and what would fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from legion_nn.errors import LegionNNError, ShapeError
from legion_nn.graph import TaskGraph
from legion_nn.layers.base import Layer, Shape, check_rank
from legion_nn.lowering import Lowering
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

DTYPES = ("float32", "float64")
#: the name `inputs` give the network's input
INPUT = "data"


def class_count(scores: Shape) -> int:
    """The classes of a softmax's input: (classes, 1, 1) per sample, or (T, classes) per token."""
    return scores[-1] if len(scores) == 2 else scores[0]


@dataclass
class Network:
    name: str
    #: the per-sample input: images (C, H, W), or token ids (T,), which an embedding reads
    input: tuple[int, ...]
    #: the classes of its softmax: the vocabulary of a language model
    classes: int
    layers: list[Layer] = field(default_factory=list)
    #: names for the layers' parameters in place of their own (an imported model's)
    param_names: dict[str, str] = field(default_factory=dict)
    #: values parameters and state start from, in their logical layouts, by tensor name (an
    #: imported model's; the others start from their tensors' `init`)
    initial: dict[str, Any] = field(default_factory=dict)
    #: the file it was read from (an ONNX model: `train --save-onnx` writes it back), or ""
    source: str = ""
    #: whether the softmax and evaluate at its end were appended to train it (a model whose
    #: output is logits): its own output is then the scores they read (`predict` writes those)
    appended_loss: bool = False
    #: the names of its data input and of its output where its source names them (an ONNX
    #: model's graph input and output), which `predict` reads and writes
    input_name: str = "x"
    output_name: str = "y"
    #: the per-sample shape of that output where its source gives it (ONNX's (classes,) for
    #: what legion-nn holds as (classes, 1, 1)), else () for the shape legion-nn holds
    output_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.input = tuple(self.input)  # type: ignore[assignment]
        if len(self.input) not in (1, 3) or any(
            not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in self.input
        ):
            raise ShapeError(
                f"network {self.name}: input must be images [C, H, W] or token ids [T] of "
                f"positive ints, got {list(self.input)}"
            )
        if isinstance(self.classes, bool) or not isinstance(self.classes, int) or self.classes < 1:
            raise ShapeError(
                f"network {self.name}: classes must be a positive int, got {self.classes!r}"
            )
        for layer in self.layers:
            if isinstance(layer.inputs, str) or not all(isinstance(n, str) for n in layer.inputs):
                raise ShapeError(f"{layer.label}: inputs must be a list of layer names")
            layer.inputs = tuple(layer.inputs)
        self._name_groups()
        self.shapes()

    def _name_groups(self) -> None:
        group = "L0"
        seen: set[tuple[str, str]] = set()
        for layer in self.layers:
            if layer.name:
                group = layer.name
            else:
                layer.name = group
            key = (layer.name, layer.stem)
            if key in seen and layer.KIND not in ("linear",):
                raise ShapeError(
                    f"{layer.label}: group {layer.name} already has a {layer.KIND} layer; "
                    f"give this one its own name"
                )
            seen.add(key)

    def shapes(self) -> list[tuple[Layer, Any, Shape]]:
        """(layer, input shape, output shape) for every layer, checking each as it goes; a merge
        layer's input shape is the tuple of its inputs' shapes."""
        return [(layer, shape, out) for layer, _, shape, out in self._wired()]

    def _wired(self) -> list[tuple[Layer, tuple[str, ...], Any, Shape]]:
        """Each layer with the groups whose outputs it reads (`inputs` resolved against the groups
        made so far; `data` is the network's input), its input shape and its output shape."""
        made: dict[str, Shape] = {INPUT: self.input}
        out = []
        previous = INPUT
        seen_softmax = False
        for layer in self.layers:
            names = tuple(layer.inputs) or (previous,)
            if layer.MERGES and len(names) < 2:
                raise ShapeError(
                    f"{layer.label}: inputs must name at least two earlier layers, got {list(names)}"
                )
            if not layer.MERGES and len(names) > 1:
                raise ShapeError(f"{layer.label}: reads one input, got inputs {list(names)}")
            if layer.name == INPUT:
                raise ShapeError(f"{layer.label}: {INPUT!r} names the network's input")
            for name in names:
                if name not in made:
                    raise ShapeError(
                        f"{layer.label}: input {name!r} is not an earlier layer; earlier: "
                        f"{', '.join(made)}"
                    )
            seen_softmax = seen_softmax or layer.KIND == "softmax"
            if layer.KIND == "evaluate" and not seen_softmax:
                raise ShapeError(f"{layer.label}: needs a softmax layer before it")
            shape = tuple(made[n] for n in names) if layer.MERGES else made[names[0]]
            for each in shape if layer.MERGES else (shape,):
                check_rank(layer, each)
            made[layer.name] = layer.out_shape(shape)
            out.append((layer, names, shape, made[layer.name]))
            previous = layer.name
        scores = [s for layer, _, s, _ in out if layer.KIND == "softmax"]
        if scores and class_count(scores[-1]) != self.classes:
            raise ShapeError(
                f"network {self.name}: softmax gets {class_count(scores[-1])} scores but the "
                f"network has {self.classes} classes; make the last linear layer's out "
                f"{self.classes}"
            )
        return out

    @property
    def tokens(self) -> bool:
        """Whether the network reads token ids."""
        return len(self.input) == 1

    @property
    def vocab(self) -> int | None:
        """The token ids a network of tokens reads: its embedding's rows (None for images)."""
        if not self.tokens:
            return None
        rows = [layer.vocab for layer, names, _, _ in self._wired() if INPUT in names]
        return min(rows) if rows else None

    def label_dims(self, batch: int) -> tuple[int, ...]:
        """The dims of a batch's labels: a target per token where the softmax scores tokens
        (N, T), else a class per sample (N, 1, 1, 1)."""
        scores = [s for layer, s, _ in self.shapes() if layer.KIND == "softmax"]
        if scores and len(scores[-1]) == 2:
            return (batch, scores[-1][0])
        return (batch, 1, 1, 1)

    def lower(
        self,
        batch: int,
        dtype: str = "float32",
        optimizer: str = "sgd",
        hyperparameters: dict[str, float] | None = None,
    ) -> TaskGraph:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise LegionNNError(f"batch must be a positive int, got {batch!r}")
        if dtype not in DTYPES:
            raise LegionNNError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        ctx = Lowering(self.name, batch, dtype, optimizer, hyperparameters, self.param_names)
        dims = (batch,) + tuple(self.input)
        x = ctx.tensor("data.raw_output", dims, "data", dtype="int32" if self.tokens else None)
        ctx.labels = ctx.tensor("data.labels_output", self.label_dims(batch), "data", dtype="int32")
        ctx.task(
            "data",
            "data",
            "forward",
            Rect.from_dims(dims),
            [("raw_data", x, Privilege.WRITE), ("labels", ctx.labels, Privilege.WRITE)],
            "data",
        )
        made = {INPUT: x}
        for layer, names, shape, _ in self._wired():
            reads = tuple(made[name] for name in names)
            made[layer.name] = layer.lower(ctx, reads if layer.MERGES else reads[0], shape)
        return ctx.finish()

    def to_spec(self) -> dict:
        return {
            "name": self.name,
            "input": list(self.input),
            "classes": self.classes,
            "layers": [layer.to_spec() for layer in self.layers],
        }
