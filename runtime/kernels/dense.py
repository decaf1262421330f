"""The `dense` op: every token's features times a weight matrix, on the linear layer's GEMM.

x (N, T, K) is the matrix (N·T, K), so the three products are the linear layer's
(`linear.product`, on Numba's threads) with the weights (K, O) in MatMul's orientation.
"""

from __future__ import annotations

import numpy as np

from runtime.kernels import _checks
from runtime.kernels.blas import NO_TRANS, TRANS
from runtime.kernels.linear import product


def _rows(a: np.ndarray) -> np.ndarray:
    """(N, T, F) as a C-contiguous (N·T, F) matrix: a view when it can be, else a copy."""
    return np.ascontiguousarray(a.reshape(-1, a.shape[-1]))


def _check(x: np.ndarray, w: np.ndarray) -> None:
    _checks.floating("x", x, 3)
    _checks.floating("w", w, 2)
    _checks.same_dtype("w", w, "x", x)
    if x.shape[2] != w.shape[0]:
        raise ValueError(f"w shape {w.shape} does not match x shape {x.shape} in K")


def dense_forward(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None = None,
    out: np.ndarray | None = None,
    add: bool = False,
) -> np.ndarray:
    """y (N, T, O) = x (N, T, K)·w (K, O) (+ b (O,)), into `out` where given (C-contiguous),
    or added to what `out` holds with `add` (a piece's partial sum over part of K)."""
    _check(x, w)
    n, t, _ = x.shape
    if out is None:
        y, add = np.empty((n, t, w.shape[1]), x.dtype), False
    else:
        y = _checks.output("out", out, (n, t, w.shape[1]), "x", x)
    if b is not None:  # the product accumulates onto the bias: no second pass over y
        _checks.floating("b", b)
        _checks.shape("b", b, w.shape[1:])
        _checks.same_dtype("b", b, "x", x)
        if add:
            y += b
        else:
            y[...] = b
    rows = y.reshape(n * t, -1)
    product(
        _rows(x), NO_TRANS, np.ascontiguousarray(w), NO_TRANS, rows, accumulate=add or b is not None
    )
    return y


def dense_backward(
    dy: np.ndarray,
    x: np.ndarray,
    w: np.ndarray,
    need_dx: bool = True,
    need_db: bool = False,
    *,
    dw: np.ndarray | None = None,
    add_dw: bool = False,
    dx: np.ndarray | None = None,
    add_dx: bool = False,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
    """(dx, dw, db): dx = dy·wᵀ (N, T, K), dw = xᵀ·dy (K, O), db = Σ dy over tokens (O,).

    Given `dw` or `dx` (C-contiguous), that gradient is written there, or added to what it
    holds with `add_dw` / `add_dx`: a gradient that sums over pieces or micro-batches goes
    straight into its buffer, with no temporary of its size and no second pass."""
    _check(x, w)
    _checks.floating("dy", dy)
    _checks.shape("dy", dy, x.shape[:2] + w.shape[1:])
    _checks.same_dtype("dy", dy, "x", x)
    dy2, x2 = _rows(dy), _rows(x)
    if dw is None:
        dw, add_dw = np.empty(w.shape, w.dtype), False
    product(x2, TRANS, dy2, NO_TRANS, _checks.output("dw", dw, w.shape, "x", x), accumulate=add_dw)
    dx = dense_input_grad(dy, w, x.shape, dx, add_dx) if need_dx else None
    db = dy2.sum(axis=0, dtype=np.float64).astype(dy.dtype) if need_db else None
    return dx, dw, db


def dense_input_grad(
    dy: np.ndarray,
    w: np.ndarray,
    input_shape: tuple[int, ...],
    dx: np.ndarray | None = None,
    add_dx: bool = False,
) -> np.ndarray:
    """dx (N, T, K) = dy·wᵀ, written into (or with `add_dx` added to) a C-contiguous `dx` where
    given."""
    if dx is None:
        dx, add_dx = np.empty(input_shape, dy.dtype), False
    dy2 = _rows(dy)
    rows = _checks.output("dx", dx, input_shape, "dy", dy).reshape(dy2.shape[0], -1)
    # against wᵀ made contiguous (weight-sized), the product runs untransposed
    product(dy2, NO_TRANS, np.ascontiguousarray(w.T), NO_TRANS, rows, accumulate=add_dx)
    return dx
