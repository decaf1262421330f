import numpy as np
import pytest

from runtime.kernels.pool import (
    avgpool_backward,
    avgpool_forward,
    maxpool_backward,
    maxpool_forward,
)
from tests.numeric_grad import assert_grad, numeric_grad


def _reference(x, dy, kernel, stride, pads):
    """Loops over a -inf padded copy: the forward and the first-argmax routing of dy."""
    (kh, kw), (sh, sw), (t, b, l, r) = kernel, stride, pads
    n, c, h, w = x.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (t, b), (l, r)), constant_values=-np.inf)
    ho, wo = (h + t + b - kh) // sh + 1, (w + l + r - kw) // sw + 1
    y = np.empty((n, c, ho, wo))
    dxp = np.zeros(xp.shape)
    for i, j, p, q in np.ndindex(n, c, ho, wo):
        win = xp[i, j, p * sh : p * sh + kh, q * sw : q * sw + kw]
        y[i, j, p, q] = win.max()
        a, e = np.unravel_index(np.argmax(win), win.shape)
        if dy is not None:
            dxp[i, j, p * sh + a, q * sw + e] += dy[i, j, p, q]
    return y, dxp[:, :, t : t + h, l : l + w]


def _distinct(shape, seed=0):
    # Distinct values 0.1 apart: no ties, and no argmax moves under a 1e-5 perturbation.
    rng = np.random.default_rng(seed)
    return rng.permutation(np.prod(shape)).reshape(shape) * 0.1 - 1.0


CASES = [
    # (x shape, kernel, stride, pad as passed, pad as (t, b, l, r))
    ((2, 3, 6, 8), 2, 2, 0, (0, 0, 0, 0)),
    ((1, 2, 7, 5), (3, 2), (2, 1), 0, (0, 0, 0, 0)),
    ((3, 1, 5, 6), 3, 1, 1, (1, 1, 1, 1)),
    ((1, 2, 6, 7), (3, 3), (2, 2), (1, 0, 2, 0), (1, 0, 2, 0)),
    ((2, 2, 9, 4), (2, 3), (3, 2), (0, 1, 0, 2), (0, 1, 0, 2)),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("shape", "kernel", "stride", "pad", "pads"), CASES)
def test_matches_reference(shape, kernel, stride, pad, pads, dtype):
    kernel2 = (kernel, kernel) if np.isscalar(kernel) else kernel
    stride2 = (stride, stride) if np.isscalar(stride) else stride
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    y = maxpool_forward(x, kernel, stride, pad)
    dy = np.random.default_rng(1).standard_normal(y.shape).astype(dtype)
    ref_y, ref_dx = _reference(x, dy, kernel2, stride2, pads)
    assert y.dtype == dtype and y.shape == ref_y.shape
    np.testing.assert_array_equal(y, ref_y.astype(dtype))
    dx = maxpool_backward(dy, x, kernel, stride, pad)
    assert dx.dtype == dtype
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-6, atol=1e-6)


def test_padded_cells_never_win():
    x = np.full((1, 1, 3, 3), -5.0)
    y = maxpool_forward(x, 2, 1, 1)
    np.testing.assert_array_equal(y, np.full((1, 1, 4, 4), -5.0))


def test_ties_go_to_the_first_maximum_and_overlaps_accumulate():
    x = np.zeros((1, 1, 4, 4))
    dx = maxpool_backward(np.ones((1, 1, 2, 2)), x, 2, 2)
    np.testing.assert_array_equal(
        dx[0, 0], [[1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]]
    )
    # 3x3 windows at stride 1 over a constant 4x4: each window picks its top-left cell.
    dx = maxpool_backward(np.ones((1, 1, 2, 2)), x, 3, 1)
    np.testing.assert_array_equal(dx[0, 0, :2, :2], np.ones((2, 2)))
    assert dx.sum() == 4
    # A single peak shared by all overlapping windows receives all their gradients.
    x[0, 0, 1, 2] = 1.0
    dy = np.arange(1.0, 5.0).reshape(1, 1, 2, 2)
    dx = maxpool_backward(dy, x, 3, 1)
    assert dx[0, 0, 1, 2] == 10.0 and dx.sum() == 10.0


@pytest.mark.parametrize(("kernel", "stride", "pad"), [(3, 1, (1, 0, 0, 2)), ((2, 3), (2, 2), 1)])
def test_numerical_gradient(kernel, stride, pad):
    x = _distinct((2, 2, 5, 6))
    y = maxpool_forward(x, kernel, stride, pad)
    r = np.random.default_rng(3).standard_normal(y.shape)
    dx = maxpool_backward(r, x, kernel, stride, pad)
    assert_grad(dx, numeric_grad(lambda: maxpool_forward(x, kernel, stride, pad), x, r))


def test_spatial_pieces_with_halo_match_the_whole():
    x = _distinct((2, 2, 9, 6), seed=4)
    whole = maxpool_forward(x, 3, 2, 1)  # rows of y: 5
    # Output rows 0-1 read padded rows -1..3; rows 2-4 read rows 3..9 plus the bottom pad.
    top = maxpool_forward(x[:, :, 0:4], 3, 2, (1, 0, 1, 1))
    bottom = maxpool_forward(x[:, :, 3:9], 3, 2, (0, 1, 1, 1))
    np.testing.assert_array_equal(np.concatenate([top, bottom], axis=2), whole)


def test_bad_arguments():
    x = np.zeros((1, 1, 4, 4))
    with pytest.raises(
        ValueError, match=r"pad \(2, 2, 2, 2\) must be smaller than kernel \(2, 2\)"
    ):
        maxpool_forward(x, 2, 1, 2)
    with pytest.raises(ValueError, match="pad must be an int or"):
        maxpool_forward(x, 2, 1, (1, 1))
    with pytest.raises(ValueError, match="kernel must be an int or a pair"):
        maxpool_forward(x, (2, 2, 2), 1)
    with pytest.raises(ValueError, match=r"kernel \(5, 5\) exceeds padded input"):
        maxpool_forward(x, 5, 1)
    with pytest.raises(ValueError, match="must be positive"):
        maxpool_forward(x, 2, 0)
    with pytest.raises(ValueError, match=r"dy must have shape \(1, 1, 2, 2\)"):
        maxpool_backward(np.zeros((1, 1, 3, 3)), x, 2, 2)


def test_empty_batch_piece():
    x = np.zeros((0, 2, 4, 6), np.float32)
    assert maxpool_forward(x, 2, 2).shape == (0, 2, 2, 3)
    assert maxpool_backward(np.zeros((0, 2, 2, 3), np.float32), x, 2, 2).shape == x.shape


def _average_reference(x, dy, kernel, stride, pads):
    """Loops: each window's mean over its real cells, and dy shared equally among them."""
    (kh, kw), (sh, sw), (t, b, l, r) = kernel, stride, pads
    n, c, h, w = x.shape
    ho, wo = (h + t + b - kh) // sh + 1, (w + l + r - kw) // sw + 1
    y = np.empty((n, c, ho, wo))
    dx = np.zeros(x.shape)
    for i, j, p, q in np.ndindex(n, c, ho, wo):
        rows = slice(max(p * sh - t, 0), min(p * sh - t + kh, h))
        cols = slice(max(q * sw - l, 0), min(q * sw - l + kw, w))
        window = x[i, j, rows, cols].astype(np.float64)
        y[i, j, p, q] = window.mean()
        dx[i, j, rows, cols] += dy[i, j, p, q] / window.size
    return y, dx


@pytest.mark.parametrize(("shape", "kernel", "stride", "pad", "pads"), CASES)
def test_average_matches_reference(shape, kernel, stride, pad, pads):
    """In float64: each output sums at most 9 terms of magnitude below 5, so the kernel and the
    loops differ by at most γ(9)·45 ≈ 5e-14 however the sums are ordered."""
    kernel2 = (kernel, kernel) if np.isscalar(kernel) else kernel
    stride2 = (stride, stride) if np.isscalar(stride) else stride
    x = np.random.default_rng(0).standard_normal(shape)
    y = avgpool_forward(x, kernel, stride, pad)
    dy = np.random.default_rng(1).standard_normal(y.shape)
    ref_y, ref_dx = _average_reference(x, dy, kernel2, stride2, pads)
    np.testing.assert_allclose(y, ref_y, rtol=0, atol=1e-12)
    dx = avgpool_backward(dy, x.shape, kernel, stride, pad)
    np.testing.assert_allclose(dx, ref_dx, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("kernel", "stride", "pad"), [(3, 1, (1, 0, 0, 2)), ((2, 3), (2, 2), 1)])
def test_average_numerical_gradient(kernel, stride, pad):
    x = _distinct((2, 2, 5, 6))
    y = avgpool_forward(x, kernel, stride, pad)
    r = np.random.default_rng(3).standard_normal(y.shape)
    dx = avgpool_backward(r, x.shape, kernel, stride, pad)
    assert_grad(dx, numeric_grad(lambda: avgpool_forward(x, kernel, stride, pad), x, r))


def test_average_spatial_pieces_with_halo_match_the_whole():
    x = np.random.default_rng(5).standard_normal((2, 2, 9, 6))
    whole = avgpool_forward(x, 3, 2, 1)
    top = avgpool_forward(x[:, :, 0:4], 3, 2, (1, 0, 1, 1))
    bottom = avgpool_forward(x[:, :, 3:9], 3, 2, (0, 1, 1, 1))
    np.testing.assert_allclose(np.concatenate([top, bottom], axis=2), whole, rtol=0, atol=1e-15)
