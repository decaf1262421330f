import numpy as np
import pytest

from runtime.kernels.dropout import dropout_backward, dropout_forward
from tests.numeric_grad import assert_grad, numeric_grad

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def _mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _reference_keep(seed, step, size, ratio):
    """The documented mask, in plain Python integers."""
    key = _mix(_mix((seed + GAMMA) & M64) ^ ((step * GAMMA) & M64))
    keep = []
    for k in range(size):
        u = (_mix((key + (k + 1) * GAMMA) & M64) >> 11) / 2.0**53
        keep.append(u >= ratio)
    return np.array(keep)


def _whole(x, ratio, seed=7, step=3):
    return dropout_forward(x, ratio, seed, step, (0,) * x.ndim, x.shape)


def test_mask_matches_the_documented_hash():
    x = np.ones((2, 3, 4, 5))
    y = _whole(x, 0.3)
    np.testing.assert_array_equal(y.ravel() != 0, _reference_keep(7, 3, x.size, 0.3))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_inverted_scaling_and_keep_rate(dtype):
    x = np.random.default_rng(0).standard_normal((8, 16, 20, 25)).astype(dtype)
    y = _whole(x, 0.25)
    assert y.dtype == dtype
    kept = y != 0
    np.testing.assert_allclose(y[kept], x[kept] / dtype(0.75), rtol=1e-6)
    # 64,000 Bernoulli(0.75) draws: the keep rate is within 5 standard deviations.
    assert abs(kept.mean() - 0.75) < 5 * np.sqrt(0.75 * 0.25 / x.size)


def test_ratio_zero_is_the_identity():
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 5))
    y = _whole(x, 0.0)
    np.testing.assert_array_equal(y, x)
    assert y is not x


def test_backward_reuses_the_forward_mask():
    x = np.random.default_rng(2).standard_normal((3, 4, 5, 6))
    dy = np.random.default_rng(3).standard_normal(x.shape)
    y = dropout_forward(x, 0.5, 11, 4, (0, 0, 0, 0), x.shape)
    dx = dropout_backward(dy, 0.5, 11, 4, (0, 0, 0, 0), x.shape)
    np.testing.assert_array_equal(dx != 0, y != 0)
    np.testing.assert_allclose(dx[y != 0], 2.0 * dy[y != 0])


def test_numerical_gradient():
    x = np.random.default_rng(4).standard_normal((2, 3, 3, 2))
    r = np.random.default_rng(5).standard_normal(x.shape)
    dx = dropout_backward(r, 0.4, 1, 2, (0, 0, 0, 0), x.shape)
    assert_grad(
        dx, numeric_grad(lambda: dropout_forward(x, 0.4, 1, 2, (0, 0, 0, 0), x.shape), x, r)
    )


def test_seed_and_step_change_the_mask():
    x = np.ones((4, 4, 8, 8))
    base = _whole(x, 0.5, seed=1, step=1) != 0
    assert not np.array_equal(base, _whole(x, 0.5, seed=2, step=1) != 0)
    assert not np.array_equal(base, _whole(x, 0.5, seed=1, step=2) != 0)
    np.testing.assert_array_equal(base, _whole(x, 0.5, seed=1, step=1) != 0)


def test_any_partition_gives_the_whole_mask():
    dims = (5, 3, 7, 6)
    x = np.random.default_rng(6).standard_normal(dims)
    whole = dropout_forward(x, 0.5, 42, 9, (0, 0, 0, 0), dims)
    # 2x2 pieces over (N, H), uneven, then over (C, W).
    for axes, cuts in (((0, 2), (2, 4)), ((1, 3), (1, 5))):
        out = np.empty_like(x)
        for lo_a, hi_a in ((0, cuts[0]), (cuts[0], dims[axes[0]])):
            for lo_b, hi_b in ((0, cuts[1]), (cuts[1], dims[axes[1]])):
                index = [slice(None)] * 4
                index[axes[0]], index[axes[1]] = slice(lo_a, hi_a), slice(lo_b, hi_b)
                origin = [0] * 4
                origin[axes[0]], origin[axes[1]] = lo_a, lo_b
                piece = x[tuple(index)]
                out[tuple(index)] = dropout_forward(piece, 0.5, 42, 9, origin, dims)
                np.testing.assert_array_equal(
                    dropout_backward(piece, 0.5, 42, 9, origin, dims), out[tuple(index)]
                )
        np.testing.assert_array_equal(out, whole)


def test_lower_rank_tensors_share_the_flat_index():
    x = np.random.default_rng(7).standard_normal((6, 10))
    y4 = dropout_forward(x.reshape(6, 10, 1, 1), 0.3, 5, 1, (0, 0, 0, 0), (6, 10, 1, 1))
    y2 = dropout_forward(x[2:5, 4:], 0.3, 5, 1, (2, 4), (6, 10))
    np.testing.assert_array_equal(y2, y4.reshape(6, 10)[2:5, 4:])


def test_bad_arguments():
    x = np.ones((2, 2, 2, 2))
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\)"):
        _whole(x, 1.0)
    with pytest.raises(ValueError, match="lies outside global_dims"):
        dropout_forward(x, 0.5, 0, 0, (0, 0, 1, 0), (2, 2, 2, 2))
    with pytest.raises(ValueError, match="must have the same rank"):
        dropout_forward(x, 0.5, 0, 0, (0, 0), (2, 2))
