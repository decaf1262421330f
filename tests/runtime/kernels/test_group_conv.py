"""Grouped and depthwise convolution (`conv` with `groups` > 1, op `group_conv`): its kernels
against NumPy, ONNX's reference evaluator and central differences, its access maps, its pieces
against the whole task, and a network of them split over ranks against one process.

Tolerances are rounding-error bounds, not observed differences: a sum of m products computed in
any order, with or without fused multiply-adds, is within γ(m) = m·u / (1 − m·u) of the exact
sum relative to the sum of the terms' magnitudes (Higham, Accuracy and Stability, §3.1), and
that magnitude sum is the same convolution of |x| and |w|.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from legion_nn.errors import LegionNNError, ShapeError
from legion_nn.graphjson import dumps
from legion_nn.layers import Conv, Linear, Softmax
from legion_nn.layers.filter import _filter_rects
from legion_nn.layers.group_conv import group_conv_boxes, group_conv_rects
from legion_nn.network import Network
from legion_nn.op_records import piece_requirements, record_of
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from legion_nn.spec import network_from_dict
from partitioner.strategy import builtin
from runtime.adapters import StepContext
from runtime.kernels import group_conv as kernels
from runtime.kernels.group_conv import group_conv_backward, group_conv_forward
from runtime.piece_views import run_task_piece
from tests.numeric_grad import numeric_grad
from tests.runtime.test_rank_executor import assert_same, config, local_run, ranks_run

U64, U32 = 2.0**-53, 2.0**-24


def gamma(m: int, u: float) -> float:
    return m * u / (1 - m * u)


#: (name, N, C, H, W, K, groups, R, S, stride, (top, bottom, left, right))
CASES = [
    ("group2", 2, 6, 9, 8, 4, 2, 3, 3, 2, (1, 0, 2, 1)),
    ("group4", 2, 8, 7, 7, 8, 4, 3, 2, 1, (0, 2, 1, 0)),
    ("depthwise", 2, 5, 9, 9, 5, 5, 3, 3, 2, (1, 1, 1, 1)),
    ("depthwise-x2", 2, 3, 8, 6, 6, 3, 3, 3, 1, (2, 0, 0, 1)),
    ("stride3", 1, 4, 10, 7, 4, 4, 2, 3, 3, (2, 1, 0, 2)),
    ("wide-groups", 2, 40, 6, 5, 6, 2, 3, 3, 2, (1, 0, 0, 1)),  # 20 channels a group
]
IDS = [case[0] for case in CASES]


def operands(case, dtype=np.float64, seed=0):
    _, n, c, h, w, k, groups, r, s, stride, pads = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    weights = rng.standard_normal((k, 1, 1, c // groups, r, s, 1, 1)).astype(dtype)
    b = rng.standard_normal((1, k, 1, 1)).astype(dtype)
    return x, weights, b, groups, stride, pads


def reference(x, w, b, groups, stride, pads) -> np.ndarray:
    """y in float64, group by group over the windows of the zero-padded input."""
    x = x.astype(np.float64)
    w = w[:, 0, 0, :, :, :, 0, 0].astype(np.float64)
    k, cg, r, s = w.shape
    kg = k // groups
    top, bottom, left, right = pads
    padded = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    p = (padded.shape[2] - r) // stride + 1
    q = (padded.shape[3] - s) // stride + 1
    windows = np.lib.stride_tricks.sliding_window_view(padded, (r, s), axis=(2, 3))
    windows = windows[:, :, : (p - 1) * stride + 1 : stride, : (q - 1) * stride + 1 : stride]
    y = np.empty((x.shape[0], k, p, q))
    for g in range(groups):
        inputs = windows[:, g * cg : (g + 1) * cg]
        y[:, g * kg : (g + 1) * kg] = np.einsum(
            "ncpqrs,kcrs->nkpq", inputs, w[g * kg : (g + 1) * kg]
        )
    if b is not None:
        y += b.reshape(1, k, 1, 1).astype(np.float64)
    return y


def magnitude(x, w, b, groups, stride, pads) -> np.ndarray:
    """Σ |terms| of each output: the same convolution of the magnitudes."""
    return reference(np.abs(x), np.abs(w), np.abs(b), groups, stride, pads)


def terms(w) -> int:
    """Terms of one output's sum: Cg·R·S products and the bias."""
    return w.shape[3] * w.shape[4] * w.shape[5] + 1


def onnx_conv(x, w, b, groups, stride, pads) -> np.ndarray:
    """ONNX's reference evaluator on a one-node Conv model."""
    kind = TensorProto.DOUBLE if x.dtype == np.float64 else TensorProto.FLOAT
    top, bottom, left, right = pads
    node = helper.make_node(
        "Conv",
        ["x", "w", "b"],
        ["y"],
        group=groups,
        strides=[stride, stride],
        pads=[top, left, bottom, right],  # ONNX: all begins, then all ends
    )
    graph = helper.make_graph(
        [node],
        "grouped",
        [helper.make_tensor_value_info(name, kind, None) for name in ("x", "w", "b")],
        [helper.make_tensor_value_info("y", kind, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": x, "w": w[:, 0, 0, :, :, :, 0, 0], "b": b.reshape(-1)}
    return ReferenceEvaluator(model).run(None, feeds)[0]


# -- kernels: forward -------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["gemm", "direct"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_equals_numpy_and_onnx_in_float64(case, path):
    x, w, b, groups, stride, pads = operands(case)
    got = group_conv_forward(x, w, b, groups, stride, pads, path=path)
    want = reference(x, w, b, groups, stride, pads)
    assert got.shape == want.shape and got.dtype == np.float64
    # the kernel's rounding and the reference's, each within γ(m) of the magnitudes
    bound = 2 * gamma(terms(w), U64) * magnitude(x, w, b, groups, stride, pads)
    assert np.all(np.abs(got - want) <= bound)
    assert np.all(np.abs(got - onnx_conv(x, w, b, groups, stride, pads)) <= bound)


@pytest.mark.parametrize("path", ["gemm", "direct"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_in_float32_is_within_its_rounding(case, path):
    x, w, b, groups, stride, pads = operands(case, np.float32)
    got = group_conv_forward(x, w, b, groups, stride, pads, path=path)
    assert got.dtype == np.float32
    # float32 inputs are exact in float64: the float64 reference is the exact sum but for
    # its own, far smaller, rounding
    size = magnitude(x, w, b, groups, stride, pads)
    bound = (gamma(terms(w), U32) + gamma(terms(w), U64)) * size
    assert np.all(np.abs(got - reference(x, w, b, groups, stride, pads)) <= bound)
    # ONNX's evaluator rounds in float32 too: each within its bound of the exact sum
    theirs = onnx_conv(x, w, b, groups, stride, pads).astype(np.float64)
    assert np.all(np.abs(got - theirs) <= 2 * gamma(terms(w), U32) * size)


def random_cases(count: int):
    rng = np.random.default_rng(11)
    for _ in range(count):
        groups, kg, cg = (int(v) for v in rng.integers(1, 4, 3))
        r, s, stride = (int(v) for v in rng.integers(1, 5, 3))
        pads = tuple(int(v) for v in rng.integers(0, 4, 4))
        h = max(1, r - pads[0] - pads[1]) + int(rng.integers(0, 6))
        w = max(1, s - pads[2] - pads[3]) + int(rng.integers(0, 6))
        yield ("random", 2, groups * cg, h, w, groups * kg, groups, r, s, stride, pads)


@pytest.mark.parametrize("path", ["gemm", "direct"])
def test_forward_and_backward_on_random_shapes(path):
    """Windows wider than the stride or not, pads wider than the window, planes narrower than the
    stride: each path against the reference, and the two paths' gradients against each other."""
    for case in random_cases(40):
        x, w, b, groups, stride, pads = operands(case)
        got = group_conv_forward(x, w, b, groups, stride, pads, path=path)
        size = magnitude(x, w, b, groups, stride, pads)
        bound = 2 * gamma(terms(w), U64) * size
        assert np.all(np.abs(got - reference(x, w, b, groups, stride, pads)) <= bound), case
        dy = np.random.default_rng(2).standard_normal(got.shape)
        other = "direct" if path == "gemm" else "gemm"
        mine = group_conv_backward(dy, x, w, groups, stride, pads, path=path)
        theirs = group_conv_backward(dy, x, w, groups, stride, pads, path=other)
        dy_size = np.abs(dy)
        sizes = group_conv_backward(dy_size, np.abs(x), np.abs(w), groups, stride, pads)
        # dx and dw are sums of at most N·K·P·Q products each, and db of N·P·Q terms
        m = dy.size * w.shape[3] * w.shape[4] * w.shape[5]
        for a, c, magnitude_sum in zip(mine, theirs, sizes):
            assert np.all(np.abs(a - c) <= 3 * gamma(m, U64) * magnitude_sum), case


def test_the_path_follows_the_channels_per_group(monkeypatch):
    """Many channels a group go to the GEMM filter kernels group by group; few to the loops."""
    calls = []
    real = kernels.filter_forward
    monkeypatch.setattr(kernels, "filter_forward", lambda *a: calls.append(1) or real(*a))
    x, w, b, groups, stride, pads = operands(CASES[-1])  # 20 channels a group
    assert w.shape[3] >= kernels.GEMM_CHANNELS > 3  # and every other case has at most 3
    group_conv_forward(x, w, b, groups, stride, pads)
    assert len(calls) == groups
    calls.clear()
    x, w, b, groups, stride, pads = operands(CASES[2])  # depthwise
    group_conv_forward(x, w, b, groups, stride, pads)
    assert not calls


def test_no_bias_and_float32_bias_are_taken():
    x, w, b, groups, stride, pads = operands(CASES[1])
    with_b = group_conv_forward(x, w, b, groups, stride, pads)
    without = group_conv_forward(x, w, None, groups, stride, pads)
    bound = gamma(terms(w), U64) * magnitude(x, w, b, groups, stride, pads) * 2
    assert np.all(np.abs(with_b - without - b) <= bound)


# -- kernels: backward ------------------------------------------------------------------------

#: small enough for a central difference of every element
GRAD_CASES = [
    ("group2", 2, 4, 6, 5, 4, 2, 3, 2, 2, (1, 0, 0, 1)),
    ("depthwise", 2, 3, 5, 6, 3, 3, 3, 3, 2, (1, 1, 2, 0)),
    ("depthwise-x2", 1, 2, 5, 5, 4, 2, 3, 3, 1, (0, 1, 1, 1)),
    ("wide-groups", 1, 32, 4, 4, 4, 2, 2, 2, 1, (1, 0, 0, 0)),
]


@pytest.mark.parametrize("path", ["gemm", "direct"])
@pytest.mark.parametrize("case", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_backward_equals_central_differences(case, path):
    x, w, b, groups, stride, pads = operands(case)
    y = group_conv_forward(x, w, b, groups, stride, pads, path=path)
    dy = np.random.default_rng(1).standard_normal(y.shape)
    dx, dw, db = group_conv_backward(dy, x, w, groups, stride, pads, path=path)
    assert dx.shape == x.shape and dw.shape == w.shape and db.shape == b.shape

    def f():
        return group_conv_forward(x, w, b, groups, stride, pads, path=path)

    # y is linear in each of x, w and b, so the difference has no truncation error and a large
    # step only shrinks the rounding: each output's error γ(m)·(its magnitude), divided by h
    h = 2.0**-6
    size = magnitude(np.abs(x) + h, np.abs(w) + h, np.abs(b) + h, groups, stride, pads).max()
    outputs = y.size
    for name, value, analytic, slope in (
        ("x", x, dx, np.abs(w).max()),
        ("w", w, dw, np.abs(x).max() + h),
        ("b", b, db, 1.0),
    ):
        numeric = numeric_grad(f, value, dy, h)
        per_output = gamma(terms(w), U64) * size / h
        # the outputs' errors, the weighted sum's rounding, and x ± h rounded (a step off by
        # up to u·(|x| + h) each way)
        bound = (
            np.abs(dy).sum() * (per_output + gamma(outputs, U64) * (slope + per_output))
            + np.abs(analytic) * 2 * U64 * (np.abs(value).max() + h) / h
        )
        assert np.all(np.abs(analytic - numeric) <= bound), name


@pytest.mark.parametrize("path", ["gemm", "direct"])
def test_backward_without_dx_skips_it(path):
    x, w, b, groups, stride, pads = operands(CASES[0])
    dy = np.ones(group_conv_forward(x, w, b, groups, stride, pads).shape)
    dx, dw, db = group_conv_backward(dy, x, w, groups, stride, pads, need_dx=False, path=path)
    _, dw_full, db_full = group_conv_backward(dy, x, w, groups, stride, pads, path=path)
    assert dx is None
    np.testing.assert_array_equal(dw, dw_full)
    np.testing.assert_array_equal(db, db_full)


def test_bad_kernel_arguments_are_named():
    x, w, b, _, stride, pads = operands(CASES[0])
    with pytest.raises(ValueError, match="input channels"):
        group_conv_forward(x, w, b, 4, stride, pads)
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        group_conv_forward(x[:, :3], w[:, :, :, :1], b, 3, stride, pads)
    with pytest.raises(ValueError, match="path must be one of"):
        group_conv_forward(x, w, b, 2, stride, pads, path="fast")


# -- the layer and its access maps ------------------------------------------------------------


def grouped_network(depthwise_stride: int = 2):
    return network_from_dict(
        {
            "name": "grouped",
            "input": [4, 8, 8],
            "classes": 5,
            "layers": [
                {"kind": "conv", "name": "A", "out_channels": 8, "kernel": 3, "pad": 1},
                {"kind": "filterNL", "fn": "relu"},
                # 4 output channels a group from 2 input channels: a piece's input channels
                # differ from its output channels
                {"kind": "conv", "name": "B", "out_channels": 16, "kernel": 1, "groups": 4},
                {"kind": "filterNL", "fn": "relu"},
                {
                    "kind": "conv",
                    "name": "D",
                    "out_channels": 16,
                    "kernel": 3,
                    "stride": depthwise_stride,
                    "pad": 1,
                    "groups": 16,
                },
                {"kind": "filterNL", "fn": "relu"},
                {"kind": "linear", "name": "fc", "out": 5},
                {"kind": "softmax"},
                {"kind": "evaluate"},
            ],
        },
        "grouped.json",
    )


GRAPH = grouped_network().lower(batch=3)


def rects(task_name: str, piece: Rect) -> dict:
    task = GRAPH.task(task_name)
    return {
        r.role: r.read_rect or r.write_rect for r in piece_requirements(task, GRAPH.tensors, piece)
    }


def test_grouped_layers_lower_to_group_conv_with_grouped_weights():
    tasks = {t.name: t for t in GRAPH.tasks}
    assert tasks["A.conv"].op == "conv"
    assert tasks["B.conv"].op == tasks["B.conv.grad"].op == "group_conv"
    assert tasks["B.conv"].space.shape == (3, 16, 8, 8, 2)  # output × a group's 2 channels
    assert tasks["D.conv"].space.shape == (3, 16, 4, 4, 1)
    assert tasks["D.conv"].attrs["groups"] == 16
    assert GRAPH.tensors["B.W"].dims == (16, 1, 1, 2, 1, 1, 1, 1)
    assert GRAPH.tensors["D.W"].dims == (16, 1, 1, 1, 3, 3, 1, 1)
    assert GRAPH.tensors["D.W"].init == "he:9"  # the fan-in of one group: C/g·R·S
    record = record_of("group_conv")
    assert record.packed_role is None and record.sums_over == 1


def test_a_piece_of_one_group_reads_only_its_channels():
    # B: 16 outputs from 8 inputs in 4 groups, 4 outputs and 2 inputs a group
    group1 = rects("B.conv", Rect((0, 4, 0, 0, 0), (3, 8, 8, 8, 2)))
    assert group1["input"] == Rect((0, 2, 0, 0), (3, 4, 8, 8))
    assert group1["filters"] == Rect((4, 0, 0, 0, 0, 0, 0, 0), (8, 1, 1, 2, 1, 1, 1, 1))
    assert group1["b"] == Rect((0, 4, 0, 0), (1, 8, 1, 1))
    # part of a group's output channels still reads all of its input channels
    part = rects("B.conv", Rect((0, 6, 0, 0, 0), (3, 7, 8, 8, 2)))
    assert part["input"] == Rect((0, 2, 0, 0), (3, 4, 8, 8))
    # the second input channel of group 1: one channel, and no bias
    second = rects("B.conv", Rect((0, 4, 0, 0, 1), (3, 8, 8, 8, 2)))
    assert second["input"] == Rect((0, 3, 0, 0), (3, 4, 8, 8))
    assert second["filters"] == Rect((4, 0, 0, 1, 0, 0, 0, 0), (8, 1, 1, 2, 1, 1, 1, 1))
    assert second["b"].is_empty()
    grad = rects("B.conv.grad", Rect((0, 4, 0, 0, 1), (3, 8, 8, 8, 2)))
    assert grad["input.delta"] == second["input"]
    assert grad["filters.delta"] == second["filters"]
    assert grad["b.delta"].is_empty()
    # whole groups 0..2 read exactly their channels
    whole = Rect((0, 0, 0, 0, 0), (3, 12, 8, 8, 2))
    assert rects("B.conv", whole)["input"] == Rect((0, 0, 0, 0), (3, 6, 8, 8))
    # the second channel of groups 0 and 1 spans channel 2, the first of group 1, between them
    across = rects("B.conv", Rect((0, 2, 0, 0, 1), (3, 6, 8, 8, 2)))
    assert across["input"] == Rect((0, 1, 0, 0), (3, 4, 8, 8))


def test_depthwise_pieces_split_over_channels_read_exactly_their_channels():
    space = GRAPH.task("D.conv").space
    for piece in space.split([1, 4, 1, 1, 1]):
        k0, k1 = piece.lo[1], piece.hi[1]
        for task in ("D.conv", "D.conv.grad"):
            found = rects(task, piece)
            role = "input" if task == "D.conv" else "input.delta"
            assert found[role] == Rect((0, k0, 0, 0), (3, k1, 8, 8))
        assert found["filters.delta"] == Rect((k0, 0, 0, 0, 0, 0, 0, 0), (k1, 1, 1, 1, 3, 3, 1, 1))
        assert found["b.delta"] == Rect((0, k0, 0, 0), (1, k1, 1, 1))


def test_rows_and_columns_are_a_convs_halo():
    task = GRAPH.task("D.conv")
    dims = task.role_dims(GRAPH.tensors)
    for piece in task.space.split([1, 2, 2, 3, 1]):
        found = group_conv_rects(task.attrs, dims, piece)["input"]
        conv = _filter_rects(task.attrs, {"input": dims["input"]}, piece)["input"]
        assert (found.lo[2:], found.hi[2:]) == (conv.lo[2:], conv.hi[2:])


def test_the_box_map_is_the_access_map():
    rng = np.random.default_rng(3)
    for name in ("B.conv", "B.conv.grad", "D.conv", "D.conv.grad"):
        task = GRAPH.task(name)
        dims = task.role_dims(GRAPH.tensors)
        space = task.space
        lo = np.stack([rng.integers(a, b, 60) for a, b in zip(space.lo, space.hi)], axis=1)
        hi = np.stack([rng.integers(x + 1, b + 1) for x, b in zip(lo.T, space.hi)], axis=1)
        found = group_conv_boxes(task.attrs, dims, lo, hi)
        assert set(found) == set(dims)
        for i in range(len(lo)):
            expected = group_conv_rects(task.attrs, dims, Rect(lo[i], hi[i]))
            for role, (role_lo, role_hi) in found.items():
                got = Rect(role_lo[i], role_hi[i])
                assert got.is_empty() if expected[role].is_empty() else got == expected[role]


# -- pieces through the adapters against the whole task ---------------------------------------


def run_pieces(graph, task, grid, arrays, ctx) -> dict:
    """Every piece of `task` over `grid` on copies of `arrays`, reductions and outputs zeroed
    first and summed into; the arrays written."""
    arrays = {name: value.copy() for name, value in arrays.items()}
    for req in task.requirements:
        if req.privilege in (Privilege.WRITE, Privilege.REDUCE):
            arrays[req.tensor][...] = 0

    def view(name, rect):
        return arrays[name][rect.to_slices()]

    for piece in task.space.split(grid):
        if not piece.is_empty():
            run_task_piece(task, piece, graph.tensors, view, ctx, partial=True)
    return {
        req.tensor: arrays[req.tensor]
        for req in task.requirements
        if req.privilege in (Privilege.WRITE, Privilege.REDUCE)
    }


GRIDS = [
    (1, 3, 1, 1, 2),  # output channels across group boundaries × a group's channels
    (1, 8, 1, 1, 2),  # half groups
    (1, 5, 1, 1, 1),
    (2, 1, 3, 2, 1),  # rows and columns: border pieces padded on their side only
    (1, 3, 2, 2, 2),
    (1, 2, 6, 7, 1),  # every output row and column a piece of its own
]

#: a 1×1 window padded by 1: the border pieces' windows lie wholly in the padding and read nothing
PADDED = network_from_dict(
    {
        "name": "padded",
        "input": [4, 4, 5],
        "classes": 3,
        "layers": [
            {"kind": "conv", "name": "E", "out_channels": 8, "kernel": 1, "pad": 1, "groups": 4},
            {"kind": "linear", "name": "fc", "out": 3},
            {"kind": "softmax"},
        ],
    },
    "padded.json",
).lower(batch=2)
PIECE_TASKS = {
    **{name: GRAPH for name in ("B.conv", "B.conv.grad", "D.conv", "D.conv.grad")},
    "E.conv": PADDED,
    "E.conv.grad": PADDED,
}


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("name", sorted(PIECE_TASKS))
def test_pieces_through_the_adapters_add_up_to_the_whole_task(name, grid):
    graph = PIECE_TASKS[name]
    task = graph.task(name)
    grid = tuple(min(g, e) for g, e in zip(grid, task.space.shape))
    rng = np.random.default_rng(5)
    arrays = {
        req.tensor: rng.standard_normal(graph.tensors[req.tensor].dims) for req in task.requirements
    }
    ctx = StepContext(step=0)
    whole = run_pieces(graph, task, (1,) * 5, arrays, ctx)
    pieces = run_pieces(graph, task, grid, arrays, ctx)
    # every sum has at most the space's volume of terms, in whatever order its pieces add them
    size = run_pieces(graph, task, (1,) * 5, {k: np.abs(v) for k, v in arrays.items()}, ctx)
    bound = 2 * gamma(task.space.volume, U64)
    for tensor, value in whole.items():
        assert np.all(np.abs(pieces[tensor] - value) <= bound * size[tensor]), tensor
    if task.phase == "forward":
        # the whole task is the kernel on the whole tensors
        b = arrays[task.requirement("b").tensor]
        x = arrays[task.requirement("input").tensor]
        w = arrays[task.requirement("filters").tensor]
        pads = tuple(task.attrs["pad"])
        want = reference(x, w, b, task.attrs["groups"], task.attrs["stride"], pads)
        got = whole[task.requirement("output").tensor]
        size = magnitude(x, w, b, task.attrs["groups"], task.attrs["stride"], pads)
        assert np.all(np.abs(got - want) <= 2 * gamma(terms(w), U64) * size)


# -- a network over ranks ---------------------------------------------------------------------


def test_the_model_strategy_cuts_group_conv_output_channels():
    graph = grouped_network().lower(batch=7)
    for nranks in (2, 4):
        grids = builtin(graph, "model", nranks).task_placement(graph)[0]
        for name in ("B.conv", "D.conv", "B.conv.grad", "D.conv.grad"):
            assert grids[name] == (1, nranks, 1, 1, 1), name


@pytest.mark.parametrize(
    ("strategy", "nranks"), [("data", 2), ("model", 2), ("model", 3), ("model", 4), ("spatial", 2)]
)
def test_a_grouped_network_split_over_ranks_equals_one_process(strategy, nranks):
    cfg = config(grouped_network())  # batch 7: uneven over the ranks
    assert_same(local_run(cfg), ranks_run(cfg, nranks, strategy))


# -- bad input, and one group as before --------------------------------------------------------


def one_conv(groups=None, channels=6, out=8, **extra):
    layer = {"kind": "conv", "name": "G", "out_channels": out, "kernel": 3, **extra}
    if groups is not None:
        layer["groups"] = groups
    spec = {
        "name": "one",
        "input": [channels, 6, 6],
        "classes": 3,
        "layers": [layer, {"kind": "linear", "name": "fc", "out": 3}, {"kind": "softmax"}],
    }
    return network_from_dict(json.loads(json.dumps(spec)), "one.json")


def test_groups_that_do_not_divide_the_input_channels_name_the_layer():
    layers = [Conv("G", out_channels=8, kernel=3, groups=4), Linear("fc", out=3), Softmax()]
    with pytest.raises(ShapeError) as error:
        Network("one", (6, 6, 6), 3, layers)
    message = str(error.value)
    assert message.startswith("layer G (conv): groups 4 must divide its 6 input channels")
    assert "\n" not in message
    with pytest.raises(LegionNNError, match=r"^one.json: layer G \(conv\): groups 4 must divide"):
        one_conv(groups=4)


def test_bad_groups_are_named():
    with pytest.raises(LegionNNError, match="groups 3 must divide out_channels 8"):
        one_conv(groups=3)
    with pytest.raises(LegionNNError, match="groups must be a positive int"):
        one_conv(groups=0)
    with pytest.raises(LegionNNError, match="update_channels needs groups 1"):
        one_conv(groups=2, update_channels=[0, 1])


def test_one_group_lowers_to_conv_as_before():
    plain, explicit = one_conv(), one_conv(groups=1)
    assert "groups" not in plain.to_spec()["layers"][0]
    assert "groups" not in explicit.to_spec()["layers"][0]
    graph = explicit.lower(batch=2)
    assert dumps(graph) == dumps(plain.lower(batch=2))
    task = graph.task("G.conv")
    assert task.op == "conv" and "groups" not in task.attrs
    assert task.space.shape == (2, 8, 4, 4, 6)
    assert graph.tensors["G.W"].dims == (8, 1, 1, 6, 3, 3, 1, 1)
    assert graph.tensors["G.W"].init == "he:54"
    assert Conv("c", out_channels=4).groups == 1
