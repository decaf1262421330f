"""Random small networks for property tests of the partitioner (hypothesis strategies)."""

from __future__ import annotations

from hypothesis import reject
from hypothesis import strategies as st

from legion_nn.errors import ShapeError
from legion_nn.layers import Evaluate, Filter, FilterA, FilterNL, Linear, MaxPool, Softmax
from legion_nn.network import Network
from partitioner.strategy import Strategy, factorizations, find_units


@st.composite
def networks(draw):
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
