"""The tests' error bounds hold for reorderings and catch real errors."""

import math

import numpy as np
import pytest

from tests.error_bounds import assert_close_to, assert_product_close, gamma


def test_a_sum_in_any_order_is_within_the_bound_even_where_it_cancels():
    rng = np.random.default_rng(0)
    terms = rng.standard_normal(10_000) * 1e6
    terms = np.append(terms, -terms.sum())  # the exact sum is tiny against its terms
    forward, backward = float(np.sum(terms)), float(sum(terms[::-1].tolist()))
    exact = math.fsum(terms.tolist())
    magnitude = float(np.abs(terms).sum())
    assert_close_to(forward, backward, magnitude, terms.size)
    assert_close_to(forward, exact, magnitude, terms.size, computations=1)
    # a relative tolerance could not hold here: the result is rounding error itself
    assert abs(forward - exact) > 1e-12 * abs(exact)


def test_an_error_past_rounding_is_caught():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((40, 300)), rng.standard_normal((300, 20))
    wrong = a @ b
    wrong[3, 4] += 1e3 * gamma(302) * (np.abs(a) @ np.abs(b))[3, 4]
    with pytest.raises(AssertionError, match=r"at \(3, 4\)"):
        assert_product_close(wrong, a, b)
    assert_product_close(a @ b, a, b)
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    assert_product_close(a32 @ b32, a32, b32, dtype=np.float32)
