"""Optimizer update kernels: SGD, momentum and Adam, applied in place.

Each `update_<layer>.<param>` task owns a piece of a parameter and the matching pieces of its
gradient and optimizer state, of any shape and either float dtype. The updates are elementwise, so
the Numba loops run over one flat index; a contiguous piece is flattened as a view (no copy, the
update lands in the caller's array), and a strided piece, such as a channel slice of a weight, is
walked one last-axis row at a time so that it is still updated in place. Scalars are float64 and
the arithmetic is done in float64, rounded once on store.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from runtime.kernels import _checks


@njit(cache=True, nogil=True, parallel=True)
def _sgd(p, g, lr):
    for k in prange(p.shape[0]):
        p[k] -= lr * g[k]


@njit(cache=True, nogil=True, parallel=True)
def _momentum(p, g, vel, lr, mu):
    for k in prange(p.shape[0]):
        v = mu * vel[k] - lr * g[k]
        vel[k] = v
        p[k] += v


@njit(cache=True, nogil=True, parallel=True)
def _adam(p, g, m, v, lr, beta1, beta2, eps, c1, c2):
    for k in prange(p.shape[0]):
        gk = np.float64(g[k])
        mk = beta1 * m[k] + (1.0 - beta1) * gk
        vk = beta2 * v[k] + (1.0 - beta2) * gk * gk
        m[k] = mk
        v[k] = vk
        p[k] -= lr * (mk / c1) / (np.sqrt(vk / c2) + eps)


def _rows(param: np.ndarray, others: dict[str, np.ndarray]) -> list[tuple[np.ndarray, ...]]:
    """Matching 1-d views of param and the other arrays that together cover every element."""
    _checks.floating("param", param)
    for name, a in others.items():
        _checks.floating(name, a)
        _checks.shape(name, a, param.shape)
        _checks.same_dtype(name, a, "param", param)
    arrays = (param, *others.values())
    if all(a.flags.c_contiguous for a in arrays):
        return [tuple(a.reshape(-1) for a in arrays)]
    if all(a.flags.f_contiguous for a in arrays):
        return [tuple(a.reshape(-1, order="F") for a in arrays)]
    return [tuple(a[idx] for a in arrays) for idx in np.ndindex(param.shape[:-1])]


def sgd_update(param: np.ndarray, grad: np.ndarray, lr: float) -> None:
    """param −= lr·grad, in place."""
    for p, g in _rows(param, {"grad": grad}):
        _sgd(p, g, float(lr))


def momentum_update(
    param: np.ndarray, grad: np.ndarray, velocity: np.ndarray, lr: float, momentum: float
) -> None:
    """velocity = momentum·velocity − lr·grad; param += velocity; both in place."""
    for p, g, vel in _rows(param, {"grad": grad, "velocity": velocity}):
        _momentum(p, g, vel, float(lr), float(momentum))


def adam_update(
    param: np.ndarray,
    grad: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
) -> None:
    """Adam with bias correction, in place on param, m and v; step counts from 1."""
    if int(step) != step or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"beta1 {beta1} and beta2 {beta2} must be in [0, 1)")
    c1 = 1.0 - float(beta1) ** int(step)
    c2 = 1.0 - float(beta2) ** int(step)
    for p, g, mm, vv in _rows(param, {"grad": grad, "m": m, "v": v}):
        _adam(p, g, mm, vv, float(lr), float(beta1), float(beta2), float(eps), c1, c2)
