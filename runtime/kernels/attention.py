"""Attention's kernels: products of two activations per head, and the softmax of rows of scores.

`matmul_*` multiply (N, H, I, K) by (N, H, K, J) (or by (N, H, J, K) transposed) head by head,
all heads in one parallel loop of the filters' and linear layer's GEMM (`microkernel`); an
operand the GEMM must read transposed as its right side is copied so first, once for all heads. `row_softmax_*` work row by row in float64; a causal
row i keeps the columns j ≤ i, where i counts from `first_row`, the piece's first query position,
and the masked probabilities are exactly 0.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from runtime.kernels import _checks
from runtime.kernels.microkernel import kernels, tiled_gemm
from runtime.kernels.softmax import softmax_rows


@njit(cache=True, nogil=True, parallel=True)
def _batched(kernels, a, a_rs, a_cs, b, c, accumulate):
    """c[i] (+)= op(a[i])·b[i] for every i of the batch, one product a task, on
    `microkernel.tiled_gemm`: a (batch, ...) read through (a_rs, a_cs), b (batch, k, n) and
    c (batch, m, n) C-contiguous."""
    batch, m, n = c.shape
    k = b.shape[1]
    a_size = a.size // max(batch, 1)
    for i in prange(batch):
        tiled_gemm(kernels, m, n, k, a, i * a_size, a_rs, a_cs, b, i * k * n, n, accumulate, c,
                   i * m * n, n)  # fmt: skip


def _product(
    a: np.ndarray, transpose_a: bool, b: np.ndarray, out: np.ndarray, add: bool = False
) -> None:
    """out[i] (+)= op(a[i])·b[i] over the leading dims, each operand made C-contiguous; `out`
    is C-contiguous."""
    rows, columns = out.shape[-2:]
    depth = b.shape[-2]
    batch = out.size // max(rows * columns, 1)
    a3 = np.ascontiguousarray(a).reshape(batch, -1)
    strides = (1, rows) if transpose_a else (depth, 1)
    b3 = np.ascontiguousarray(b).reshape(batch, depth, columns)
    _batched(kernels(out.dtype), a3, *strides, b3, out.reshape(batch, rows, columns), add)


def _swapped(a: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """scale · `a` with its last two dims swapped, C-contiguous (one pass for every head)."""
    return _scaled(np.swapaxes(a, -1, -2), scale)


def _scaled(a: np.ndarray, scale: float) -> np.ndarray:
    """scale · `a`, C-contiguous, in one pass (`a` itself where it is so and scale is 1): the
    products take their scale on an operand of T·D elements rather than on T·T scores."""
    if scale == 1.0:
        return np.ascontiguousarray(a)
    return np.multiply(a, a.dtype.type(scale), out=np.empty(a.shape, a.dtype))


def _target(out: np.ndarray | None, shape: tuple[int, ...], like: np.ndarray) -> np.ndarray:
    """`out` (C-contiguous, of `shape` and `like`'s dtype), or a new array."""
    if out is None:
        return np.empty(shape, like.dtype)
    return _checks.output("out", out, shape, "a", like)


def _check(a: np.ndarray, b: np.ndarray, transpose_b: bool) -> tuple[int, int, int]:
    _checks.floating("a", a, 4)
    _checks.floating("b", b, 4)
    _checks.same_dtype("b", b, "a", a)
    rows, summed = a.shape[2:]
    columns, b_summed = (b.shape[2], b.shape[3]) if transpose_b else (b.shape[3], b.shape[2])
    if a.shape[:2] != b.shape[:2] or summed != b_summed:
        raise ValueError(f"cannot multiply a {a.shape} by b {b.shape} (transpose_b={transpose_b})")
    return rows, columns, summed


def matmul_forward(
    a: np.ndarray,
    b: np.ndarray,
    transpose_b: bool = False,
    scale: float = 1.0,
    out: np.ndarray | None = None,
    add: bool = False,
) -> np.ndarray:
    """out (N, H, I, J) = (scale · a)·b, or (scale · a)·bᵀ with `transpose_b`; into `out` where
    given, or added to what it holds with `add`."""
    rows, columns, _ = _check(a, b, transpose_b)
    target = _target(out, a.shape[:2] + (rows, columns), a)
    _product(
        _scaled(a, scale), False, _swapped(b) if transpose_b else b, target, add and out is not None
    )
    return target


def matmul_backward(
    dy: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    transpose_b: bool = False,
    scale: float = 1.0,
    need_da: bool = True,
    need_db: bool = True,
    da: np.ndarray | None = None,
    add_da: bool = False,
    db: np.ndarray | None = None,
    add_db: bool = False,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(da, db) of `matmul_forward`: da = dy·(scale · b')ᵀ, and db = (scale · a)ᵀ·dy (b =
    dyᵀ·(scale · a) with `transpose_b`); each into its given array, or added to it with its
    `add_*`."""
    rows, columns, _ = _check(a, b, transpose_b)
    _checks.floating("dy", dy, 4)
    _checks.shape("dy", dy, a.shape[:2] + (rows, columns))
    _checks.same_dtype("dy", dy, "a", a)
    if need_da:
        right = _scaled(b, scale) if transpose_b else _swapped(b, scale)
        given, da = da is not None, _target(da, a.shape, a)
        _product(dy, False, right, da, add_da and given)
    else:
        da = None
    if need_db:
        given, db = db is not None, _target(db, b.shape, b)
        if transpose_b:
            _product(dy, True, _scaled(a, scale), db, add_db and given)
        else:
            _product(_scaled(a, scale), True, dy, db, add_db and given)
    else:
        db = None
    return da, db


@njit(cache=True, nogil=True, parallel=True)
def _softmax_rows_backward(dy, y, dx):
    n, h, rows, columns = y.shape
    for r in prange(n * h * rows):
        i, k, row = r // (h * rows), (r // rows) % h, r % rows
        inner = 0.0
        for j in range(columns):
            inner += np.float64(dy[i, k, row, j]) * np.float64(y[i, k, row, j])
        for j in range(columns):
            dx[i, k, row, j] = np.float64(y[i, k, row, j]) * (np.float64(dy[i, k, row, j]) - inner)


def row_softmax_forward(x: np.ndarray, causal: bool = False, first_row: int = 0) -> np.ndarray:
    """y: the softmax of every row of x (N, H, I, J) over J; causal: of its columns j ≤ i."""
    _checks.floating("x", x, 4)
    rows, columns = x.shape[2:]
    y = np.empty(x.shape, x.dtype)
    softmax_rows(
        np.ascontiguousarray(x).reshape(-1, columns),
        y.reshape(-1, columns),
        causal,
        rows,
        first_row,
    )
    return y


def row_softmax_backward(dy: np.ndarray, y: np.ndarray) -> np.ndarray:
    """dx = y·(dy − Σ_j dy·y), from the forward output y (masked entries, 0 in y, get 0)."""
    _checks.floating("dy", dy, 4)
    _checks.like("y", y, "dy", dy)
    dx = np.empty(dy.shape, dy.dtype)
    _softmax_rows_backward(dy, y, dx)
    return dx
