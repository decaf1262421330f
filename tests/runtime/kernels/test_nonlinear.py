import numpy as np
import pytest

from runtime.kernels.nonlinear import filterNL_backward, filterNL_forward
from tests.numeric_grad import assert_grad, numeric_grad

REFERENCE = {
    "relu": (lambda x: np.maximum(x, 0.0), lambda x: (x > 0).astype(np.float64)),
    "tanh": (np.tanh, lambda x: 1.0 / np.cosh(x) ** 2),
    "sigmoid": (
        lambda x: 1.0 / (1.0 + np.exp(-x)),
        lambda x: np.exp(-x) / (1.0 + np.exp(-x)) ** 2,
    ),
}


def _away_from_zero(shape, seed=0):
    # The relu kink sits at 0; keep inputs clear of it so centred differences are exact.
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    return np.where(np.abs(x) < 0.05, 0.5, x) * 2.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fn", sorted(REFERENCE))
@pytest.mark.parametrize("shape", [(1, 3, 4, 5), (4, 1, 2, 1), (3, 7, 40, 41)])
def test_matches_numpy(fn, shape, dtype):
    x = _away_from_zero(shape)
    y = filterNL_forward(x.astype(dtype), fn)
    assert y.dtype == dtype
    forward, derivative = REFERENCE[fn]
    np.testing.assert_allclose(y, forward(x), rtol=1e-6, atol=1e-7)
    dy = np.random.default_rng(1).standard_normal(shape)
    dx = filterNL_backward(dy.astype(dtype), y, fn)
    assert dx.dtype == dtype
    np.testing.assert_allclose(dx, dy * derivative(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", sorted(REFERENCE))
def test_numerical_gradient(fn):
    x = _away_from_zero((2, 3, 3, 2), seed=4)
    r = np.random.default_rng(5).standard_normal(x.shape)
    dx = filterNL_backward(r, filterNL_forward(x, fn), fn)
    assert_grad(dx, numeric_grad(lambda: filterNL_forward(x, fn), x, r))


def test_sigmoid_saturates_without_overflow():
    x = np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0], np.float32).reshape(1, 5, 1, 1)
    with np.errstate(all="raise"):
        y = filterNL_forward(x, "sigmoid")
    np.testing.assert_allclose(y.ravel(), [0.0, 0.0, 0.5, 1.0, 1.0], atol=1e-20)


def test_relu_backward_uses_the_output():
    y = np.array([0.0, 0.0, 2.0], np.float64).reshape(1, 3, 1, 1)
    dx = filterNL_backward(np.ones_like(y), y, "relu")
    np.testing.assert_array_equal(dx.ravel(), [0.0, 0.0, 1.0])


def test_bad_arguments():
    x = np.zeros((1, 2, 2, 2))
    with pytest.raises(ValueError, match="fn must be one of"):
        filterNL_forward(x, "gelu")
    with pytest.raises(ValueError, match="x must be 1-d to 4-d"):
        filterNL_forward(x[None], "relu")
    with pytest.raises(ValueError, match="y must have shape"):
        filterNL_backward(x, x[:, :1], "tanh")


@pytest.mark.parametrize("fn", sorted(REFERENCE))
def test_a_strided_view_matches_numpy(fn):
    """A piece's view need not be contiguous (every other channel of a tensor here): the
    kernels read it as it is laid out."""
    whole = _away_from_zero((2, 6, 5, 3), seed=7)
    x = whole[:, ::2]
    y = filterNL_forward(x, fn)
    forward, derivative = REFERENCE[fn]
    np.testing.assert_allclose(y, forward(x), rtol=1e-12)
    dy = np.random.default_rng(8).standard_normal((2, 12, 5, 3))[:, ::4]
    np.testing.assert_allclose(filterNL_backward(dy, y, fn), dy * derivative(x),
                               rtol=1e-10, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("fn", sorted(REFERENCE))
def test_written_into_a_given_buffer(fn):
    """With `out` (a step's buffer), both directions write their result there, equal to the
    result they return otherwise, and refuse a buffer of another shape or a strided one."""
    x = _away_from_zero((2, 3, 5, 4)).astype(np.float32)
    dy = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)
    y = np.full(x.shape, np.nan, np.float32)
    assert np.shares_memory(filterNL_forward(x, fn, out=y), y)
    np.testing.assert_array_equal(y, filterNL_forward(x, fn))
    dx = np.full(x.shape, np.nan, np.float32)
    filterNL_backward(dy, y, fn, out=dx)
    np.testing.assert_array_equal(dx, filterNL_backward(dy, y, fn))
    with pytest.raises(ValueError, match="out"):
        filterNL_forward(x, fn, out=np.empty(x.size, np.float32))
    with pytest.raises(ValueError, match="out"):
        filterNL_backward(dy, y, fn, out=np.empty(x.shape[::-1], np.float32).T)
