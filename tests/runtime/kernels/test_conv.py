"""The conv kernels (tied filter plus bias) against the reference and numerical gradients."""

import numpy as np
import pytest

from runtime.kernels import reference
from runtime.kernels.conv import (
    conv_backward,
    conv_backward_packed,
    conv_forward,
    conv_forward_packed,
)
from runtime.kernels.layout import pack_activations, pack_weights, unpack_activations
from tests.runtime.kernels.test_filter import close, numerical_gradient, rel_error


def make(dtype, seed=0, n=2, c=3, h=7, w=6, k=4, r=3, s=2, stride=2, pad=(1, 0, 0, 1)):
    top, bottom, left, right = pad
    p = (h + top + bottom - r) // stride + 1
    q = (w + left + right - s) // stride + 1
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((k, 1, 1, c, r, s, 1, 1)).astype(dtype)
    b = rng.standard_normal((1, k, 1, 1)).astype(dtype)
    dy = rng.standard_normal((n, k, p, q)).astype(dtype)
    return x, wt, b, dy, stride, pad


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_agrees_with_reference(dtype):
    x, w, b, dy, stride, pad = make(dtype)
    close(conv_forward(x, w, b, stride, pad), reference.conv_forward(x, w, b, stride, pad), dtype)
    for got, want in zip(
        conv_backward(dy, x, w, stride, pad), reference.conv_backward(dy, x, w, stride, pad)
    ):
        close(got, want, dtype)
    dx, dw, db = conv_backward(dy, x, w, stride, pad, need_dx=False)
    assert dx is None and dw.shape == w.shape and db.shape == b.shape


def test_numerical_gradients():
    x, w, b, dy, stride, pad = make(np.float64, seed=3, n=1)

    def loss():
        return float(np.sum(conv_forward(x, w, b, stride, pad) * dy))

    dx, dw, db = conv_backward(dy, x, w, stride, pad)
    assert rel_error(dx, numerical_gradient(loss, x)) < 1e-7
    assert rel_error(dw, numerical_gradient(loss, w)) < 1e-7
    assert rel_error(db, numerical_gradient(loss, b)) < 1e-7


def test_packed_matches_logical():
    x, w, b, dy, stride, pad = make(np.float32)
    xp, wp, dyp = pack_activations(x), pack_weights(w), pack_activations(dy)
    close(
        unpack_activations(conv_forward_packed(xp, wp, b, stride, pad)),
        conv_forward(x, w, b, stride, pad),
        np.float32,
    )
    dxp, dwp, db = conv_backward_packed(dyp, xp, wp, stride, pad)
    dx, dw, db_logical = conv_backward(dy, x, w, stride, pad)
    close(unpack_activations(dxp), dx, np.float32)
    close(dwp, pack_weights(dw), np.float32)
    close(db, db_logical, np.float32)


def test_rejects_untied_weights_and_bad_bias():
    x, w, b, _, stride, pad = make(np.float64, h=3, w=2, r=3, s=2, stride=1, pad=(0, 0, 0, 0))
    untied = np.ones((4, 1, 1, 3, 2, 2, 2, 1))
    with pytest.raises(ValueError, match="must be tied"):
        conv_forward(x, untied, b, 1, 0)
    with pytest.raises(ValueError, match="must be tied"):
        conv_backward(np.ones((2, 4, 2, 1)), x, untied, 1, 0)
    with pytest.raises(ValueError, match=r"b: expected \(1, K, 1, 1\)"):
        conv_forward(x, w, b.reshape(4), stride, pad)
    with pytest.raises(ValueError, match="b: dtype float32 differs"):
        conv_forward(x, w, b.astype(np.float32), stride, pad)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("stride", [1, 2, (2, 1)])
def test_a_pointwise_conv_is_a_product_per_sample(dtype, stride):
    """A 1×1 window without padding, run as weights times each sample's channels by positions,
    equals the reference convolution (bias aside), at every stride."""
    from runtime.kernels.conv import pointwise_forward, runs_pointwise

    rows, columns = (stride, stride) if isinstance(stride, int) else stride
    rng = np.random.default_rng(rows * 10 + columns)
    x = rng.standard_normal((3, 5, 7, 6)).astype(dtype)
    w = rng.standard_normal((4, 1, 1, 5, 1, 1, 1, 1)).astype(dtype)
    zero = np.zeros((1, 4, 1, 1), dtype)
    want = reference.conv_forward(x[:, :, ::rows, ::columns], w, zero, 1, 0)
    close(pointwise_forward(x, pack_weights(w), stride), want, dtype)
    # a piece's view: input channels 1..4 of the weights' and the input's, not contiguous
    close(
        pointwise_forward(x[:, 1:4], pack_weights(w[:, :, :, 1:4]), stride),
        reference.conv_forward(x[:, 1:4, ::rows, ::columns], w[:, :, :, 1:4], zero, 1, 0),
        dtype,
    )
    assert runs_pointwise((1, 1), (0, 0, 0, 0))
    assert not runs_pointwise((1, 1), (0, 1, 0, 0))
    assert not runs_pointwise((3, 3), (0, 0, 0, 0))
    assert not runs_pointwise((1, 1), (0, 0, 0, 0), untied=True)


def test_a_pointwise_conv_refuses_a_wider_window():
    from runtime.kernels.conv import pointwise_forward

    x = np.zeros((1, 2, 4, 4), np.float32)
    with pytest.raises(ValueError, match="wp"):
        pointwise_forward(x, np.zeros((1, 3, 1, 4, 3, 2), np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("stride", [1, 2, (2, 1)])
def test_a_pointwise_convs_input_gradient_is_a_product_per_sample(dtype, stride):
    """The input's gradient of a 1×1 window without padding, the transposed weights times each
    sample's output gradient, equals the reference's, zero between the strided positions."""
    from runtime.kernels.conv import pointwise_backward_data

    rows, columns = (stride, stride) if isinstance(stride, int) else stride
    rng = np.random.default_rng(rows * 10 + columns + 1)
    x = rng.standard_normal((3, 5, 7, 6)).astype(dtype)
    w = rng.standard_normal((4, 1, 1, 5, 1, 1, 1, 1)).astype(dtype)
    dy = rng.standard_normal((3, 4, -(-7 // rows), -(-6 // columns))).astype(dtype)
    want = np.zeros(x.shape, np.float64)  # dx[n, c, h·s, w·t] = Σ_k w[k, c] dy[n, k, h, w]
    want[:, :, ::rows, ::columns] = np.einsum(
        "kc,nkpq->ncpq", w.reshape(4, 5).astype(np.float64), dy.astype(np.float64)
    )
    close(pointwise_backward_data(dy, pack_weights(w), (7, 6), stride), want.astype(dtype), dtype)
    # into a buffer given: a batch slice of a larger one (contiguous samples), and a channel
    # slice of one (samples not contiguous), each left as found around the slice
    for buffer, view in (
        (np.ones((5, 5, 7, 6), dtype), np.s_[1:4]),
        (np.ones((3, 7, 7, 6), dtype), np.s_[:, 1:6]),
    ):
        target = buffer[view]
        assert pointwise_backward_data(dy, pack_weights(w), (7, 6), stride, out=target) is target
        close(buffer[view], want.astype(dtype), dtype)
        around = np.ones(buffer.shape, bool)
        around[view] = False
        assert (buffer[around] == 1).all()
    if stride == 1:  # the reference convolution's, where it takes the stride
        close(pointwise_backward_data(dy, pack_weights(w), (7, 6)), reference.conv_backward(
            dy, x, w, 1, 0)[0], dtype)  # fmt: skip
