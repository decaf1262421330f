"""Tolerances from the computation's error bound, not from one machine's bits.

A sum of n floating-point terms, in any order and any blocking, lies within γ(n)·Σ|terms| of the
exact sum, where γ(n) = n·u / (1 − n·u) and u is the unit roundoff (Higham, *Accuracy and
Stability of Numerical Algorithms*, §3.1). A dot product of length k is such a sum of k products,
each rounded once more: γ(k + 1)·(|a|·|b|). Two computations of the same quantity, by different
orders (a BLAS against NumPy, pieces added against the whole), each lie within their bound of the
exact value, so they lie within the sum of both bounds of each other. Relative tolerances fail
exactly where these bounds matter: where terms cancel and the result is small against its terms.
"""

from __future__ import annotations

import numpy as np


def unit_roundoff(dtype) -> float:
    return float(np.finfo(dtype).eps) / 2


def gamma(n: int, dtype=np.float64) -> float:
    u = unit_roundoff(dtype)
    if n * u >= 1:
        raise ValueError(f"no error bound for {n} terms in {np.dtype(dtype)}")
    return n * u / (1 - n * u)


def assert_close_to(got, expected, magnitude, terms: int, dtype=np.float64, computations=2):
    """`got` and `expected`, each a sum of at most `terms` rounded terms whose absolute values
    sum to `magnitude` (elementwise), are within their `computations` error bounds of each
    other."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    bound = computations * gamma(terms, dtype) * np.asarray(magnitude, np.float64)
    excess = np.abs(got - expected) - bound
    worst = tuple(int(i) for i in np.unravel_index(np.argmax(excess), excess.shape))
    if excess.size == 0:
        return
    assert excess[worst] <= 0, (
        f"|got - expected| = {abs(got[worst] - expected[worst]):.3g} at {worst} exceeds the "
        f"bound {bound[worst]:.3g} ({computations} × γ({terms}) × Σ|terms|)"
    )


def assert_product_close(got, a, b, offset=0.0, dtype=np.float64):
    """`got` is `offset + a @ b` computed in some order: within the bound of NumPy's own."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    k = a.shape[-1]
    magnitude = np.abs(offset) + np.abs(a) @ np.abs(b)
    assert_close_to(got, offset + a @ b, magnitude, k + 2, dtype)
