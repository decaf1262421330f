"""The `embedding` op: rows of a table gathered at token ids, and the gradient scattered back.

A piece holds some features of the table (its columns `weights[:, d0:d1]`), so both passes work
on whatever columns they are given. The backward adds in token order into the rows: tokens
sharing an id are summed in the order the piece holds them, which is the order of the whole batch
when the piece is whole, as addition in floating point needs for runs to agree.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from runtime.kernels import _checks


@njit(cache=True, nogil=True)
def _scatter_add(ids, dy, dw):
    n, t, d = dy.shape
    for i in range(n):
        for j in range(t):
            row = ids[i, j]
            for k in range(d):
                dw[row, k] += dy[i, j, k]


def _check_ids(ids: np.ndarray, vocab: int) -> None:
    if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu" or ids.ndim != 2:
        got = (ids.dtype, ids.shape) if isinstance(ids, np.ndarray) else type(ids).__name__
        raise ValueError(f"ids must be a 2-d int array (N, T), got {got}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"ids must lie in [0, {vocab}), got range [{ids.min()}, {ids.max()}]")


def embedding_forward(ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """y (N, T, D) = weights (V, D) at rows ids (N, T)."""
    _checks.floating("weights", weights, 2)
    _check_ids(ids, weights.shape[0])
    return weights[ids]


def embedding_backward(ids: np.ndarray, dy: np.ndarray, vocab: int) -> np.ndarray:
    """dweights (vocab, D): each token's dy added into its id's row."""
    _checks.floating("dy", dy, 3)
    _check_ids(ids, vocab)
    _checks.shape("ids", ids, dy.shape[:2])
    dw = np.zeros((vocab, dy.shape[2]), dy.dtype)
    _scatter_add(np.ascontiguousarray(ids), dy, dw)
    return dw
