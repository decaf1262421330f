"""Networks for partitioner tests: random small chains (hypothesis strategies) and a branching one."""

from __future__ import annotations

from hypothesis import reject
from hypothesis import strategies as st

from legion_nn.errors import ShapeError
from legion_nn.graph import TaskGraph
from legion_nn.layers import Evaluate, Filter, FilterA, FilterNL, Linear, MaxPool, Softmax
from legion_nn.lowering import Lowering
from legion_nn.network import Network
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
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


def two_headed(batch: int = 4) -> TaskGraph:
    """A trunk feeding two heads, a classifier and an auxiliary one (as in GoogLeNet): not a chain.

    The Network API is sequential, so this drives the lowering by hand, each layer lowering onto
    the tensor it is given; the trunk's output gradient gathers both heads' contributions."""
    ctx = Lowering("two-headed", batch)
    dims = (batch, 1, 12, 12)
    x = ctx.tensor("data.raw_output", dims, "data")
    ctx.labels = ctx.tensor("data.labels_output", (batch, 1, 1, 1), "data", dtype="int32")
    bindings = [("raw_data", x, Privilege.WRITE), ("labels", ctx.labels, Privilege.WRITE)]
    ctx.task("data", "data", "forward", Rect.from_dims(dims), bindings, "data")

    def stack(layers, x, shape):
        for layer in layers:
            x, shape = layer.lower(ctx, x, shape), layer.out_shape(shape)
        return x, shape

    def block(name: str) -> list:
        conv = Filter(name, out_channels=4, kernel=3, untied=False, stride=1, pad=1)
        return [conv, FilterA(name), FilterNL(name, fn="relu")]

    trunk, shape = stack(block("L0"), x, (1, 12, 12))
    head = [Linear("classifier", out=5), Softmax("classifier"), Evaluate("classifier")]
    stack(block("L1") + head, trunk, shape)
    stack(block("L2") + [Linear("aux", out=5), Softmax("aux")], trunk, shape)
    return ctx.finish()
