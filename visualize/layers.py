"""The layer view of a task graph: one entry per layer, and the bytes that flow between layers.

A layer is the `Task.layer` its tasks were lowered from (an imported graph without layers is one
layer named by `NO_LAYER`). A tensor written by tasks of layer A and read by tasks of layer B ≠ A is
a flow A → B, in the phase of the writing tasks: activations flow forward, down the network, and
their gradients flow backward, up it. An activation that B reads in both passes is one flow, and
each tensor counts once per flow with its whole size (`Tensor.nbytes`): the graph is not
partitioned here. Zeroing a gradient is not a flow. Parameters belong to the layer that first
touches them.

This module is plain data, drawn by `visualize.dot`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from legion_nn.graph import TaskGraph
from legion_nn.ir import PHASES

NO_LAYER = "(no layer)"


@dataclass
class Layer:
    name: str
    tasks_by_phase: Counter = field(default_factory=Counter)
    param_bytes: int = 0


@dataclass(frozen=True)
class Flow:
    src: str
    dst: str
    phase: str
    nbytes: int
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class LayerView:
    layers: tuple[Layer, ...]
    flows: tuple[Flow, ...]


def _phase_rank(phase: str) -> int:
    return PHASES.index(phase) if phase in PHASES else len(PHASES)


def layer_of(layer: str) -> str:
    return layer or NO_LAYER


def layer_view(graph: TaskGraph) -> LayerView:
    """Layers in the order the program first runs them, and the flows between them."""
    layers: dict[str, Layer] = {}
    writers: dict[str, set[tuple[str, str]]] = defaultdict(set)
    readers: dict[str, set[str]] = defaultdict(set)
    owned: set[str] = set()
    for task in graph.tasks:
        layer = layers.setdefault(layer_of(task.layer), Layer(layer_of(task.layer)))
        layer.tasks_by_phase[task.phase] += 1
        for req in task.requirements:
            tensor = graph.tensors[req.tensor]
            if tensor.kind == "param" and tensor.name not in owned:
                owned.add(tensor.name)
                layer.param_bytes += tensor.nbytes
            if req.write_rect is not None and task.phase != "set_zero":
                writers[req.tensor].add((layer.name, task.phase))
            if req.read_rect is not None:
                readers[req.tensor].add(layer.name)

    flows: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for tensor, sources in writers.items():
        for src, phase in sorted(sources):
            for dst in sorted(readers[tensor]):
                if dst != src:
                    flows[(src, dst, phase)].append(tensor)
    order = {name: i for i, name in enumerate(layers)}
    return LayerView(
        tuple(layers.values()),
        tuple(
            Flow(src, dst, phase, sum(graph.tensors[t].nbytes for t in names), tuple(names))
            for (src, dst, phase), names in sorted(
                flows.items(),
                key=lambda item: (order[item[0][0]], order[item[0][1]], _phase_rank(item[0][2])),
            )
        ),
    )
