"""Access maps: the rects a piece of a task's space touches, halos and reductions included."""

import pytest

from legion_nn.layers import Conv, Evaluate, Filter, FilterA, Linear, MaxPool, Softmax
from legion_nn.network import Network
from legion_nn.networks import load_network
from legion_nn.op_records import piece_requirements, splittable_dims
from legion_nn.rect import Rect
from legion_nn.verify import verify


def rects(graph, task_name, piece):
    task = graph.task(task_name)
    return {r.role: r for r in piece_requirements(task, graph.tensors, piece)}


def test_halo_of_a_7x7_window_split_2x2_over_a_27x27_output():
    graph = load_network("seed-lcn").lower(batch=256)
    space = graph.task("L1.filter").space
    assert space.shape == (256, 64, 27, 27, 64)  # the output × the input channels summed
    pieces = space.split([1, 1, 2, 2, 1])
    halos = [rects(graph, "L1.filter", p)["input"].read_rect for p in pieces]
    # 27 output rows split 14 + 13; a 7-row window reads 14 + 6 = 20 input rows for the first.
    assert [p.lo[2:4] + p.hi[2:4] for p in pieces] == [
        (0, 0, 14, 14),
        (0, 14, 14, 27),
        (14, 0, 27, 14),
        (14, 14, 27, 27),
    ]
    assert halos[0] == Rect((0, 0, 0, 0), (256, 64, 20, 20))
    assert halos[1] == Rect((0, 0, 0, 14), (256, 64, 20, 33))
    assert halos[2] == Rect((0, 0, 14, 0), (256, 64, 33, 20))
    assert halos[3] == Rect((0, 0, 14, 14), (256, 64, 33, 33))
    # The halo shared by neighbours is 6 rows/columns wide: the window minus one.
    assert halos[0].intersect(halos[1]).shape == (256, 64, 20, 6)
    # Untied weights stay with their output positions; nothing is shared.
    weights = [rects(graph, "L1.filter", p)["filters"].read_rect for p in pieces]
    assert weights[0] == Rect((0, 0, 0, 0, 0, 0, 0, 0), (64, 1, 1, 64, 7, 7, 14, 14))
    assert all(not a.overlaps(b) for i, a in enumerate(weights) for b in weights[i + 1 :])


def test_stride_and_padding_clip_the_halo():
    net = Network(
        "strided",
        (3, 11, 9),
        4,
        [
            Filter("L0", out_channels=2, kernel=3, stride=2, pad=1, untied=False),
            Linear("c", out=4),
            Softmax(),
        ],
    )
    graph = net.lower(batch=2)
    verify(graph)
    space = graph.task("L0.filter").space
    assert space.shape == (2, 2, 6, 5, 3)  # (11 + 2 - 3) // 2 + 1 = 6, (9 + 2 - 3) // 2 + 1 = 5
    top = Rect((0, 0, 0, 0, 0), (2, 2, 1, 5, 3))
    bottom = Rect((0, 0, 5, 0, 0), (2, 2, 6, 5, 3))
    # Output row 0 covers padded rows -1..1: input rows 0..1; row 5 covers 9..11: rows 9..10.
    assert rects(graph, "L0.filter", top)["input"].read_rect == Rect((0, 0, 0, 0), (2, 3, 2, 9))
    assert rects(graph, "L0.filter", bottom)["input"].read_rect == Rect((0, 0, 9, 0), (2, 3, 11, 9))
    # Tied weights are read whole by every piece.
    assert rects(graph, "L0.filter", top)["filters"].read_rect == Rect.from_dims(
        (2, 1, 1, 3, 3, 3, 1, 1)
    )


def test_uneven_batch_split_and_backward_reductions():
    graph = load_network("seed-lcn-small").lower(batch=7)
    pieces = graph.task("L1.filter.grad").space.split([3, 1, 1, 1, 1])
    assert [p.shape[0] for p in pieces] == [3, 2, 2]
    reqs = [rects(graph, "L1.filter.grad", p) for p in pieces]
    # Each batch piece reduces into the whole weight gradient: the rects coincide.
    assert {r["filters.delta"].write_rect for r in reqs} == {
        Rect.from_dims((8, 1, 1, 8, 3, 3, 14, 14))
    }
    assert [r["input.delta"].write_rect.lo[0] for r in reqs] == [0, 3, 5]


def test_linear_split_over_features_reduces_the_input_gradient():
    graph = load_network("seed-lcn-small").lower(batch=4)
    halves = graph.task("classifier.linear1.grad").space.split([1, 2, 1, 1, 1, 1, 1])
    reqs = [rects(graph, "classifier.linear1.grad", p) for p in halves]
    assert (
        reqs[0]["input.delta"].write_rect
        == reqs[1]["input.delta"].write_rect
        == Rect.from_dims((4, 8, 14, 14))
    )
    assert reqs[0]["weights"].read_rect == Rect((0, 0, 0, 0), (5, 8, 14, 14))
    assert reqs[1]["weights.delta"].write_rect == Rect((5, 0, 0, 0), (10, 8, 14, 14))


def test_linear_split_over_its_input_reads_and_reduces_only_its_part():
    """A row-parallel piece (part of C, H, W) reads its part of the input and of the weights,
    writes the whole output rows (a partial sum) and adds the bias only where its part starts;
    its input and weight gradients are its own parts, whole."""
    layers = [Linear("fc", out=6), Linear("row", out=4, bias=True), Softmax()]
    graph = Network("rows", (5, 1, 1), 4, layers).lower(batch=3)
    task = graph.task("row.linear2")
    assert task.space.shape == (3, 4, 1, 1, 6, 1, 1) and task.result_dim == (3, 4, 1, 1)
    first, second = task.space.split([1, 1, 1, 1, 2, 1, 1])
    a, b = rects(graph, "row.linear2", first), rects(graph, "row.linear2", second)
    assert a["input"].read_rect == Rect((0, 0, 0, 0), (3, 3, 1, 1))
    assert b["input"].read_rect == Rect((0, 3, 0, 0), (3, 6, 1, 1))
    assert b["weights"].read_rect == Rect((0, 3, 0, 0), (4, 6, 1, 1))
    assert a["output"].write_rect == b["output"].write_rect == Rect.from_dims((3, 4, 1, 1))
    assert a["b"].read_rect == Rect.from_dims((1, 4, 1, 1)) and b["b"].read_rect.is_empty()
    grad = [rects(graph, "row.linear2.grad", p) for p in (first, second)]
    assert grad[1]["output.delta"].read_rect == Rect.from_dims((3, 4, 1, 1))
    assert grad[1]["input.delta"].write_rect == Rect((0, 3, 0, 0), (3, 6, 1, 1))
    assert grad[1]["weights.delta"].write_rect == Rect((0, 3, 0, 0), (4, 6, 1, 1))
    assert grad[0]["b.delta"].write_rect == Rect.from_dims((1, 4, 1, 1))
    assert grad[1]["b.delta"].write_rect.is_empty()


def test_filter_split_over_input_channels_reads_its_channels():
    net = Network(
        "cin",
        (4, 6, 6),
        3,
        [Conv("c", out_channels=2, kernel=3, pad=1), Linear("fc", out=3), Softmax()],
    )
    graph = net.lower(batch=2)
    space = graph.task("c.conv").space
    assert space.shape == (2, 2, 6, 6, 4)
    low, high = space.split([1, 1, 1, 1, 2])
    a, b = rects(graph, "c.conv", low), rects(graph, "c.conv", high)
    assert b["input"].read_rect == Rect((0, 2, 0, 0), (2, 4, 6, 6))
    assert b["filters"].read_rect == Rect((0, 0, 0, 2, 0, 0, 0, 0), (2, 1, 1, 4, 3, 3, 1, 1))
    assert a["output"].write_rect == b["output"].write_rect == Rect.from_dims((2, 2, 6, 6))
    assert not a["b"].read_rect.is_empty() and b["b"].read_rect.is_empty()


def test_labels_have_one_writer_however_the_data_is_cut():
    graph = load_network("seed-lcn-small").lower(batch=6)
    pieces = graph.task("data").space.split([2, 1, 2, 2])
    writes = [rects(graph, "data", p)["labels"].write_rect for p in pieces]
    non_empty = [w for w in writes if not w.is_empty()]
    assert non_empty == [Rect((0, 0, 0, 0), (3, 1, 1, 1)), Rect((3, 0, 0, 0), (6, 1, 1, 1))]


def test_softmax_splits_over_the_batch_and_reduces_the_loss():
    graph = load_network("seed-lcn-small").lower(batch=4)
    task = graph.task("classifier.softmax")
    assert task.result_dim == (1, 1, 1, 1) and task.space.shape == (4, 1, 1, 1)
    half = Rect((2, 0, 0, 0), (4, 1, 1, 1))
    reqs = rects(graph, "classifier.softmax", half)
    assert reqs["input"].read_rect == Rect((2, 0, 0, 0), (4, 10, 1, 1))
    assert reqs["output"].write_rect == Rect.from_dims((1, 1, 1, 1))
    assert str(reqs["output"].privilege) == "reduce"


def test_sparse_update_writes_only_the_selected_channels():
    net = Network(
        "sparse",
        (6, 8, 8),
        3,
        [
            Conv("c0", out_channels=4, kernel=3, pad=1),
            Filter("L1", out_channels=5, kernel=3, untied=True, update_channels=[1, 3]),
            Linear("out", out=3),
            Softmax(),
            Evaluate(),
        ],
    )
    graph = net.lower(batch=2)
    verify(graph)
    grad = graph.task("L1.filter.grad").requirement("filters.delta").write_rect
    assert grad == Rect((0, 0, 0, 1, 0, 0, 0, 0), (5, 1, 1, 3, 3, 3, 6, 6))
    update = graph.task("update_L1.W")
    assert update.requirement("params").write_rect == grad
    assert update.attrs["optimizer"] == "sgd"
    assert graph.task("L1.filter.grad").attrs["channels"] == [1, 3]


def test_maxpool_overlapping_windows():
    net = Network(
        "pool",
        (2, 9, 9),
        2,
        [
            MaxPool("p", kernel=3, stride=2),
            Linear("c", out=2),
            Softmax(),
        ],
    )
    graph = net.lower(batch=1)
    verify(graph)
    halves = graph.task("p.maxpool").space.split([1, 1, 2, 1])
    halos = [rects(graph, "p.maxpool", h)["input"].read_rect for h in halves]
    assert halos[0].lo[2:3] + halos[0].hi[2:3] == (0, 5)  # output rows 0..1 read rows 0..4
    assert halos[1].lo[2:3] + halos[1].hi[2:3] == (4, 9)  # output rows 2..3 read rows 4..8


def test_reshape_splits_only_over_the_batch():
    graph = load_network("three-layer-convnet").lower(batch=2)
    assert splittable_dims(graph.task("conv1.conv")) == (0, 1, 2, 3, 4)  # 4: input channels
    net = Network(
        "r",
        (2, 4, 4),
        3,
        [
            FilterA("a"),
            Linear("c", out=3),
            Softmax(),
        ],
    )
    verify(net.lower(batch=1))
    from legion_nn.layers import Flatten

    flat = Network(
        "f", (2, 4, 4), 3, [FilterA("a"), Flatten("flat"), Linear("c", out=3), Softmax()]
    ).lower(batch=2)
    verify(flat)
    assert splittable_dims(flat.task("flat.reshape")) == (0,)
    assert splittable_dims(flat.task("flat.reshape.grad")) == (0,)
    assert flat.tensors["flat.reshape.output"].dims == (2, 32, 1, 1)


@pytest.mark.parametrize("spatial, stats", [(True, (2, 4, 1, 1)), (False, (2, 4, 3, 3))])
def test_batchnorm_statistics_reduce_over_the_batch(spatial, stats):
    from legion_nn.layers import BatchNorm

    layers = [FilterA("a"), BatchNorm("bn", spatial=spatial), Linear("c", out=2), Softmax()]
    net = Network("bn", (4, 3, 3), 2, layers)
    graph = net.lower(batch=6)
    verify(graph)
    assert graph.tensors["bn.batchnorm.stats"].dims == stats
    halves = graph.task("bn.batchnorm.stats").space.split([2, 1, 1, 1])
    writes = {rects(graph, "bn.batchnorm.stats", h)["stats"].write_rect for h in halves}
    assert writes == {Rect.from_dims(stats)}
    names = [t.name for t in graph.tasks]
    assert names.index("bn.batchnorm.grad") < names.index("bn.batchnorm.stats.grad")
