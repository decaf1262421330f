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


def _product(a: np.ndarray, transpose_a: bool, b: np.ndarray, out: np.ndarray) -> None:
    """out[i] = op(a[i])·b[i] over the leading dims, each operand made C-contiguous."""
    rows, columns = out.shape[-2:]
    depth = b.shape[-2]
    batch = out.size // max(rows * columns, 1)
    a3 = np.ascontiguousarray(a).reshape(batch, -1)
    strides = (1, rows) if transpose_a else (depth, 1)
    b3 = np.ascontiguousarray(b).reshape(batch, depth, columns)
    _batched(kernels(out.dtype), a3, *strides, b3, out.reshape(batch, rows, columns), False)


def _swapped(a: np.ndarray) -> np.ndarray:
    """The last two dims of `a` swapped, C-contiguous (one copy for every head)."""
    return np.ascontiguousarray(np.swapaxes(a, -1, -2))


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
    a: np.ndarray, b: np.ndarray, transpose_b: bool = False, scale: float = 1.0
) -> np.ndarray:
    """out (N, H, I, J) = scale · a·b, or scale · a·bᵀ with `transpose_b`."""
    rows, columns, _ = _check(a, b, transpose_b)
    out = np.empty(a.shape[:2] + (rows, columns), a.dtype)
    _product(a, False, _swapped(b) if transpose_b else b, out)
    if scale != 1.0:
        out *= scale
    return out


def matmul_backward(
    dy: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    transpose_b: bool = False,
    scale: float = 1.0,
    need_da: bool = True,
    need_db: bool = True,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(da, db) of `matmul_forward`: da = scale·dy·b'ᵀ, and db = scale·aᵀ·dy (b = scale·dyᵀ·a
    with `transpose_b`)."""
    rows, columns, _ = _check(a, b, transpose_b)
    _checks.floating("dy", dy, 4)
    _checks.shape("dy", dy, a.shape[:2] + (rows, columns))
    _checks.same_dtype("dy", dy, "a", a)
    g = dy * scale if scale != 1.0 else dy
    da = db = None
    if need_da:
        da = np.empty(a.shape, a.dtype)
        _product(g, False, b if transpose_b else _swapped(b), da)
    if need_db:
        db = np.empty(b.shape, b.dtype)
        if transpose_b:
            _product(g, True, a, db)
        else:
            _product(a, True, g, db)
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
