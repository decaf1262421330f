"""The `lrn` layer: its kernels against NumPy, ONNX's reference and central differences, its
channel halos, and a network using it split over ranks against one process.

The kernels compute each denominator and sum in float64, so in float64 they agree with the NumPy
formula to the rounding of a few sums and a power, and in float32 to the rounding of the stored
result. A piece cut through the channels adds the same terms in the same order as the whole
tensor, so its values are the whole tensor's, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from legion_nn.errors import LegionNNError
from legion_nn.layers import Conv, Linear, Softmax
from legion_nn.layers.lrn import LRN, window
from legion_nn.network import Network
from legion_nn.op_records import box_map, piece_requirements, splittable_dims
from legion_nn.rect import Rect
from legion_nn.spec import network_from_dict
from legion_nn.verify import verify
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from runtime.kernels.lrn import lrn_backward, lrn_backward_piece, lrn_forward, lrn_forward_piece
from tests.numeric_grad import numeric_grad
from tests.runtime.test_rank_executor import assert_same, config, local_run, ranks_run

ULP64 = np.finfo(np.float64).eps


def window_sum(a: np.ndarray, down: int, up: int) -> np.ndarray:
    """out[:, c] = Σ a[:, i] over i in [c − down, c + up] ∩ [0, C), added in channel order."""
    channels = a.shape[1]
    out = np.zeros_like(a)
    for c in range(channels):
        for i in range(max(0, c - down), min(channels, c + up + 1)):
            out[:, c] += a[:, i]
    return out


def denominators(x, size, alpha, bias):
    below, above = window(size)
    return bias + alpha / size * window_sum(x * x, below, above)


def reference(x, size, alpha=1e-4, beta=0.75, bias=1.0):
    """ONNX's formula, plainly."""
    return x / denominators(x, size, alpha, bias) ** beta


def forward_bound(size, beta):
    """Relative rounding of `reference` or the kernel in float64: the squares' sum, the scale and
    bias, the power (which scales the denominator's error by beta) and the divide."""
    return (abs(beta) * (size + 3) + 4) * ULP64


def inputs(shape, seed=7, dtype=np.float64):
    # magnitudes from 0 to ~10, so that the squares' term spans negligible to dominant
    return (np.random.default_rng(seed).standard_normal(shape) * 3.0).astype(dtype)


#: (size, channels, alpha, beta, bias): odd and even sizes, windows wider than the channels
CASES = [
    (1, 4, 1e-4, 0.75, 1.0),
    (2, 3, 0.5, 0.5, 2.0),
    (3, 5, 2.0, 1.5, 0.5),
    (4, 6, 1.0, 0.75, 1.0),
    (5, 2, 0.3, 0.75, 1.0),
    (5, 7, 1e-4, 0.75, 2.0),
    (9, 4, 0.9, 2.0, 0.25),
]


@pytest.mark.parametrize(("size", "channels", "alpha", "beta", "bias"), CASES)
def test_the_forward_is_numpys_formula(size, channels, alpha, beta, bias):
    x = inputs((3, channels, 4, 5))
    got, want = lrn_forward(x, size, alpha, beta, bias), reference(x, size, alpha, beta, bias)
    # both round the same formula, in different orders
    np.testing.assert_allclose(got, want, rtol=2 * forward_bound(size, beta), atol=0)
    x32 = x.astype(np.float32)
    got32 = lrn_forward(x32, size, alpha, beta, bias)
    assert got32.dtype == np.float32
    # the float64 value of the float32 input, rounded once to float32
    want32 = reference(x32.astype(np.float64), size, alpha, beta, bias)
    np.testing.assert_allclose(got32, want32, rtol=2.0**-24 + 2 * forward_bound(size, beta))


def onnx_lrn(x, size, alpha, beta, bias):
    node = helper.make_node("LRN", ["x"], ["y"], size=size, alpha=alpha, beta=beta, bias=bias)
    value = [helper.make_tensor_value_info(n, TensorProto.DOUBLE, list(x.shape)) for n in "xy"]
    graph = helper.make_graph([node], "lrn", value[:1], value[1:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return ReferenceEvaluator(model).run(None, {"x": x})[0]


@pytest.mark.parametrize(("size", "channels", "alpha", "beta", "bias"), CASES)
def test_the_forward_is_onnxs_reference(size, channels, alpha, beta, bias):
    # onnx 1.x's reference LRN loops its channels over range(N), not range(C): with N = C it
    # computes every channel, and only then
    x = inputs((channels, channels, 3, 4), seed=11)
    want = onnx_lrn(x, size, alpha, beta, bias)
    # ONNX stores float attributes as float32: the kernel gets the values the model holds
    alpha, beta, bias = (float(np.float32(v)) for v in (alpha, beta, bias))
    got = lrn_forward(x, size, alpha, beta, bias)
    # the reference divides the float32 alpha by size in float32, a relative change of at most
    # 2^-24 in the squares' term, hence of beta·2^-24 in y; then each side's float64 rounding
    rtol = abs(beta) * 2.0**-24 * (1 + 1e-6) + 2 * forward_bound(size, beta)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=0)


def third_derivative_bound(x, dy, size, alpha, beta, bias):
    """A bound on |∂³(Σ dy·y)/∂x³| along each element, for beta ≥ 0.

    With a = alpha/size and B the rest of a denominator, the moved element enters as
    s = B + a·u², B ≥ bias. In v = u·√(a/B), ψ(v) = (1 + v²)^−β, each output is B^−β times
    x′·ψ(v) (another channel's) or u·ψ(v) (its own), and
    |ψ'''| ≤ 12β(β+1)|v|w^−β−2 + 8β(β+1)(β+2)|v|³w^−β−3 ≤ β(β+1)(β + 8) (w = 1 + v²),
    |(vψ)'''| = |3ψ'' + vψ'''| ≤ 6β + 24β(β+1) + 8β(β+1)(β+2);
    the chain rule brings (a/B)^(3/2), and √(B/a) for the own channel's u.
    """
    a = alpha / size
    k_other = beta * (beta + 1) * (beta + 8)
    k_own = 6 * beta + 24 * beta * (beta + 1) + 8 * beta * (beta + 1) * (beta + 2)
    below, above = window(size)
    others = window_sum(np.abs(dy * x), above, below) - np.abs(dy * x)
    return bias**-beta * ((a / bias) * k_own * np.abs(dy) + (a / bias) ** 1.5 * k_other * others)


@pytest.mark.parametrize(("size", "channels", "alpha", "beta", "bias"), CASES)
def test_the_backward_is_the_central_difference(size, channels, alpha, beta, bias):
    x = inputs((2, channels, 2, 3), seed=3)
    dy = np.random.default_rng(4).standard_normal(x.shape)
    h = 1e-5
    numeric = numeric_grad(lambda: reference(x, size, alpha, beta, bias), x, dy, h)
    got = lrn_backward(dy, x, size, alpha, beta, bias)
    below, above = window(size)
    # the outputs an element moves: those whose windows hold it
    moved = window_sum(np.abs(dy * reference(x, size, alpha, beta, bias)), above, below)
    truncation = h * h / 6 * third_derivative_bound(x, dy, size, alpha, beta, bias)
    # each output differenced is rounded (`forward_bound`) at both points; the steps x ± h
    # are rounded too, a relative error of eps·(|x| + h)/h in the difference's width
    rounding = (
        2 * forward_bound(size, beta) * moved + 2 * ULP64 * (np.abs(x) + h) * np.abs(got)
    ) / h
    # the kernel's own rounding: of the terms it adds, of their size
    s = denominators(x, size, alpha, bias)
    terms = np.abs(dy) * s**-beta + 2 * alpha * beta / size * np.abs(x) * window_sum(
        np.abs(dy * x) * s ** (-beta - 1), above, below
    )
    kernel = (size + 8) * (abs(beta) + 2) * ULP64 * terms
    assert np.all(np.abs(got - numeric) <= truncation + rounding + kernel)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_piece_cut_through_the_channels_is_the_whole_tensors_part(size, dtype):
    channels = 7
    x = inputs((2, channels, 3, 2), dtype=dtype)
    dy = inputs((2, channels, 3, 2), seed=9, dtype=dtype)
    y, dx = lrn_forward(x, size, 0.8), lrn_backward(dy, x, size, 0.8)
    assert y.dtype == dx.dtype == dtype
    below, above = window(size)
    for first, last in [(0, 1), (0, 3), (2, 5), (3, 4), (5, 7), (6, 7), (0, 7)]:
        lo, hi = max(0, first - below), min(channels, last + above)
        got = lrn_forward_piece(x[:, lo:hi], lo, first, last, channels, size, 0.8)
        np.testing.assert_array_equal(got, y[:, first:last])
        d_lo, d_hi = max(0, first - above), min(channels, last + below)
        x_lo, x_hi = max(0, first - size + 1), min(channels, last + size - 1)
        got = lrn_backward_piece(
            dy[:, d_lo:d_hi], d_lo, x[:, x_lo:x_hi], x_lo, first, last, channels, size, 0.8
        )
        np.testing.assert_array_equal(got, dx[:, first:last])


def test_a_view_short_of_the_halo_is_named():
    x = inputs((1, 6, 2, 2))
    with pytest.raises(ValueError, match=r"x holds channels \[2, 5\) but channels \[1, 5\)"):
        lrn_forward_piece(x[:, 2:5], 2, 2, 4, 6, 3)
    with pytest.raises(ValueError, match=r"dy holds channels \[2, 4\) but channels \[1, 5\)"):
        lrn_backward_piece(x[:, 2:4], 2, x, 0, 2, 4, 6, 3)
    with pytest.raises(ValueError, match="size must be a positive int, got 0"):
        lrn_forward(x, 0)
    with pytest.raises(ValueError, match="bias must be positive"):
        lrn_backward(x, x, 3, bias=-1.0)


def lrn_graph(size, channels=8, batch=2):
    # a layer before it, so that its input has a gradient
    layers = [Conv("c", out_channels=channels, kernel=1), LRN("n", size=size)]
    net = Network("lrn", (2, 3, 3), 4, [*layers, Linear("fc", out=4), Softmax()])
    graph = net.lower(batch=batch)
    verify(graph)
    return graph


def rects(graph, task_name, piece):
    task = graph.task(task_name)
    return {r.role: r for r in piece_requirements(task, graph.tensors, piece)}


def channel_range(rect: Rect) -> tuple[int, int]:
    assert rect.lo[0::2] == (0, 0) and rect.hi[0::2] == (2, 3), rect  # batch and rows whole
    return rect.lo[1], rect.hi[1]


@pytest.mark.parametrize(
    ("size", "forward", "delta", "inputs_read"),
    [
        # 8 channels cut 3, 3, 2; below, above = 2, 2
        (5, [(0, 5), (1, 8), (4, 8)], [(0, 5), (1, 8), (4, 8)], [(0, 7), (0, 8), (2, 8)]),
        # an even window reaches one further up: below, above = 1, 2
        (4, [(0, 5), (2, 8), (5, 8)], [(0, 4), (1, 7), (4, 8)], [(0, 6), (0, 8), (3, 8)]),
        # a window of one channel needs no halo
        (1, [(0, 3), (3, 6), (6, 8)], [(0, 3), (3, 6), (6, 8)], [(0, 3), (3, 6), (6, 8)]),
    ],
)
def test_a_channel_split_reads_its_windows_halo(size, forward, delta, inputs_read):
    graph = lrn_graph(size)
    assert splittable_dims(graph.task("n.lrn")) == (0, 1, 2, 3)
    pieces = graph.task("n.lrn").space.split([1, 3, 1, 1])
    assert [channel_range(p) for p in pieces] == [(0, 3), (3, 6), (6, 8)]
    for piece, reads, dy_reads, x_reads in zip(pieces, forward, delta, inputs_read):
        fwd = rects(graph, "n.lrn", piece)
        assert channel_range(fwd["input"].read_rect) == reads
        assert fwd["output"].write_rect == piece
        grad = rects(graph, "n.lrn.grad", piece)
        assert channel_range(grad["output.delta"].read_rect) == dy_reads
        assert channel_range(grad["input"].read_rect) == x_reads
        assert grad["input.delta"].write_rect == piece and grad["input.delta"].read_rect is None
        assert grad["input.delta"].privilege.name == "REDUCE"


def test_batch_and_position_cuts_need_no_halo():
    graph = lrn_graph(5)
    for piece in graph.task("n.lrn").space.split([2, 1, 3, 2]):
        fwd, grad = rects(graph, "n.lrn", piece), rects(graph, "n.lrn.grad", piece)
        assert fwd["input"].read_rect == fwd["output"].write_rect == piece
        assert grad["output.delta"].read_rect == grad["input"].read_rect == piece
        assert grad["input.delta"].write_rect == piece


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_the_box_map_is_the_access_map(size):
    graph = lrn_graph(size, channels=9, batch=3)
    for name in ("n.lrn", "n.lrn.grad"):
        task = graph.task(name)
        dims = task.role_dims(graph.tensors)
        pieces = [p for grid in ([1, 4, 1, 1], [3, 2, 2, 3]) for p in task.space.split(grid)]
        lo = np.array([p.lo for p in pieces], np.int64)
        hi = np.array([p.hi for p in pieces], np.int64)
        boxes = box_map(task.op, task.phase)(task.attrs, dims, lo, hi)
        for i, piece in enumerate(pieces):
            found = {r.role: r.rect for r in piece_requirements(task, graph.tensors, piece)}
            for role, (b_lo, b_hi) in boxes.items():
                assert found[role] == Rect(b_lo[i], b_hi[i]), (name, role, piece)


def lrn_network(first=4, second=3):
    return network_from_dict(
        {
            "name": "lrn-net",
            "input": [6, 6, 6],
            "classes": 4,
            "layers": [
                {"kind": "conv", "name": "c0", "out_channels": 8, "kernel": 3, "pad": 1},
                {"kind": "lrn", "size": first, "alpha": 0.5, "beta": 0.75, "bias": 1.0},
                {"kind": "relu"},
                {"kind": "conv", "name": "c1", "out_channels": 5, "kernel": 3},
                {"kind": "lrn", "name": "n1", "size": second, "alpha": 2.0, "bias": 2.0},
                {"kind": "linear", "name": "classifier", "out": 4},
                {"kind": "softmax"},
                {"kind": "evaluate"},
            ],
        },
        "lrn-net",
    )


def test_the_model_split_cuts_the_channels_and_moves_halos():
    graph = lrn_network().lower(batch=5, dtype="float64")
    plan = build_plan(graph, builtin(graph, "model", 3), 3)
    for name in ("c0.lrn", "n1.lrn", "c0.lrn.grad", "n1.lrn.grad"):
        task_plan = next(tp for tp in plan.tasks if tp.task == name)
        cuts = [(p.rect.lo[1], p.rect.hi[1]) for p in task_plan.pieces]
        assert len(cuts) == 3 and len(set(cuts)) == 3, (name, cuts)
        reads = graph.task(name).requirement("input").tensor
        halos = [t for t in task_plan.transfers if t.tensor == reads and not t.reduce]
        assert halos, f"{name} receives no channel halo of {reads}"


@pytest.mark.parametrize(("strategy", "nranks"), [("data", 2), ("model", 3), ("spatial", 2)])
def test_a_network_with_lrn_split_over_ranks_equals_one_process(strategy, nranks):
    cfg = config(lrn_network(), batch=5)
    assert_same(local_run(cfg), ranks_run(cfg, nranks, strategy))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "lrn needs size"),
        ({"size": 0}, "lrn size must be a positive int, got 0"),
        ({"size": 2.5}, "lrn size must be a positive int, got 2.5"),
        ({"size": True}, "lrn size must be a positive int, got True"),
        ({"size": 3, "bias": -1.0}, "lrn bias must be positive, got -1.0"),
        ({"size": 3, "bias": 0}, "lrn bias must be positive, got 0.0"),
        ({"size": 3, "alpha": -0.1}, "lrn alpha must not be negative, got -0.1"),
        ({"size": 3, "beta": "x"}, "lrn beta must be a finite number, got 'x'"),
        ({"size": 3, "beta": float("nan")}, "lrn beta must be a finite number, got nan"),
    ],
)
def test_a_bad_attribute_is_named(options, message):
    spec = {
        "name": "bad",
        "input": [4, 3, 3],
        "classes": 2,
        "layers": [{"kind": "lrn", "name": "norm1", **options}],
    }
    with pytest.raises(LegionNNError, match=message) as caught:
        network_from_dict(spec, "bad.json")
    text = str(caught.value)
    assert "\n" not in text and "bad.json: layers[0] (norm1)" in text


def test_the_spec_round_trips():
    layer = LRN("n", size=5, alpha=2e-5)
    assert layer.to_spec() == {
        "kind": "lrn",
        "name": "n",
        "size": 5,
        "alpha": 2e-5,
        "beta": 0.75,
        "bias": 1.0,
    }
    assert (
        network_from_dict(
            {"name": "r", "input": [4, 3, 3], "classes": 2, "layers": [layer.to_spec()]}, "r.json"
        ).layers[0]
        == layer
    )
