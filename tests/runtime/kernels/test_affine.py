import numpy as np
import pytest

from runtime.kernels.affine import filterA_backward, filterA_forward
from tests.error_bounds import assert_close_to
from tests.numeric_grad import assert_grad, numeric_grad

SHAPES = [(1, 3, 4, 5), (3, 2, 1, 7), (2, 5, 3, 3)]


def _inputs(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    a = np.array([rng.uniform(0.5, 2.0)], dtype)
    b = rng.standard_normal((1, *shape[1:])).astype(dtype)
    return x, a, b


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_numpy(shape, dtype):
    x, a, b = _inputs(shape, dtype)
    y = filterA_forward(x, a, b)
    assert y.dtype == dtype and y.shape == shape
    np.testing.assert_allclose(y, a[0] * x + b, rtol=1e-6, atol=1e-6)

    dy = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    dx, da, db = filterA_backward(dy, x, a)
    assert dx.dtype == da.dtype == db.dtype == dtype
    assert da.shape == (1,) and db.shape == (1, *shape[1:])
    np.testing.assert_allclose(dx, a[0] * dy, rtol=1e-6)
    ref_da = np.sum(dy.astype(np.float64) * x)
    np.testing.assert_allclose(da, [ref_da], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, dy.sum(axis=0, keepdims=True), rtol=1e-5, atol=1e-5)


def test_need_dx_false_skips_dx():
    x, a, _ = _inputs((2, 3, 2, 2), np.float64)
    dx, da, db = filterA_backward(np.ones_like(x), x, a, need_dx=False)
    assert dx is None
    np.testing.assert_allclose(da, [x.sum()])
    np.testing.assert_allclose(db, np.full((1, 3, 2, 2), 2.0))


def test_numerical_gradients():
    x, a, b = _inputs((2, 3, 2, 3), np.float64)
    r = np.random.default_rng(2).standard_normal(x.shape)
    dx, da, db = filterA_backward(r, x, a)

    def f():
        return filterA_forward(x, a, b)

    assert_grad(dx, numeric_grad(f, x, r))
    assert_grad(da, numeric_grad(f, a, r))
    assert_grad(db, numeric_grad(f, b, r))


def test_batch_pieces_add_up():
    x, a, _ = _inputs((5, 3, 2, 4), np.float64)
    dy = np.random.default_rng(3).standard_normal(x.shape)
    _, da, db = filterA_backward(dy, x, a)
    parts = [filterA_backward(dy[s], x[s], a) for s in (slice(0, 2), slice(2, 5))]
    # the same sums over |terms| bound their rounding: da = Σ dy·x, db = Σ_n dy
    _, da_size, db_size = filterA_backward(np.abs(dy), np.abs(x), a)
    assert_close_to(parts[0][1] + parts[1][1], da, da_size, x.size + 1)
    assert_close_to(parts[0][2] + parts[1][2], db, db_size, x.shape[0])
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), a[0] * dy)


def test_strided_piece():
    x, a, b = _inputs((2, 6, 3, 4), np.float64)
    piece = x[:, 1:5, :, ::2]
    y = filterA_forward(piece, a, np.ascontiguousarray(b[:, 1:5, :, ::2]))
    np.testing.assert_allclose(y, a[0] * piece + b[:, 1:5, :, ::2])


def test_bad_arguments():
    x, a, b = _inputs((2, 3, 2, 2), np.float64)
    with pytest.raises(ValueError, match=r"b must have shape \(1, 3, 2, 2\)"):
        filterA_forward(x, a, b[:, :2])
    with pytest.raises(ValueError, match="a must have shape"):
        filterA_forward(x, np.ones((2,)), b)
    with pytest.raises(ValueError, match="x must be float32 or float64"):
        filterA_forward(x.astype(np.int32), a, b)
    with pytest.raises(ValueError, match="x must have shape"):
        filterA_backward(x, x[:1], a)


def test_written_into_a_given_buffer():
    """With `out` (a step's buffer), the forward's y and the backward's dx are written there,
    equal to what the calls return otherwise; a buffer of another shape is refused."""
    x, a, b = _inputs((2, 3, 4, 5), np.float32)
    dy = np.random.default_rng(3).standard_normal(x.shape).astype(np.float32)
    y = np.full(x.shape, np.nan, np.float32)
    assert np.shares_memory(filterA_forward(x, a, b, out=y), y)
    np.testing.assert_array_equal(y, filterA_forward(x, a, b))
    dx = np.full(x.shape, np.nan, np.float32)
    got, da, db = filterA_backward(dy, x, a, out=dx)
    assert np.shares_memory(got, dx)
    want, want_da, want_db = filterA_backward(dy, x, a)
    np.testing.assert_array_equal(dx, want)
    np.testing.assert_array_equal(da, want_da)
    np.testing.assert_array_equal(db, want_db)
    with pytest.raises(ValueError, match="out"):
        filterA_forward(x, a, b, out=np.empty((2, 3, 5, 4), np.float32))
