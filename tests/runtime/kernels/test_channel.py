"""`channel_affine` and `channel_shuffle`: kernels against NumPy and central differences, the
shuffle's access maps against the literal reshape-transpose-reshape, adapters on pieces against
whole tensors, and a network using both split over ranks against one process.

Bounds come from the operations' rounding: the shuffle moves values, so it is exact; the affine
forward rounds a product and a sum; its reductions are float64 sums of at most M terms, whose
error is at most M·eps·Σ|terms| in any order of summation, rounded once to the dtype.
"""

from __future__ import annotations

import numpy as np
import pytest

from legion_nn.errors import LegionNNError, ShapeError
from legion_nn.layers import Conv, Linear, Softmax
from legion_nn.layers.channel import (
    ChannelAffine,
    ChannelShuffle,
    shuffle_destinations,
    shuffle_sources,
)
from legion_nn.network import Network
from legion_nn.op_records import piece_requirements
from legion_nn.rect import Rect
from legion_nn.spec import network_from_dict
from partitioner.strategy import builtin
from runtime.adapters import StepContext, run_piece
from runtime.kernels.channel import (
    channel_affine_backward,
    channel_affine_forward,
    channel_shuffle_backward,
    channel_shuffle_forward,
    gather_channels,
)
from tests.numeric_grad import numeric_grad
from tests.runtime.test_rank_executor import assert_same, config, local_run, ranks_run

ULP64 = np.finfo(np.float64).eps
#: the unit roundoff of float32: rounding to nearest moves a value by at most this, relatively
U32 = 2.0**-24


def literal_shuffle(x: np.ndarray, groups: int) -> np.ndarray:
    """ShuffleNet's definition, spelled as ONNX exports it."""
    n, c, h, w = x.shape
    return x.reshape(n, groups, c // groups, h, w).transpose(0, 2, 1, 3, 4).reshape(n, c, h, w)


def literal_unshuffle(dy: np.ndarray, groups: int) -> np.ndarray:
    """The transpose of `literal_shuffle`, undone step by step."""
    n, c, h, w = dy.shape
    return dy.reshape(n, c // groups, groups, h, w).transpose(0, 2, 1, 3, 4).reshape(n, c, h, w)


def permutation(channels: int, groups: int) -> np.ndarray:
    """The input channel of each output channel of the literal shuffle."""
    return literal_shuffle(np.arange(channels).reshape(1, channels, 1, 1), groups).ravel()


def randn(shape, seed: int, dtype=np.float64) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 2.0).astype(dtype)


# ---------------------------------------------------------------- channel_shuffle kernels


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("channels", [12, 24])
@pytest.mark.parametrize("groups", [2, 3, 4])
def test_the_shuffle_is_the_literal_reshape_transpose_reshape(groups, channels, dtype):
    x = randn((2, channels, 3, 4), 1, dtype)
    y = channel_shuffle_forward(x, groups)
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, literal_shuffle(x, groups))


@pytest.mark.parametrize("channels", [12, 24])
@pytest.mark.parametrize("groups", [2, 3, 4])
def test_the_shuffle_backward_is_the_inverse_permutation(groups, channels):
    dy = randn((2, channels, 3, 4), 2)
    dx = channel_shuffle_backward(dy, groups)
    np.testing.assert_array_equal(dx, literal_unshuffle(dy, groups))
    np.testing.assert_array_equal(channel_shuffle_forward(dx, groups), dy)
    x = randn(dy.shape, 3)
    np.testing.assert_array_equal(
        channel_shuffle_backward(channel_shuffle_forward(x, groups), groups), x
    )


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_shuffle_pieces_gather_from_blocks_that_start_anywhere(groups):
    channels = 12
    x, dy = randn((2, channels, 2, 3), 4), randn((2, channels, 2, 3), 5)
    perm = permutation(channels, groups)
    inverse = np.argsort(perm)
    whole_y, whole_dx = literal_shuffle(x, groups), literal_unshuffle(dy, groups)
    for first in range(channels):
        for last in range(first + 1, channels + 1):
            lo, hi = perm[first:last].min(), perm[first:last].max() + 1
            wanted = shuffle_sources(channels, groups, first, last)
            got = gather_channels(x[:, lo:hi], wanted, lo)
            np.testing.assert_array_equal(got, whole_y[:, first:last])
            lo, hi = inverse[first:last].min(), inverse[first:last].max() + 1
            wanted = shuffle_destinations(channels, groups, first, last)
            got = gather_channels(dy[:, lo:hi], wanted, lo)
            np.testing.assert_array_equal(got, whole_dx[:, first:last])


def test_a_shuffle_piece_missing_channels_or_bad_groups_is_named():
    x = randn((1, 12, 1, 1), 6)
    with pytest.raises(ValueError, match=r"a holds channels \[1, 12\), which lack some of"):
        gather_channels(x[:, 1:], shuffle_sources(12, 3, 0, 4), 1)
    for groups in (5, 0, 2.0, True):
        with pytest.raises(ValueError, match="groups must be a positive int dividing the 12"):
            channel_shuffle_forward(x, groups)


# ---------------------------------------------------------------- channel_affine kernels


def affine_inputs(dtype=np.float64, shape=(3, 4, 5, 6)):
    x = randn(shape, 7, dtype)
    scale = randn((1, shape[1], 1, 1), 8, dtype)
    shift = randn((1, shape[1], 1, 1), 9, dtype)
    return x, scale, shift


def test_the_affine_forward_is_numpys_formula():
    x, scale, shift = affine_inputs()
    product = np.abs(x * scale)
    want = x * scale + shift
    # a product and a sum, each rounded once (or fused into one rounding)
    bound = ULP64 * (product + np.abs(want))
    assert np.all(np.abs(channel_affine_forward(x, scale, shift) - want) <= bound)
    assert np.all(np.abs(channel_affine_forward(x, scale) - x * scale) <= ULP64 * product)
    x32, s32, b32 = (a.astype(np.float32) for a in (x, scale, shift))
    got = channel_affine_forward(x32, s32, b32)
    assert got.dtype == np.float32
    want = x32.astype(np.float64) * s32 + b32.astype(np.float64)
    product = np.abs(x32.astype(np.float64) * s32)
    # float32's two roundings; the factor 2 covers second order terms and float64's rounding
    assert np.all(np.abs(got - want) <= 2 * U32 * (product + np.abs(want)))


def reference_backward(dy, x, scale):
    dy, x = dy.astype(np.float64), x.astype(np.float64)
    return (
        dy * scale,
        (dy * x).sum(axis=(0, 2, 3), keepdims=True),
        dy.sum(axis=(0, 2, 3), keepdims=True),
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_affine_backward_is_numpys_sums(dtype):
    x, scale, _ = affine_inputs(dtype)
    dy = randn(x.shape, 10, dtype)
    dx, dscale, dshift = channel_affine_backward(dy, x, scale)
    assert dx.dtype == dscale.dtype == dshift.dtype == dtype
    assert dscale.shape == dshift.shape == (1, 4, 1, 1)
    want_dx, want_dscale, want_dshift = reference_backward(dy, x, scale.astype(np.float64))
    count = x.shape[0] * x.shape[2] * x.shape[3]
    # both sides sum the same float64 terms (products of float32 values are exact in float64)
    # in their own orders; then the kernel rounds once to the dtype
    rounding = U32 if dtype == np.float32 else ULP64
    terms = np.abs(dy.astype(np.float64) * x).sum(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_array_less(
        np.abs(dscale - want_dscale), rounding * np.abs(want_dscale) + 2 * count * ULP64 * terms
    )
    terms = np.abs(dy.astype(np.float64)).sum(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_array_less(
        np.abs(dshift - want_dshift), rounding * np.abs(want_dshift) + 2 * count * ULP64 * terms
    )
    assert np.all(np.abs(dx - want_dx) <= rounding * np.abs(want_dx))
    none, dscale2, dshift2 = channel_affine_backward(dy, x, scale, need_dx=False)
    assert none is None
    np.testing.assert_array_equal(dscale2, dscale)
    np.testing.assert_array_equal(dshift2, dshift)


def test_the_affine_backward_is_the_central_difference():
    x, scale, shift = affine_inputs()
    dy = randn(x.shape, 11)
    h = 1e-5
    dx, dscale, dshift = channel_affine_backward(dy, x, scale)
    forward = lambda: channel_affine_forward(x, scale, shift)
    numeric = [numeric_grad(forward, a, dy, h) for a in (x, scale, shift)]
    # y is linear in each of x, scale and shift: the difference has no truncation error, only
    # roundings, of the perturbed value and of y at each end (terms at most `big`), relative to
    # 2h; a parameter's difference sums those of its channel's outputs
    big = (np.abs(x).max() + h) * (np.abs(scale).max() + h) + np.abs(shift).max()
    per_output = 8 * ULP64 * big / (2 * h)
    count = x.shape[0] * x.shape[2] * x.shape[3]
    channel_dy = np.abs(dy).sum(axis=(0, 2, 3), keepdims=True)
    sums = 2 * count * ULP64 * np.abs(dy * x).sum(axis=(0, 2, 3), keepdims=True)
    bounds = (per_output * np.abs(dy), per_output * channel_dy + sums, per_output * channel_dy)
    for analytic, approx, bound in zip((dx, dscale, dshift), numeric, bounds):
        assert np.all(np.abs(analytic - approx) <= bound)
        assert bound.max() < 1e-6 * np.abs(analytic).max()  # the check has teeth


# ---------------------------------------------------------------- access maps and adapters


def piece_network(groups: int = 3, shift: bool = True) -> Network:
    return Network(
        "pieces",
        (4, 3, 5),
        3,
        [
            Conv("A", out_channels=12, kernel=1),
            ChannelAffine(shift=shift),
            ChannelShuffle("S", groups=groups),
            Linear("fc", out=3),
            Softmax(),
        ],
    )


def pieces_of(space: Rect) -> list[Rect]:
    """Every piece of a batch cut in two, columns in two and channels in [k0, k1)."""
    out = []
    channels = space.hi[1]
    for k0 in range(channels):
        for k1 in range(k0 + 1, channels + 1):
            for half in space.split([2, 1, 1, 2]):
                lo, hi = list(half.lo), list(half.hi)
                lo[1], hi[1] = k0, k1
                out.append(Rect(lo, hi))
    return out


def with_channels(piece: Rect, first: int, last: int) -> Rect:
    lo, hi = list(piece.lo), list(piece.hi)
    lo[1], hi[1] = first, last
    return Rect(lo, hi)


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_a_shuffle_piece_reads_the_bounding_box_of_its_channels(groups):
    graph = piece_network(groups).lower(batch=4)
    perm = permutation(12, groups)
    inverse = np.argsort(perm)
    forward, backward = graph.task("S.channel_shuffle"), graph.task("S.channel_shuffle.grad")
    for piece in pieces_of(forward.space):
        k0, k1 = piece.lo[1], piece.hi[1]
        reqs = {r.role: r for r in piece_requirements(forward, graph.tensors, piece)}
        taken = perm[k0:k1]
        assert reqs["input"].read_rect == with_channels(piece, taken.min(), taken.max() + 1)
        assert reqs["output"].write_rect == piece
        reqs = {r.role: r for r in piece_requirements(backward, graph.tensors, piece)}
        sent = inverse[k0:k1]
        assert reqs["output.delta"].read_rect == with_channels(piece, sent.min(), sent.max() + 1)
        assert reqs["input.delta"].write_rect == piece
    # 12 channels in 3 groups: output 0..3 take inputs 0, 4, 8, 1; inputs 0..3 went to 0, 3, 6, 9
    if groups == 3:
        whole = forward.space
        reqs = piece_requirements(forward, graph.tensors, with_channels(whole, 0, 4))
        assert reqs[0].read_rect == with_channels(whole, 0, 9)
        reqs = piece_requirements(backward, graph.tensors, with_channels(whole, 0, 4))
        assert reqs[0].read_rect == with_channels(whole, 0, 10)


def test_an_affine_piece_reads_its_channels_of_the_parameters():
    graph = piece_network().lower(batch=4)
    task = graph.task("A.channel_affine.grad")
    piece = Rect((1, 5, 0, 2), (3, 9, 3, 5))
    reqs = {r.role: r for r in piece_requirements(task, graph.tensors, piece)}
    param = Rect((0, 5, 0, 0), (1, 9, 1, 1))
    assert reqs["scale"].read_rect == param
    assert reqs["scale.delta"].write_rect == reqs["shift.delta"].write_rect == param
    assert reqs["input"].read_rect == reqs["output.delta"].read_rect == piece
    assert graph.tensors["A.scale"].init == "const:1" and graph.tensors["A.shift"].init == "zeros"
    assert graph.tensors["A.scale"].dims == graph.tensors["A.shift"].dims == (1, 12, 1, 1)
    unshifted = piece_network(shift=False).lower(batch=4)
    assert "A.shift" not in unshifted.tensors
    roles = {r.role for r in unshifted.task("A.channel_affine.grad").requirements}
    assert roles == {"output.delta", "input", "scale", "input.delta", "scale.delta"}


def run_pieces(graph, name: str, arrays: dict, pieces) -> dict:
    """Each piece run on views of `arrays` cut by its access map, its results stored by the
    requirements' privileges into zeroed copies of the arrays it writes."""
    task = graph.task(name)
    dims = task.role_dims(graph.tensors)
    out = {r.role: np.zeros(dims[r.role]) for r in task.requirements if r.privilege.writes}
    for piece in pieces:
        reqs = piece_requirements(task, graph.tensors, piece)
        views = {
            r.role: (out if r.privilege.writes else arrays)[r.role][r.rect.to_slices()]
            for r in reqs
        }
        for role, value in run_piece(task, piece, views, dims, StepContext(0)).items():
            views[role] += value  # the pieces' writes are disjoint, their reductions add
    return out


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_shuffle_adapters_on_pieces_give_the_whole_tensors(groups):
    graph = piece_network(groups).lower(batch=4)
    space = graph.task("S.channel_shuffle").space
    x, dy = randn(space.shape, 12), randn(space.shape, 13)
    for cut in ([1, 1, 1, 1], [2, 3, 1, 2], [1, 5, 2, 1], [2, 12, 1, 1]):
        pieces = space.split(cut)
        got = run_pieces(graph, "S.channel_shuffle", {"input": x}, pieces)
        np.testing.assert_array_equal(got["output"], literal_shuffle(x, groups))
        got = run_pieces(graph, "S.channel_shuffle.grad", {"output.delta": dy}, pieces)
        np.testing.assert_array_equal(got["input.delta"], literal_unshuffle(dy, groups))


def test_affine_adapters_on_pieces_give_the_whole_tensors():
    graph = piece_network().lower(batch=4)
    space = graph.task("A.channel_affine").space
    x, scale, shift = affine_inputs(shape=space.shape)
    dy = randn(space.shape, 14)
    arrays = {"input": x, "scale": scale, "shift": shift, "output.delta": dy}
    y = channel_affine_forward(x, scale, shift)
    dx, dscale, dshift = channel_affine_backward(dy, x, scale)
    terms = np.abs(dy * x).sum(axis=(0, 2, 3), keepdims=True)
    for cut in ([1, 1, 1, 1], [2, 3, 1, 2], [4, 1, 3, 1]):
        pieces = space.split(cut)
        got = run_pieces(graph, "A.channel_affine", arrays, pieces)
        # each element's own product and sum, which a fused multiply-add may round once
        assert np.all(np.abs(got["output"] - y) <= 2 * ULP64 * (np.abs(x * scale) + np.abs(y)))
        got = run_pieces(graph, "A.channel_affine.grad", arrays, pieces)
        np.testing.assert_array_equal(got["input.delta"], dx)
        # the pieces' sums add up in another order than the whole's
        count = x.shape[0] * x.shape[2] * x.shape[3]
        assert np.all(np.abs(got["scale.delta"] - dscale) <= 2 * count * ULP64 * terms)
        absolute = np.abs(dy).sum(axis=(0, 2, 3), keepdims=True)
        assert np.all(np.abs(got["shift.delta"] - dshift) <= 2 * count * ULP64 * absolute)


# ---------------------------------------------------------------- a network over ranks


def channel_network():
    return network_from_dict(
        {
            "name": "channel-net",
            "input": [4, 6, 6],
            "classes": 4,
            "layers": [
                {"kind": "conv", "name": "A", "out_channels": 12, "kernel": 3, "pad": 1},
                {"kind": "channel_affine"},
                {"kind": "relu"},
                {"kind": "channel_shuffle", "groups": 3},
                {"kind": "conv", "name": "B", "out_channels": 6, "kernel": 3, "pad": 1},
                {"kind": "relu"},
                {"kind": "linear", "name": "classifier", "out": 4},
                {"kind": "softmax"},
                {"kind": "evaluate"},
            ],
        },
        "channel-net",
    )


@pytest.mark.parametrize(("strategy", "nranks"), [("data", 2), ("model", 3), ("spatial", 2)])
def test_a_network_with_channel_layers_split_over_ranks_equals_one_process(strategy, nranks):
    cfg = config(channel_network(), batch=6)
    if strategy == "model":
        graph = cfg.network.lower(batch=6, dtype="float64")
        grids = builtin(graph, "model", nranks).task_grids(graph)
        channel_tasks = [t for t in graph.tasks if t.op in ("channel_affine", "channel_shuffle")]
        assert len(channel_tasks) == 4
        # cut over channels, a piece's shuffle reads channels that other ranks computed
        assert all(grids[t.name][1] == nranks for t in channel_tasks)
    assert_same(local_run(cfg), ranks_run(cfg, nranks, strategy))


# ---------------------------------------------------------------- bad groups


@pytest.mark.parametrize("groups", [5, 0, -3, 24, True, 1.5])
def test_bad_groups_are_one_line_naming_the_layer(groups):
    spec = {
        "name": "bad",
        "input": [12, 4, 4],
        "classes": 2,
        "layers": [
            {"kind": "channel_shuffle", "name": "S", "groups": groups},
            {"kind": "linear", "name": "fc", "out": 2},
            {"kind": "softmax"},
        ],
    }
    said = "layer S (channel_shuffle): groups must be a positive int dividing its 12 input "
    said += f"channels, got {groups!r}; divisors of 12: 1, 2, 3, 4, 6, 12"
    with pytest.raises(LegionNNError) as caught:
        network_from_dict(spec, "bad.json")
    assert str(caught.value) == f"bad.json: {said}"
    layers = [ChannelShuffle("S", groups=groups), Linear("fc", out=2), Softmax()]
    with pytest.raises(ShapeError) as caught:
        Network("bad", (12, 4, 4), 2, layers)
    assert str(caught.value) == said
