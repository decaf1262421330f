"""The `dropout` op: inverted dropout, keeping each element with probability 1 − ratio and
scaling the kept ones by 1 / (1 − ratio).

The mask is never stored and never drawn from a sequential generator. Whether an element is kept
is a pure function of (seed, step, the element's flat index in the *global* tensor): a piece at
`origin` of a tensor of `global_dims` maps its local index i to the global index origin + i, and
hashes that. So the forward and backward recompute the same mask without communicating, and any
partition of the tensor (by batch, channel or space, on any number of ranks) drops exactly the
elements the whole tensor would.

The hash is splitmix64 used as a counter-based generator: a stream key is mixed from the seed and
the step, element k takes the finaliser of key + (k + 1)·γ (γ the 64-bit golden ratio), and the
top 53 bits give a uniform u in [0, 1); the element is kept when u ≥ ratio. All arithmetic is
uint64 so it wraps rather than promoting to float inside Numba.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import prange

from runtime.kernels import _checks
from runtime.kernels.threaded import inner, threaded

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


@inner
def _mix(z):
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@inner
def _stream(seed, step):
    return _mix(_mix(seed + _GAMMA) ^ (step * _GAMMA))


@inner
def _uniform(key, index):
    h = _mix(key + (index + np.uint64(1)) * _GAMMA)
    return np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@threaded
def _apply(x, ratio, scale, seed, step, origin, dims, y):
    n, c, h, w = x.shape
    key = _stream(seed, step)
    zero = x.dtype.type(0)
    for nc in prange(n * c):
        i, j = nc // c, nc % c
        row = (origin[0] + i) * dims[1] + origin[1] + j
        for r in range(h):
            base = (row * dims[2] + origin[2] + r) * dims[3] + origin[3]
            for s in range(w):
                keep = _uniform(key, np.uint64(base + s)) >= ratio
                y[i, j, r, s] = x[i, j, r, s] * scale if keep else zero


def _run(
    name: str,
    x: np.ndarray,
    ratio: float,
    seed: int,
    step: int,
    origin: Sequence[int],
    global_dims: Sequence[int],
) -> np.ndarray:
    _checks.floating(name, x)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    origin, global_dims = tuple(origin), tuple(global_dims)
    if not 1 <= x.ndim <= 4 or len(origin) != x.ndim or len(global_dims) != x.ndim:
        raise ValueError(
            f"{name} shape {x.shape}, origin {origin} and global_dims {global_dims} "
            "must have the same rank, at most 4"
        )
    if any(o < 0 or o + e > d for o, e, d in zip(origin, x.shape, global_dims)):
        raise ValueError(
            f"{name} piece of shape {x.shape} at origin {origin} lies outside global_dims "
            f"{global_dims}"
        )
    if ratio == 0.0:
        return x.copy()
    # Leading unit axes make every piece 4-d without copying it.
    pad = 4 - x.ndim
    x4 = x.reshape((1,) * pad + x.shape)
    origin4 = np.array((0,) * pad + origin, np.int64)
    dims4 = np.array((1,) * pad + global_dims, np.int64)
    seed64, step64 = np.uint64(int(seed) & _MASK64), np.uint64(int(step) & _MASK64)
    y = np.empty(x4.shape, x.dtype)
    _apply(x4, float(ratio), x.dtype.type(1.0 / (1.0 - ratio)), seed64, step64, origin4, dims4, y)
    return y.reshape(x.shape)


def dropout_forward(
    x: np.ndarray,
    ratio: float,
    seed: int,
    step: int,
    origin: Sequence[int],
    global_dims: Sequence[int],
) -> np.ndarray:
    """y = x·mask / (1 − ratio) for the piece of a `global_dims` tensor that starts at `origin`."""
    return _run("x", x, ratio, seed, step, origin, global_dims)


def dropout_backward(
    dy: np.ndarray,
    ratio: float,
    seed: int,
    step: int,
    origin: Sequence[int],
    global_dims: Sequence[int],
) -> np.ndarray:
    """dx = dy·mask / (1 − ratio), with the mask of the forward of the same (seed, step)."""
    return _run("dy", dy, ratio, seed, step, origin, global_dims)
