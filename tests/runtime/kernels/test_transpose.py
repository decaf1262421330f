"""`runtime.kernels.transpose`: scale · aᵀ per head, tiles transposed in registers, equal to
NumPy's element-by-element copy bit for bit (one rounding of one product per element)."""

import numpy as np
import pytest

from runtime.kernels.attention import in_place
from runtime.kernels.transpose import LANES_FLOAT32, LANES_FLOAT64, _swap_masks, transpose_heads

RNG = np.random.default_rng(7)


def transposed(a: np.ndarray, scale: float) -> np.ndarray:
    n, h, rows, columns = a.shape
    out = np.full((n, h, columns, rows), np.nan, a.dtype)
    flat, steps = in_place(a)
    transpose_heads(flat, *steps, n, h, rows, columns, a.dtype.type(scale), out.reshape(-1))
    return out


def heads(features: np.ndarray, count: int) -> np.ndarray:
    n, t, width = features.shape
    return features.reshape(n, t, count, width // count).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [1.0, 0.125, 0.3])
def test_heads_of_every_shape_and_layout_equal_numpy(dtype, scale):
    lanes = LANES_FLOAT32 if dtype == np.float32 else LANES_FLOAT64
    shapes = [
        (2, 3, lanes, lanes),  # one tile
        (1, 2, 3 * lanes, 2 * lanes),  # whole tiles only
        (2, 2, 2 * lanes + 5, lanes + 3),  # edges of rows and of columns
        (1, 1, lanes - 1, 3),  # no tile at all
        (3, 1, 1, 2 * lanes),
    ]
    for n, h, rows, columns in shapes:
        contiguous = RNG.standard_normal((n, h, rows, columns)).astype(dtype)
        strided = heads(RNG.standard_normal((n, rows, h * columns)).astype(dtype), h)
        spaced = np.repeat(contiguous, 2, axis=-1)[..., ::2]  # columns 2 apart: no tiles
        for a in (contiguous, strided, spaced):
            want = np.multiply(np.swapaxes(a, -1, -2), dtype(scale))
            np.testing.assert_array_equal(transposed(a, scale), want)


def test_each_round_swaps_the_off_diagonal_blocks():
    """The masks of a round on 8 lanes: rows a and a + s trade their s-wide blocks."""
    upper, lower = _swap_masks(8, 2)
    assert upper == [0, 1, 8, 9, 4, 5, 12, 13]
    assert lower == [2, 3, 10, 11, 6, 7, 14, 15]
    upper, lower = _swap_masks(8, 4)
    assert upper == [0, 1, 2, 3, 8, 9, 10, 11]
    assert lower == [4, 5, 6, 7, 12, 13, 14, 15]
