"""Networks for partitioner tests: random small networks (hypothesis strategies), some with a
branch merged by an add or a concat, and one with two heads."""

from __future__ import annotations

from hypothesis import reject
from hypothesis import strategies as st

from legion_nn.errors import ShapeError
from legion_nn.graph import TaskGraph
from legion_nn.layers import (
    Add,
    Concat,
    Evaluate,
    Filter,
    FilterA,
    FilterNL,
    Linear,
    MaxPool,
    Softmax,
)
from legion_nn.network import Network
from partitioner.strategy import Strategy, factorizations, find_units


@st.composite
def networks(draw, merges: bool = True, branching: bool = False):
    """A random network of one or two filter blocks and a classifier; with `merges`, perhaps a
    1x1 filter beside the last block, merged with it by an add or a concat (not a chain), and
    with `branching` always (a test of branching networks then rejects none for being chains)."""
    size = draw(st.integers(6, 11))
    layers = []
    for index in range(draw(st.integers(1, 2))):
        kernel = draw(st.integers(1, 3))
        layers.append(
            Filter(
                f"L{index}",
                out_channels=draw(st.integers(1, 3)),
                kernel=kernel,
                untied=draw(st.booleans()),
                stride=draw(st.integers(1, 2)),
                pad=draw(st.integers(0, kernel - 1)),
            )
        )
        layers += [FilterA(), FilterNL(fn="relu")]
        if draw(st.booleans()):
            layers.append(MaxPool(f"P{index}", kernel=2, stride=draw(st.integers(1, 2))))
    kinds = ["add", "concat"] if branching else [None, "add", "concat"]
    merge = draw(st.sampled_from(kinds)) if merges or branching else None
    if merge is not None:  # a 1x1 filter beside the identity, merged with it
        trunk = layers[-1].name
        channels = [layer.out_channels for layer in layers if layer.KIND == "filter"][-1]
        width = channels if merge == "add" else draw(st.integers(1, 3))
        branch = Filter("B", out_channels=width, kernel=1, untied=draw(st.booleans()))
        branch.inputs = (trunk,)
        layers += [branch, (Add if merge == "add" else Concat)("M", inputs=[trunk, "B"])]
    layers += [Linear("classifier", out=draw(st.integers(2, 5))), Softmax(), Evaluate()]
    try:
        net = Network("random", (draw(st.integers(1, 2)), size, size), layers[-3].out, layers)
    except ShapeError:
        reject()
    return net.lower(batch=draw(st.integers(1, 6)))


@st.composite
def strategies(draw, graph, nranks: int) -> Strategy:
    """A random grid for every unit of `graph`, each within `nranks` cells."""
    grids = {}
    for unit in find_units(graph):
        grids[unit.name] = draw(
            st.sampled_from(factorizations(unit.extents, unit.splittable, nranks))
        )
    return Strategy("random", grids)


def two_headed(batch: int = 4) -> TaskGraph:
    """A trunk feeding two heads, a classifier and an auxiliary one (as in GoogLeNet): not a
    chain. The trunk's output gradient gathers both heads' contributions."""

    def block(name: str, **wiring) -> list:
        conv = Filter(name, out_channels=4, kernel=3, untied=False, stride=1, pad=1, **wiring)
        return [conv, FilterA(name), FilterNL(name, fn="relu")]

    head = [Linear("classifier", out=5), Softmax("classifier"), Evaluate("classifier")]
    aux = block("L2", inputs=["L0"]) + [Linear("aux", out=5), Softmax("aux")]
    layers = block("L0") + block("L1") + head + aux
    return Network("two-headed", (1, 12, 12), 5, layers).lower(batch)
