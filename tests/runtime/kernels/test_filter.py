"""The filter kernels against the NumPy references, numerical gradients and the packed API."""

import numpy as np
import pytest

from runtime.kernels import filter as filter_module
from runtime.kernels import filter_one_example, filter_packed, reference
from runtime.kernels.filter import filter_backward, filter_forward
from runtime.kernels.filter_packed import (
    backward_data_packed,
    backward_filter_packed,
    forward_packed,
)
from runtime.kernels.layout import (
    pack_activations,
    pack_weights,
    unpack_activations,
    unpack_weights,
)

# (N, C, H, W, K, R, S, stride, pad, untied)
CASES = {
    "untied-stride2-asym": (2, 3, 9, 7, 4, 3, 2, 2, (1, 0, 2, 1), True),
    "tied-batch1-pad1": (1, 2, 6, 5, 3, 3, 3, 1, 1, False),
    "untied-nopad-rect-window": (3, 5, 8, 9, 2, 4, 3, 1, 0, True),
    "tied-stride2-asym": (2, 4, 7, 10, 3, 2, 3, 2, (0, 2, 1, 0), False),
    "untied-windows-in-padding": (2, 2, 4, 5, 2, 2, 2, 3, 3, True),
    "tied-stride3-gaps": (2, 3, 10, 8, 2, 2, 2, 3, (1, 0, 0, 1), False),
    # unit axes: NumPy leaves their strides arbitrary, and BLAS takes leading dims from them
    "untied-batch1-one-channel": (1, 1, 9, 8, 3, 3, 3, 1, 0, True),
    "tied-batch1-one-channel-one-filter": (1, 1, 7, 6, 1, 3, 2, 1, 1, False),
    # one example: the positions of an output row are the forward's product rows
    # (`filter_one_example.forward`), the clipped ones each a product of its own
    "tied-batch1-stride2-asym": (1, 3, 9, 7, 4, 3, 2, 2, (1, 0, 2, 1), False),
    "tied-batch1-windows-in-padding": (1, 2, 4, 5, 2, 2, 2, 3, 3, False),
    "tied-batch1-window-wider-than-input": (1, 3, 5, 2, 4, 3, 4, 1, (1, 1, 2, 2), False),
}
TOL = {np.float32: 2e-5, np.float64: 1e-12}


def make(case, dtype, seed=0):
    n, c, h, w, k, r, s, stride, pad, untied = case
    top, bottom, left, right = (pad,) * 4 if isinstance(pad, int) else pad
    p = (h + top + bottom - r) // stride + 1
    q = (w + left + right - s) // stride + 1
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((k, 1, 1, c, r, s, p if untied else 1, q if untied else 1))
    dy = rng.standard_normal((n, k, p, q)).astype(dtype)
    return x, wt.astype(dtype), dy, stride, pad


def close(a, b, dtype):
    assert a.dtype == dtype and a.shape == b.shape
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=0, atol=TOL[dtype] * scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", CASES)
def test_agrees_with_reference(name, dtype):
    x, w, dy, stride, pad = make(CASES[name], dtype)
    close(filter_forward(x, w, stride, pad), reference.filter_forward(x, w, stride, pad), dtype)
    dx, dw = filter_backward(dy, x, w, stride, pad)
    dx_ref, dw_ref = reference.filter_backward(dy, x, w, stride, pad)
    close(dx, dx_ref, dtype)
    close(dw, dw_ref, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["untied-stride2-asym", "tied-stride2-asym"])
def test_channel_subset_skips_the_other_channels(name, dtype):
    x, w, dy, stride, pad = make(CASES[name], dtype)
    _, dw_ref = reference.filter_backward(dy, x, w, stride, pad)
    x[:, 0] = np.nan  # skipped work never reads these; masked work would spread the NaN
    x[:, 2:] = np.nan
    dx, dw = filter_backward(dy, x, w, stride, pad, channels=(1, 2), need_dx=False)
    assert dx is None
    close(dw, dw_ref[:, :, :, 1:2], dtype)


@pytest.mark.parametrize("name", ["untied-stride2-asym", "tied-stride2-asym"])
def test_packed_channel_subset_accumulates_over_batch_pieces(name):
    """The sparse path (one GEMM per window element into blocks of S·(hi−lo) columns) with
    clipped windows, reducing two batch pieces into one packed gradient."""
    x, w, dy, stride, pad = make((4, *CASES[name][1:]), np.float64)
    dw_ref = reference.filter_backward(dy, x, w, stride, pad)[1][:, :, :, 1:3]
    xp, dyp = pack_activations(x), pack_activations(dy)
    untied, window = CASES[name][-1], w.shape[4:6]
    dw = np.full_like(pack_weights(dw_ref), 0.5)
    for n in (slice(0, 3), slice(3, 4)):
        backward_filter_packed(
            dyp[..., n], xp[..., n], window, stride, pad, untied, (1, 3), dw, accumulate=True
        )
    close(unpack_weights(dw), dw_ref + 0.5, np.float64)


#: one example through tied filters of several input and output channels: along positions
ONE_EXAMPLE = [
    n for n, case in CASES.items() if case[0] == 1 and not case[-1] and min(case[1], case[4]) > 1
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ONE_EXAMPLE)
def test_one_examples_passes_run_along_positions(monkeypatch, name, dtype):
    """Tied filters on one example run their three passes as products along an output row's
    positions (`filter_one_example`), each pass once, equal to the reference: a
    channel subset of the weight gradient added over NaN-free garbage, the input gradient
    written over NaN."""
    called = []
    for kernel in ("forward", "backward_data", "backward_filter"):
        one = getattr(filter_one_example, kernel)
        monkeypatch.setattr(
            filter_one_example,
            kernel,
            lambda *a, _one=one, _name=kernel: called.append(_name) or _one(*a),
        )
    x, w, dy, stride, pad = make(CASES[name], dtype)
    y_ref = reference.filter_forward(x, w, stride, pad)
    dx_ref, dw_ref = reference.filter_backward(dy, x, w, stride, pad)
    xp, wp, dyp = pack_activations(x), pack_weights(w), pack_activations(dy)
    close(unpack_activations(forward_packed(xp, wp, stride, pad)), y_ref, dtype)
    dx = np.full_like(xp, np.nan)
    backward_data_packed(dyp, wp, x.shape[2:], stride, pad, out=dx)
    close(unpack_activations(dx), dx_ref, dtype)
    window, c = w.shape[4:6], x.shape[1]
    lo, hi = (1, c) if c > 2 else (0, c)  # a subset, where it leaves products along 2 or more
    dw = np.full_like(pack_weights(dw_ref[:, :, :, lo:hi]), 0.25)
    backward_filter_packed(dyp, xp, window, stride, pad, False, (lo, hi), dw, accumulate=True)
    close(unpack_weights(dw), dw_ref[:, :, :, lo:hi] + 0.25, dtype)
    assert called == ["forward", "backward_data", "backward_filter"]


@pytest.mark.parametrize("channels", [None, (1, 2)])
@pytest.mark.parametrize("name", CASES)
def test_weight_gradient_overwrites_garbage(name, channels):
    """Without `accumulate` the gradient is written, not added: NaN garbage in `out` (memory
    nobody zeroed) must not survive anywhere, clipped windows and one-row GEMMs included."""
    x, w, dy, stride, pad = make(CASES[name], np.float64)
    untied, c = CASES[name][-1], x.shape[1]
    lo, hi = channels or (0, c)
    if hi > c:
        pytest.skip("one input channel")
    dw_ref = reference.filter_backward(dy, x, w, stride, pad)[1][:, :, :, lo:hi]
    out = np.full_like(pack_weights(dw_ref), np.nan)
    xp, dyp = pack_activations(x), pack_activations(dy)
    dw = backward_filter_packed(dyp, xp, w.shape[4:6], stride, pad, untied, channels, out)
    assert dw is out
    close(unpack_weights(dw), dw_ref, np.float64)


def test_need_dx_false_does_no_dx_work(monkeypatch):
    x, w, dy, stride, pad = make(CASES["tied-batch1-pad1"], np.float64)
    _, dw_ref = reference.filter_backward(dy, x, w, stride, pad)

    def forbidden(*args, **kwargs):
        raise AssertionError("backward-data ran with need_dx=False")

    monkeypatch.setattr(filter_module, "backward_data_packed", forbidden)
    dx, dw = filter_backward(dy, x, w, stride, pad, need_dx=False)
    assert dx is None
    close(dw, dw_ref, np.float64)
    with pytest.raises(AssertionError, match="need_dx=False"):
        filter_backward(dy, x, w, stride, pad)


def numerical_gradient(f, a, eps=1e-4):
    grad = np.zeros_like(a)
    flat, out = a.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        plus = f()
        flat[i] = old - eps
        minus = f()
        flat[i] = old
        out[i] = (plus - minus) / (2 * eps)
    return grad


def rel_error(a, b):
    return float(np.max(np.abs(a - b) / np.maximum(1e-8, np.abs(a) + np.abs(b))))


@pytest.mark.parametrize("name", ["untied-stride2-asym", "tied-batch1-pad1", "tied-stride2-asym"])
def test_numerical_gradients(name):
    x, w, dy, stride, pad = make(CASES[name], np.float64, seed=1)

    def loss():
        return float(np.sum(filter_forward(x, w, stride, pad) * dy))

    dx, dw = filter_backward(dy, x, w, stride, pad)
    assert rel_error(dx, numerical_gradient(loss, x)) < 1e-7
    assert rel_error(dw, numerical_gradient(loss, w)) < 1e-7


@pytest.mark.parametrize("untied", [True, False])
def test_packed_batch_pieces_and_reduction(untied):
    case = CASES["untied-stride2-asym" if untied else "tied-stride2-asym"]
    x, w, dy, stride, pad = make((4, *case[1:]), np.float32)
    xp, wp, dyp = pack_activations(x), pack_weights(w), pack_activations(dy)
    y = forward_packed(xp, wp, stride, pad)
    dx = backward_data_packed(dyp, wp, x.shape[2:], stride, pad)
    dw = backward_filter_packed(dyp, xp, w.shape[4:6], stride, pad, untied)

    # batch pieces are strided views; their weight gradients reduce with +
    pieces = [slice(0, 1), slice(1, 4)]
    dw_sum = np.zeros_like(dw)
    dx_out = np.empty_like(dx)
    for n in pieces:
        close(forward_packed(xp[..., n], wp, stride, pad), y[..., n], np.float32)
        backward_data_packed(dyp[..., n], wp, x.shape[2:], stride, pad, out=dx_out[..., n])
        backward_filter_packed(
            dyp[..., n], xp[..., n], w.shape[4:6], stride, pad, untied, out=dw_sum, accumulate=True
        )
    close(dx_out, dx, np.float32)
    close(dw_sum, dw, np.float32)
    close(unpack_weights(dw), reference.filter_backward(dy, x, w, stride, pad)[1], np.float32)


@pytest.mark.parametrize("untied", [True, False])
def test_batch_pieces_of_one_example_write_into_the_whole_output(untied):
    """An example's forward written into its batch column of the whole output, whose channels
    are then as far apart as the batch is wide: the products along the batch take it (the
    products along an output row's positions need its channels unit-stride)."""
    case = CASES["untied-stride2-asym" if untied else "tied-stride2-asym"]
    x, w, _, stride, pad = make((3, *case[1:]), np.float64)
    xp, wp = pack_activations(x), pack_weights(w)
    whole = forward_packed(xp, wp, stride, pad)
    out = np.full_like(whole, np.nan)
    for n in range(3):
        forward_packed(xp[..., n : n + 1], wp, stride, pad, out=out[..., n : n + 1])
    close(out, whole, np.float64)
    close(unpack_activations(out), reference.filter_forward(x, w, stride, pad), np.float64)


def test_packed_spatial_piece_with_one_sided_padding():
    x, w, _, stride, pad = make((2, 3, 12, 6, 2, 3, 3, 1, 1, False), np.float64)
    y = reference.filter_forward(x, w, stride, pad)
    xp, wp = pack_activations(x), pack_weights(w)
    # output rows 0..5 read input rows -1..6: the top row is padding, the bottom one a halo row
    top = forward_packed(xp[:7], wp, stride, (1, 0, 1, 1))
    # output rows 5..11 read input rows 4..12: real rows above, padding below
    bottom = forward_packed(xp[4:], wp, stride, (0, 1, 1, 1))
    close(unpack_activations(top), y[:, :, :6], np.float64)
    close(unpack_activations(bottom), y[:, :, 5:], np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 2, 4, 1, 5, 2), (1, 1, 1, 1, 1, 1), (4, 5, 2, 3, 1, 6)])
def test_large_weights_convert_by_the_compiled_transposes_exactly(monkeypatch, shape, dtype):
    """Weights from `LARGE_WEIGHTS` elements take the compiled transposes: the same bits as
    NumPy's copy of the transposed view, both ways, from logical views that are not contiguous."""
    from runtime.kernels import layout

    k, c, r, s, p, q = shape
    whole = np.random.default_rng(1).standard_normal((k, 1, 1, c + 1, r, s, p, q)).astype(dtype)
    w = whole[:, :, :, 1:]  # not contiguous
    expected = np.ascontiguousarray(w.transpose(6, 4, 7, 0, 5, 3, 1, 2)[..., 0, 0])
    monkeypatch.setattr(layout, "LARGE_WEIGHTS", 0)
    wp = pack_weights(w)
    np.testing.assert_array_equal(wp, expected)
    assert wp.flags.c_contiguous and wp.dtype == dtype
    back = unpack_weights(wp)
    np.testing.assert_array_equal(back, w)
    assert back.flags.c_contiguous


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_activations_convert_by_the_compiled_transposes_exactly(monkeypatch, dtype):
    """Activations from `LARGE_ACTIVATIONS` elements take the compiled transposes: NumPy's
    transposed copy, both ways, from a view that is not contiguous (a batch piece of a larger
    array with a channel left out), the batch and the columns in several whole tiles and a
    short last one."""
    from runtime.kernels import layout

    whole = np.random.default_rng(2).standard_normal((40, 4, 5, 35)).astype(dtype)
    x = whole[1:38, 1:]
    monkeypatch.setattr(layout, "LARGE_ACTIVATIONS", 0)
    xp = pack_activations(x)
    np.testing.assert_array_equal(xp, x.transpose(2, 3, 1, 0))
    assert xp.flags.c_contiguous and xp.dtype == dtype
    back = layout.unpack_activations(xp[:, :, 1:])  # a channel piece of a packed tensor
    np.testing.assert_array_equal(back, x[:, 1:])
    assert back.flags.c_contiguous


@pytest.mark.parametrize("large", [False, True])
def test_activations_unpack_into_a_given_buffer(monkeypatch, large):
    """`unpack_activations(xp, out)` writes the (N, C, H, W) result into `out` (a step's
    buffer), by NumPy or by the compiled transpose, and refuses a buffer it does not fit."""
    from runtime.kernels import layout

    monkeypatch.setattr(layout, "LARGE_ACTIVATIONS", 0 if large else 1 << 30)
    x = np.random.default_rng(4).standard_normal((19, 3, 4, 5)).astype(np.float32)
    out = np.full(x.shape, np.nan, np.float32)
    assert layout.unpack_activations(pack_activations(x), out) is out
    np.testing.assert_array_equal(out, x)
    with pytest.raises(ValueError, match="out"):
        layout.unpack_activations(pack_activations(x), np.empty((19, 3, 5, 4), np.float32))


def test_layout_round_trips():
    x, w, _, _, _ = make(CASES["untied-stride2-asym"], np.float32)
    assert pack_activations(x).shape == (9, 7, 3, 2)
    wp = pack_weights(w)
    assert wp.shape == (4, 3, 5, 4, 2, 3)  # (P, R, Q, K, S, C)
    assert wp.flags.c_contiguous
    k, c, r, s, p, q = 3, 2, 1, 0, 3, 4
    assert wp[p, r, q, k, s, c] == w[k, 0, 0, c, r, s, p, q]
    np.testing.assert_array_equal(unpack_activations(pack_activations(x)), x)
    np.testing.assert_array_equal(unpack_weights(wp), w)


@pytest.mark.parametrize("name", ["untied-stride2-asym", "tied-stride2-asym", "tied-batch1-pad1"])
def test_output_channel_pieces_of_weights_are_operands_without_a_copy(name):
    """A piece of output channels of a packed weight (a model-parallel piece) is read through
    its strides and gives those channels' part of the result."""
    x, w, dy, stride, pad = make(CASES[name], np.float64)
    xp, wp = pack_activations(x), pack_weights(w)
    piece = wp[:, :, :, 1:3]
    assert not piece.flags.c_contiguous
    assert np.shares_memory(filter_packed._weights(piece), piece)  # no copy
    y = forward_packed(xp, piece, stride, pad)
    close(unpack_activations(y), reference.filter_forward(x, w[1:3], stride, pad), np.float64)
    dy_piece = np.ascontiguousarray(dy[:, 1:3])
    dx = backward_data_packed(pack_activations(dy_piece), piece, x.shape[2:], stride, pad)
    dx_ref = reference.filter_backward(dy_piece, x, w[1:3], stride, pad)[0]
    close(unpack_activations(dx), dx_ref, np.float64)


def test_position_pieces_of_untied_weights_are_operands_without_a_copy():
    """Output rows 1:3 and columns 1:4 of an untied filter (a spatial piece): the weights of
    those positions, a strided view, on the piece's input halo."""
    x, w, _, stride, pad = make(CASES["untied-stride2-asym"], np.float64)
    (top, _, left, _), (r, s) = pad, w.shape[4:6]
    xp, wp = pack_activations(x), pack_weights(w)
    rows, cols = slice(1, 3), slice(1, 4)
    piece = wp[rows, :, cols]
    assert not piece.flags.c_contiguous
    assert np.shares_memory(filter_packed._weights(piece), piece)  # no copy
    h0, w0 = rows.start * stride - top, cols.start * stride - left
    assert h0 >= 0 and w0 >= 0  # no padding: the piece is inside the input
    halo = xp[h0 : h0 + (rows.stop - rows.start - 1) * stride + r,
              w0 : w0 + (cols.stop - cols.start - 1) * stride + s]  # fmt: skip
    y = forward_packed(halo, piece, stride, 0)
    close(y, forward_packed(xp, wp, stride, pad)[rows, cols], np.float64)


@pytest.mark.parametrize("name", ["untied-stride2-asym", "tied-stride2-asym"])
def test_weight_gradient_accumulates_into_a_piece_of_output_channels(name):
    """`out` may be a strided view (a K-piece of a larger gradient): written in place."""
    x, w, dy, stride, pad = make(CASES[name], np.float64)
    untied, window = CASES[name][-1], w.shape[4:6]
    dy_piece = np.ascontiguousarray(dy[:, 1:3])
    dw_ref = reference.filter_backward(dy_piece, x, w[1:3], stride, pad)[1]
    grad = np.ones_like(pack_weights(w))
    piece = grad[:, :, :, 1:3]
    xp, dyp = pack_activations(x), pack_activations(dy_piece)
    backward_filter_packed(dyp, xp, window, stride, pad, untied, out=piece, accumulate=True)
    close(unpack_weights(grad)[1:3], dw_ref + 1, np.float64)
    np.testing.assert_array_equal(np.delete(grad, [1, 2], axis=3), 1)  # the other channels
    backward_filter_packed(dyp, xp, window, stride, pad, untied, out=piece)
    close(unpack_weights(grad)[1:3], dw_ref, np.float64)
    with pytest.raises(ValueError, match="is not addressable"):
        backward_filter_packed(dyp, xp, window, stride, pad, untied, out=np.asfortranarray(piece))


def test_weights_without_an_addressable_layout_are_copied():
    x, w, dy, stride, pad = make(CASES["untied-stride2-asym"], np.float64)
    xp, wp = pack_activations(x), pack_weights(w)
    odd = np.asfortranarray(wp)  # (S, C) is not one unit-stride row
    assert not np.shares_memory(filter_packed._weights(odd), odd)
    close(forward_packed(xp, odd, stride, pad), forward_packed(xp, wp, stride, pad), np.float64)
    size = x.shape[2:]
    dyp = pack_activations(dy)
    close(
        backward_data_packed(dyp, odd, size, stride, pad),
        backward_data_packed(dyp, wp, size, stride, pad),
        np.float64,
    )


def test_zero_channel_subset_is_empty():
    x, w, dy, stride, pad = make(CASES["tied-batch1-pad1"], np.float64)
    _, dw = filter_backward(dy, x, w, stride, pad, channels=(1, 1))
    assert dw.shape == (3, 1, 1, 0, 3, 3, 1, 1)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda x, w, dy: (x, w.reshape(4, 1, 1, 3, 3, 2, 20, 1), dy), "neither the output"),
        (lambda x, w, dy: (x, w.reshape(2, 2, 1, 3, 3, 2, 4, 5), dy), "unit axes"),
        (lambda x, w, dy: (x[:, :2], w, dy), "input channels"),
        (lambda x, w, dy: (x, w[..., :2, :], dy), "neither the output"),
        (lambda x, w, dy: (x.astype(np.float32), w, dy), "differs"),
        (lambda x, w, dy: (x.astype(np.int64), w, dy), "not float32 or float64"),
        (lambda x, w, dy: (x[0], w, dy), r"expected \(N, C, H, W\)"),
        (lambda x, w, dy: (x, w, dy[:, :, :2]), "dy: expected"),
    ],
)
def test_bad_input_is_a_one_line_value_error(mutate, message):
    x, w, dy, stride, pad = make(CASES["untied-stride2-asym"], np.float64)
    x, w, dy = mutate(x, w, dy)
    with pytest.raises(ValueError, match=message):
        filter_backward(dy, x, w, stride, pad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pad": (1, 1)}, "pad:"),
        ({"pad": -1}, "pad:"),
        ({"stride": 0}, "stride:"),
        ({"channels": (2, 1)}, "channels:"),
        ({"channels": (0, 4)}, "channels:"),
    ],
)
def test_bad_arguments(kwargs, message):
    x, w, dy, _, _ = make(CASES["untied-stride2-asym"], np.float64)
    args = {"stride": 2, "pad": (1, 0, 2, 1)} | kwargs
    with pytest.raises(ValueError, match=message):
        filter_backward(dy, x, w, **args)


# batches and channel counts that reach the micro-kernel's whole vectors, several vectors per
# tile and leftover rows, not only its masked tail (the CASES above are narrower than a vector)
WIDE_CASES = {
    "untied-wide-batch": (37, 5, 7, 6, 13, 3, 2, 1, (1, 0, 0, 1), True),
    "tied-wide-channels": (20, 24, 6, 6, 7, 2, 3, 2, 1, False),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", WIDE_CASES)
def test_wide_shapes_agree_with_reference_over_garbage(name, dtype):
    """Every output element is written: NaN in the preallocated outputs must not survive."""
    x, w, dy, stride, pad = make(WIDE_CASES[name], dtype, seed=5)
    untied = WIDE_CASES[name][-1]
    xp, wp, dyp = pack_activations(x), pack_weights(w), pack_activations(dy)
    dx_ref, dw_ref = reference.filter_backward(dy, x, w, stride, pad)
    y = np.full_like(dyp, np.nan)
    forward_packed(xp, wp, stride, pad, out=y)
    close(unpack_activations(y), reference.filter_forward(x, w, stride, pad), dtype)
    dx = np.full_like(xp, np.nan)
    backward_data_packed(dyp, wp, x.shape[2:], stride, pad, out=dx)
    close(unpack_activations(dx), dx_ref, dtype)
    window = w.shape[4:6]
    for channels in (None, (3, 5)):
        lo, hi = channels or (0, x.shape[1])
        dw = np.full_like(pack_weights(dw_ref[:, :, :, lo:hi]), np.nan)
        backward_filter_packed(dyp, xp, window, stride, pad, untied, channels, out=dw)
        close(unpack_weights(dw), dw_ref[:, :, :, lo:hi], dtype)


@pytest.mark.parametrize("large", [False, True])
def test_layout_conversions_return_arrays_placed_on_cache_lines(monkeypatch, large):
    """The kernels read rows of these as vectors: NumPy starts a large array 16 bytes into a
    cache line, which splits every access (backward-filter ran 5-10% slower on them)."""
    from runtime.kernels import layout

    if large:
        monkeypatch.setattr(layout, "LARGE_ACTIVATIONS", 1)
        monkeypatch.setattr(layout, "LARGE_WEIGHTS", 1)
    x = np.random.default_rng(0).standard_normal((3, 2, 5, 4))
    w = np.random.default_rng(1).standard_normal((2, 1, 1, 3, 2, 2, 4, 3))
    for converted, expected in (
        (pack_activations(x), x.transpose(2, 3, 1, 0)),
        (unpack_activations(pack_activations(x)), x),
        (pack_weights(w), w.transpose(6, 4, 7, 0, 5, 3, 1, 2)[..., 0, 0]),
        (unpack_weights(pack_weights(w)), w),
    ):
        assert converted.ctypes.data % 64 == 0 and converted.flags.c_contiguous
        np.testing.assert_array_equal(converted, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weight_gradients_of_calls_sharing_the_kept_input_copy_are_exact(dtype):
    """Backward-filter reads its input through a copy the thread keeps from call to call
    (`runtime.aligned.scratch_empty`): a call after a larger one, and after it a call at the
    first shape again, each equal the reference, whatever the earlier call left in the copy."""
    cases = [CASES["untied-nopad-rect-window"], CASES["tied-stride2-asym"]]
    cases.append(CASES["untied-nopad-rect-window"])
    for seed, case in enumerate(cases):
        x, w, dy, stride, pad = make(case, dtype, seed)
        _, dw_ref = reference.filter_backward(dy, x, w, stride, pad)
        untied = case[-1]
        dw = backward_filter_packed(
            pack_activations(dy), pack_activations(x), w.shape[4:6], stride, pad, untied
        )
        close(unpack_weights(dw), dw_ref, dtype)
