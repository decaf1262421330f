"""Centred-difference gradients and the relative error used by the kernel tests."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

TOLERANCE = 1e-7


def numeric_grad(
    f: Callable[[], np.ndarray], x: np.ndarray, weights: np.ndarray, h: float = 1e-5
) -> np.ndarray:
    """d(Σ weights·f())/dx by centred differences, perturbing x in place.

    The outputs are differenced before they are weighted and summed, so outputs that do not
    move contribute exactly zero and the round-off stays proportional to the gradient.
    """
    grad = np.zeros(x.shape, np.float64)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + h
        plus = np.array(f(), np.float64)
        x[idx] = old - h
        minus = np.array(f(), np.float64)
        x[idx] = old
        grad[idx] = np.sum((plus - minus) * weights) / (2 * h)
    return grad


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    """max |a − b| / max(1e-8, |a| + |b|), elementwise."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(1e-8, np.abs(a) + np.abs(b))))


def assert_grad(analytic: np.ndarray, numeric: np.ndarray, tol: float = TOLERANCE) -> None:
    assert analytic.shape == numeric.shape
    assert np.any(numeric != 0), "the check is vacuous: the numerical gradient is all zero"
    err = rel_error(analytic, numeric)
    assert err < tol, f"relative error {err:.3g} >= {tol:g}"
