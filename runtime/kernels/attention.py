"""Attention's kernels: products of two activations per head, and the softmax of rows of scores.

`matmul_*` multiply (N, H, I, K) by (N, H, K, J) (or by (N, H, J, K) transposed) head by head,
all heads in one parallel loop of the filters' and linear layer's GEMM (`microkernel`). The
operands are read where they lie, the heads' strided views too; only one the GEMM must read
transposed as its right side is copied (so, once for all heads, with the product's scale
folded in where it can be). `row_softmax_*` work row by row in float64; a causal
row i keeps the columns j ≤ i, where i counts from `first_row`, the piece's first query position,
and the masked probabilities are exactly 0.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from runtime.kernels import _checks
from runtime.kernels.microkernel import kernels, tiled_gemm
from runtime.kernels.softmax import softmax_rows
from runtime.kernels.threaded import threaded
from runtime.kernels.transpose import transpose_heads


@threaded
def _batched(kernels, batch, heads, m, n, k, a, a_n, a_h, a_rs, a_cs, b, b_n, b_h, ldb, c, c_n,
             c_h, ldc, accumulate):  # fmt: skip
    """c[i, j] (+)= a[i, j]·b[i, j] for every (i, j) of the (`batch`, `heads`) leading dims,
    one product a task, on `microkernel.tiled_gemm`. Each operand is a flat array from its first
    element, read through its strides in elements: per leading index (`*_n`, `*_h`), then per
    row (a by `a_rs` and `a_cs`; b's and c's rows of unit stride, `ldb` and `ldc` apart)."""
    for t in prange(batch * heads):
        i, j = t // heads, t % heads
        tiled_gemm(kernels, m, n, k, a, i * a_n + j * a_h, a_rs, a_cs, b, i * b_n + j * b_h, ldb,
                   accumulate, c, i * c_n + j * c_h, ldc)  # fmt: skip


def in_place(x: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """`x`'s elements as a flat array that starts at its first element, and its strides in
    elements: the heads' views (`split_heads`) are read where they lie, without a copy. A copy
    where `x` cannot be read so (a negative stride, or one that is not whole elements)."""
    size = x.itemsize
    if any(s % size or (s < 0 and d > 1) for s, d in zip(x.strides, x.shape)):
        x = np.ascontiguousarray(x)
    steps = tuple(s // size if d > 1 else 0 for s, d in zip(x.strides, x.shape))
    span = 1 + sum((d - 1) * s for d, s in zip(x.shape, steps)) if x.size else 0
    return np.lib.stride_tricks.as_strided(x, shape=(span,), strides=(size,)), steps


def _rows(x: np.ndarray) -> np.ndarray:
    """`x`, or a C-contiguous copy where its rows are not of unit stride (the GEMM reads its
    right operand and its output by whole rows)."""
    return x if x.shape[-1] < 2 or x.strides[-1] == x.itemsize else np.ascontiguousarray(x)


def _product(
    a: np.ndarray, transpose_a: bool, b: np.ndarray, out: np.ndarray, add: bool = False
) -> None:
    """out[i, j] (+)= op(a[i, j])·b[i, j] over the (N, H) leading dims, a and b read where
    they lie (b copied only where its rows are not of unit stride); `out` is C-contiguous."""
    heads, rows, columns = out.shape[1:]
    depth = b.shape[-2]
    a_flat, (a_n, a_h, a_r, a_c) = in_place(a)
    a_rs, a_cs = (a_c, a_r) if transpose_a else (a_r, a_c)
    b_flat, (b_n, b_h, ldb, _) = in_place(_rows(b))
    c_flat, (c_n, c_h, ldc, _) = in_place(out)
    _batched(kernels(out.dtype), out.shape[0], heads, rows, columns, depth, a_flat, a_n, a_h,
             a_rs, a_cs, b_flat, b_n, b_h, ldb, c_flat, c_n, c_h, ldc, add)  # fmt: skip


def _swapped(a: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """scale · `a` with its last two dims swapped, C-contiguous: the GEMM's right operand,
    which it reads by rows (`transpose.transpose_heads`, tiles transposed in registers)."""
    n, h, rows, columns = a.shape
    out = np.empty((n, h, columns, rows), a.dtype)
    flat, (a_n, a_h, a_r, a_c) = in_place(a)
    transpose_heads(flat, a_n, a_h, a_r, a_c, n, h, rows, columns, a.dtype.type(scale),
                    out.reshape(-1))  # fmt: skip
    return out


def _scaled(a: np.ndarray, scale: float) -> np.ndarray:
    """scale · `a` in one pass, or `a` itself where scale is 1."""
    if scale == 1.0:
        return a
    return np.multiply(a, a.dtype.type(scale), out=np.empty(a.shape, a.dtype))


def _scale_smaller(x: np.ndarray, y: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) with `scale` taken by the one of fewer elements: a product's scale on an operand
    of T·D elements rather than on T·T scores."""
    if x.size <= y.size:
        return _scaled(x, scale), y
    return x, _scaled(y, scale)


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
    target = _checks.output_or_new(out, a.shape[:2] + (rows, columns), "a", a)
    left, right = (a, _swapped(b, scale)) if transpose_b else _scale_smaller(a, b, scale)
    _product(left, False, right, target, add and out is not None)
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
        given, da = da is not None, _checks.output_or_new(da, a.shape, "a", a)
        _product(dy, False, right, da, add_da and given)
    else:
        da = None
    if need_db:
        given, db = db is not None, _checks.output_or_new(db, b.shape, "b", b)
        if transpose_b:
            left, right = _scale_smaller(dy, a, scale)
        else:
            left, right = _scale_smaller(a, dy, scale)
        _product(left, True, right, db, add_db and given)
    else:
        db = None
    return da, db


@threaded
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
