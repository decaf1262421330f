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

TOP_K = 5


@njit(cache=True, nogil=True, parallel=True)
def _forward(x, labels, prob, losses):
    n, k = x.shape[0], x.shape[1]
    for i in prange(n):
        mx = np.float64(x[i, 0, 0, 0])
        for j in range(1, k):
            mx = max(mx, np.float64(x[i, j, 0, 0]))
        total = 0.0
        for j in range(k):
            total += np.exp(x[i, j, 0, 0] - mx)
        for j in range(k):
            prob[i, j, 0, 0] = np.exp(x[i, j, 0, 0] - mx) / total
        losses[i] = np.log(total) - (x[i, labels[i, 0, 0, 0], 0, 0] - mx)


@njit(cache=True, nogil=True, parallel=True)
def _backward(prob, labels, scale, dx):
    n, k = prob.shape[0], prob.shape[1]
    for i in prange(n):
        y = labels[i, 0, 0, 0]
        for j in range(k):
            p = np.float64(prob[i, j, 0, 0])
            dx[i, j, 0, 0] = (p - 1.0 if j == y else p) * scale


@njit(cache=True, nogil=True)
def _evaluate(prob, labels, top_k, tiny, stats):
    n, k = prob.shape[0], prob.shape[1]
    for i in range(n):
        y = labels[i, 0, 0, 0]
        py = prob[i, y, 0, 0]
        ahead = 0
        for j in range(k):
            pj = prob[i, j, 0, 0]
            if pj > py or (pj == py and j < y):
                ahead += 1
        stats[0] -= np.log(max(np.float64(py), tiny))
        stats[1] += 1.0 if ahead < 1 else 0.0
        stats[2] += 1.0 if ahead < top_k else 0.0
    stats[3] += n


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
    prob = np.empty(x.shape, x.dtype)
    losses = np.empty(x.shape[0], np.float64)
    _forward(x, labels, prob, losses)
    loss = np.full((1, 1, 1, 1), losses.sum() / batch_total, x.dtype)
    return prob, loss


def softmax_backward(prob: np.ndarray, labels: np.ndarray, batch_total: int) -> np.ndarray:
    """dx = (prob − onehot(labels)) / batch_total, the gradient of the mean loss."""
    _check("prob", prob, labels)
    _check_total(batch_total, prob.shape[0])
    dx = np.empty(prob.shape, prob.dtype)
    _backward(prob, labels, 1.0 / batch_total, dx)
    return dx


def evaluate_forward(prob: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Sums over the piece, shape (4, 1, 1, 1) float64: [Σ −log p[i, y_i], top-1 correct,
    top-min(5, classes) correct, sample count]."""
    _check("prob", prob, labels)
    stats = np.zeros(4, np.float64)
    top_k = min(TOP_K, prob.shape[1])
    _evaluate(prob, labels, top_k, float(np.finfo(prob.dtype).tiny), stats)
    return stats.reshape(4, 1, 1, 1)


def accuracy(stats: np.ndarray) -> float:
    """Top-1 accuracy from (summed) evaluate statistics."""
    if not isinstance(stats, np.ndarray) or stats.size != 4:
        raise ValueError(f"stats must hold 4 values, got shape {np.shape(stats)}")
    flat = stats.reshape(4)
    if flat[3] <= 0:
        raise ValueError(f"stats sample count must be positive, got {flat[3]}")
    return float(flat[1] / flat[3])
