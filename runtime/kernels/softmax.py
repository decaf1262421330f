"""The `softmax` (with cross-entropy loss) and `evaluate` ops.

Both run on a batch piece of n samples out of a global batch of `batch_total`. The loss a piece
returns is its share of the global mean, Σ_i −log p[i, y_i] / batch_total, and the gradient is
scaled the same way, so adding the pieces' losses gives the mean over the whole batch and no piece
needs to know how the batch was split. Logits are shifted by their row maximum and the loss is
computed as log Σ exp − (x_y − max), which never takes the log of an underflowed probability.

`evaluate` returns four sums (loss, top-1 correct, top-k correct, sample count) so its
statistics reduce with + like any other task output. A sample is top-k correct when fewer than k
classes rank ahead of its label, where ties rank in index order (the first maximum wins, as with
argmax): uniform predictions do not count as correct.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from runtime.kernels import _checks
from runtime.kernels.threaded import threaded

TOP_K = 5


@njit(cache=True, nogil=True, inline="always")
def _row_end(columns, causal, rows_per_matrix, first_row, row):
    """The columns a row takes: all, or under `causal` those up to its row of its matrix (row
    `row` is row row % rows_per_matrix of its matrix, whose first row is `first_row`)."""
    return min(columns, first_row + row % rows_per_matrix + 1) if causal else columns


@threaded
def _row_pass(x, normalise, causal, rows_per_matrix, first_row, offset, shifted, per_row, y):
    """One of the two passes over a block of rows around NumPy's exponentials, over row
    offset + r's columns (`_row_end`) and 0 past them: shifted[r, j] = x[r, j] − max_j x[r, j]
    in float64, the maximum into per_row (exp's fast path: −inf past the columns took NumPy's
    exp three times as long); or, `normalise`, y[r, j] = shifted[r, j] / Σ_j shifted[r, j],
    the sum into per_row. One compiled loop for both (two had been two compiles on a cold
    cache)."""
    rows, columns = shifted.shape
    for r in prange(rows):
        last = _row_end(columns, causal, rows_per_matrix, first_row, offset + r)
        if normalise:
            total = 0.0
            for j in range(last):
                total += shifted[r, j]
            for j in range(last):
                y[r, j] = shifted[r, j] / total
            for j in range(last, columns):
                y[r, j] = 0.0
            per_row[r] = total
        else:
            top = -np.inf
            for j in range(last):
                top = max(top, np.float64(x[r, j]))
            for j in range(last):
                shifted[r, j] = np.float64(x[r, j]) - top
            for j in range(last, columns):
                shifted[r, j] = 0.0
            per_row[r] = top


#: elements of the float64 rows exponentiated at a time: 512 KiB, which stay in the caches
#: between the passes and come from the heap every call, where a whole tensor's scratch is
#: mapped afresh and faults in its pages each time (as long again as the exponentials)
ROWS_BLOCK_ELEMENTS = 1 << 16


def softmax_rows(
    x: np.ndarray,
    y: np.ndarray,
    causal: bool = False,
    rows_per_matrix: int = 1,
    first_row: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """y = the softmax of each row of the matrix x (rows, columns), computed in float64 and
    stored in y's dtype; causal: of each row's columns j ≤ its row in its matrix (see
    `_row_pass`), the others 0. Returns each row's maximum and Σ exp(x − max), in float64.

    The exponentials are NumPy's, which run on the CPU's vector units (1 ns an element in
    float64 here), where Numba's loops call libm's scalar exp (7 ns an element a core): a block
    of shifted rows is written out, exponentiated in place, then summed and divided."""
    rows, columns = x.shape
    tops, totals = np.empty(rows, np.float64), np.empty(rows, np.float64)
    block = max(1, ROWS_BLOCK_ELEMENTS // max(columns, 1))
    shifted = np.empty((min(block, rows), columns), np.float64)
    for lo in range(0, rows, block):
        hi = min(rows, lo + block)
        part = shifted[: hi - lo]
        shape = (bool(causal), int(rows_per_matrix), int(first_row), lo)
        _row_pass(x[lo:hi], False, *shape, part, tops[lo:hi], y[lo:hi])
        np.exp(part, out=part)
        _row_pass(x[lo:hi], True, *shape, part, totals[lo:hi], y[lo:hi])
    return tops, totals


def _check(name: str, x: np.ndarray, labels: np.ndarray) -> None:
    _checks.floating(name, x, 4)
    if x.shape[2:] != (1, 1) or x.shape[1] < 1:
        raise ValueError(f"{name} must have shape (n, classes, 1, 1), got {x.shape}")
    _checks.labels("labels", labels, x.shape[0], x.shape[1])


def _check_total(batch_total: int, n: int) -> None:
    if int(batch_total) != batch_total or batch_total < max(n, 1):
        raise ValueError(f"batch_total must be an int >= the piece's batch {n}, got {batch_total}")


def softmax_forward(
    x: np.ndarray, labels: np.ndarray, batch_total: int
) -> tuple[np.ndarray, np.ndarray]:
    """(prob, loss): row softmax of logits x (n, classes, 1, 1) and this piece's share of the
    mean cross-entropy, shape (1, 1, 1, 1), both in x's dtype."""
    _check("x", x, labels)
    _check_total(batch_total, x.shape[0])
    n, classes = x.shape[:2]
    prob = np.empty(x.shape, x.dtype)
    tops, totals = softmax_rows(x.reshape(n, classes), prob.reshape(n, classes))
    picked = x.reshape(n, classes)[np.arange(n), labels.reshape(n)].astype(np.float64)
    losses = np.log(totals) - (picked - tops)
    loss = np.full((1, 1, 1, 1), losses.sum() / batch_total, x.dtype)
    return prob, loss


def softmax_backward(prob: np.ndarray, labels: np.ndarray, batch_total: int) -> np.ndarray:
    """dx = (prob − onehot(labels)) / batch_total, the gradient of the mean loss, computed in
    float64 and stored in prob's dtype."""
    _check("prob", prob, labels)
    _check_total(batch_total, prob.shape[0])
    dx = np.empty(prob.shape, prob.dtype)
    scale = 1.0 / batch_total
    for lo, hi, rows, y in _row_blocks(prob, labels):
        grad = rows.astype(np.float64)
        grad[np.arange(hi - lo), y] -= 1.0
        grad *= scale
        dx[lo:hi, :, 0, 0] = grad
    return dx


def evaluate_forward(prob: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Sums over the piece, shape (4, 1, 1, 1) float64: [Σ −log p[i, y_i], top-1 correct,
    top-min(5, classes) correct, sample count]."""
    _check("prob", prob, labels)
    stats = np.zeros(4, np.float64)
    top_k = min(TOP_K, prob.shape[1])
    tiny = np.finfo(prob.dtype).tiny
    columns = np.arange(prob.shape[1])
    for lo, hi, rows, y in _row_blocks(prob, labels):
        picked = rows[np.arange(hi - lo), y][:, None]
        # the classes ranked ahead of the label: larger, or as large at a lower index
        ahead = np.count_nonzero(
            (rows > picked) | ((rows == picked) & (columns < y[:, None])), axis=1
        )
        stats[0] -= np.log(np.maximum(picked[:, 0].astype(np.float64), tiny)).sum()
        stats[1] += np.count_nonzero(ahead < 1)
        stats[2] += np.count_nonzero(ahead < top_k)
    stats[3] = prob.shape[0]
    return stats.reshape(4, 1, 1, 1)


def _row_blocks(prob: np.ndarray, labels: np.ndarray):
    """(lo, hi, rows, labels) for blocks of `prob`'s rows (n, classes): the gradient and the
    statistics are a few NumPy passes over (rows, classes) each, whose temporaries a block of
    `ROWS_BLOCK_ELEMENTS` keeps in the caches however many rows a language model's piece has.
    NumPy rather than compiled loops: these passes are cheap beside the step, and two compiled
    loops were 0.35 s of every cold start."""
    n, classes = prob.shape[:2]
    targets = labels.reshape(n).astype(np.intp)
    block = max(1, ROWS_BLOCK_ELEMENTS // max(classes, 1))
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        yield lo, hi, prob[lo:hi, :, 0, 0], targets[lo:hi]


def accuracy(stats: np.ndarray) -> float:
    """Top-1 accuracy from (summed) evaluate statistics."""
    if not isinstance(stats, np.ndarray) or stats.size != 4:
        raise ValueError(f"stats must hold 4 values, got shape {np.shape(stats)}")
    flat = stats.reshape(4)
    if flat[3] <= 0:
        raise ValueError(f"stats sample count must be positive, got {flat[3]}")
    return float(flat[1] / flat[3])
