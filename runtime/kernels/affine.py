"""The `filterA` op: out = a·x + b with one scalar `a` and an untied bias `b`.

`b` has shape (1, K, P, Q): one bias per output channel and position, shared across the batch,
which is what follows an untied `filter` in the seed network. On a piece of the batch the backward
returns the piece's contribution to `da` and `db` (sums over that piece's samples); the runtime adds
the contributions of the pieces, so the sums are accumulated in float64 and only the totals are
rounded to the input dtype.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from runtime.kernels import _checks
from runtime.kernels.threaded import threaded


@threaded
def _forward(x, a, b, y):
    n, k, p, q = x.shape
    for nk in prange(n * k):
        i, c = nk // k, nk % k
        for r in range(p):
            for s in range(q):
                y[i, c, r, s] = a * x[i, c, r, s] + b[0, c, r, s]


@threaded
def _backward(dy, x, a, need_dx, dx, products, db):
    n, k, p, q = dy.shape
    # One channel per iteration: each writes its own slice of db and of products (float64,
    # zeroed by the caller), so there are no races; the batch loop is outside to stream rows
    # of dy. da's products are summed per position, elementwise, and added up by the caller:
    # a running scalar sum here kept the loop from vectorising (4.1-4.7 ms at the seed's L0
    # shape, batch 64, against 1.5 ms for its bytes)
    for c in prange(k):
        for i in range(n):
            for r in range(p):
                for s in range(q):
                    g = dy[i, c, r, s]
                    products[c, r, s] += g * np.float64(x[i, c, r, s])
                    db[0, c, r, s] += g
                    if need_dx:
                        dx[i, c, r, s] = a * g


def _check(x: np.ndarray, a: np.ndarray, x_name: str = "x") -> None:
    _checks.floating(x_name, x, 4)
    _checks.floating("a", a)
    _checks.shape("a", a, (1,))


def filterA_forward(
    x: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """y = a·x + b for x (N, K, P, Q), a (1,), b (1, K, P, Q); y has x's dtype, and is `out`
    where given (a step's buffer: no copy of the result after)."""
    _check(x, a)
    _checks.floating("b", b)
    _checks.shape("b", b, (1, *x.shape[1:]))
    y = _checks.output_or_new(out, x.shape, "x", x)
    _forward(x, x.dtype.type(a[0]), b.astype(x.dtype, copy=False), y)
    return y


def filterA_backward(
    dy: np.ndarray,
    x: np.ndarray,
    a: np.ndarray,
    need_dx: bool = True,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(dx, da, db): dx = a·dy (None unless need_dx; into `out` where given), da (1,) = Σ dy·x,
    db (1, K, P, Q) = Σ_n dy."""
    _check(dy, a, "dy")
    _checks.like("x", x, "dy", dy)
    _, k, p, q = dy.shape
    if need_dx:
        dx = _checks.output_or_new(out, dy.shape, "dy", dy)
    else:
        dx = np.empty((0, 0, 0, 0), dy.dtype)
    products = np.zeros((k, p, q), np.float64)
    db = np.zeros((1, k, p, q), np.float64)
    _backward(dy, x, dy.dtype.type(a[0]), bool(need_dx), dx, products, db)
    da = np.array([products.sum()], dtype=dy.dtype)
    return (dx if need_dx else None), da, db.astype(dy.dtype)
