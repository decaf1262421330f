"""Per-channel kernels over image activations (N, C, H, W): `channel_affine`, `channel_shuffle`.

`channel_affine`: y = x·scale[c] + shift[c] with `scale` and `shift` of shape (1, C, 1, 1) (or
(C,)). On a block of the batch, rows or columns the backward returns that block's part of
dscale = Σ dy·x and dshift = Σ dy; the runtime adds the blocks' parts, so each part is
accumulated in float64 and rounded to the input dtype once. Products of float32 values are exact
in float64, so in float32 the only roundings are the float64 sum's and that last one.

`channel_shuffle`: output channel c' = j·g + i takes input channel i·(C/g) + j (i = c' mod g,
j = c' div g), ShuffleNet's reshape, transpose and reshape. It moves values and computes none,
so NumPy is the kernel: a whole tensor by the definition (reshape, transpose, reshape), the
backward by its inverse, the shuffle with C/g groups; a piece by `gather_channels`, given the
channels it takes (`legion_nn.layers.channel.shuffle_sources`, which its access map reads too)
and where the block its view holds starts.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from runtime.kernels import _checks
from runtime.kernels.threaded import threaded


@threaded
def _affine_forward(x, scale, shift, y):
    n, c, h, w = x.shape
    for nc in prange(n * c):
        i, k = nc // c, nc % c
        s, b = scale[k], shift[k]
        for r in range(h):
            for q in range(w):
                y[i, k, r, q] = x[i, k, r, q] * s + b


@threaded
def _affine_backward(dy, x, scale, need_dx, dx, dscale_parts, dshift_parts):
    n, c, h, w = dy.shape
    # One (sample, channel) plane per iteration, each writing its own entry of the float64
    # partial sums: no races, and parallel even where C alone is too few to fill the cores.
    for nc in prange(n * c):
        i, k = nc // c, nc % c
        s = scale[k]
        acc_scale = 0.0
        acc_shift = 0.0
        for r in range(h):
            for q in range(w):
                g = dy[i, k, r, q]
                acc_scale += np.float64(g) * np.float64(x[i, k, r, q])
                acc_shift += np.float64(g)
                if need_dx:
                    dx[i, k, r, q] = g * s
        dscale_parts[i, k] = acc_scale
        dshift_parts[i, k] = acc_shift


def _per_channel(name: str, a: np.ndarray, channels: int, dtype: np.dtype) -> np.ndarray:
    """A (1, C, 1, 1) or (C,) parameter as a contiguous (C,) array of the activations' dtype."""
    _checks.floating(name, a)
    if a.shape not in ((channels,), (1, channels, 1, 1)):
        raise ValueError(f"{name} must have shape (1, {channels}, 1, 1), got {a.shape}")
    return np.ascontiguousarray(a.reshape(channels), dtype=dtype)


def channel_affine_forward(
    x: np.ndarray, scale: np.ndarray, shift: np.ndarray | None = None
) -> np.ndarray:
    """y = x·scale[c] + shift[c] for x (N, C, H, W); no shift where `shift` is None."""
    _checks.floating("x", x, 4)
    c = x.shape[1]
    s = _per_channel("scale", scale, c, x.dtype)
    b = np.zeros(c, x.dtype) if shift is None else _per_channel("shift", shift, c, x.dtype)
    y = np.empty(x.shape, x.dtype)
    _affine_forward(x, s, b, y)
    return y


def channel_affine_backward(
    dy: np.ndarray, x: np.ndarray, scale: np.ndarray, need_dx: bool = True
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(dx, dscale, dshift): dx = dy·scale[c] (None unless need_dx); dscale = Σ dy·x and
    dshift = Σ dy over samples, rows and columns, in `scale`'s shape and dy's dtype."""
    _checks.floating("dy", dy, 4)
    _checks.like("x", x, "dy", dy)
    n, c = dy.shape[:2]
    s = _per_channel("scale", scale, c, dy.dtype)
    dx = np.empty(dy.shape if need_dx else (0, 0, 0, 0), dy.dtype)
    dscale_parts = np.zeros((n, c), np.float64)
    dshift_parts = np.zeros((n, c), np.float64)
    _affine_backward(dy, x, s, bool(need_dx), dx, dscale_parts, dshift_parts)
    dscale = dscale_parts.sum(axis=0).astype(dy.dtype).reshape(scale.shape)
    dshift = dshift_parts.sum(axis=0).astype(dy.dtype).reshape(scale.shape)
    return (dx if need_dx else None), dscale, dshift


def _check_groups(channels: int, groups: int) -> None:
    whole = isinstance(groups, (int, np.integer)) and not isinstance(groups, bool)
    if not whole or groups < 1 or channels % groups:
        raise ValueError(
            f"groups must be a positive int dividing the {channels} channels, got {groups!r}"
        )


def gather_channels(a: np.ndarray, wanted: np.ndarray, a_first: int = 0) -> np.ndarray:
    """Channels `wanted` of a tensor, in that order, from `a`, its block of channels starting at
    `a_first`: a piece of a shuffle (or of its gradient) from the block its view holds."""
    _checks.floating("a", a, 4)
    local = np.asarray(wanted, np.int64) - a_first
    if local.size and (local.min() < 0 or local.max() >= a.shape[1]):
        raise ValueError(
            f"a holds channels [{a_first}, {a_first + a.shape[1]}), which lack some of "
            f"[{int(local.min()) + a_first}, {int(local.max()) + a_first + 1})"
        )
    return np.take(a, local, axis=1)


def _shuffled(a: np.ndarray, groups: int) -> np.ndarray:
    """ShuffleNet's definition: (N, g, C/g, H, W), the two group axes swapped, (N, C, H, W)."""
    n, channels, height, width = a.shape
    _check_groups(channels, groups)
    grouped = a.reshape(n, groups, channels // groups, height, width)
    return np.ascontiguousarray(grouped.transpose(0, 2, 1, 3, 4)).reshape(a.shape)


def channel_shuffle_forward(x: np.ndarray, groups: int) -> np.ndarray:
    """The shuffle of x (N, C, H, W) with `groups` groups."""
    _checks.floating("x", x, 4)
    return _shuffled(x, groups)


def channel_shuffle_backward(dy: np.ndarray, groups: int) -> np.ndarray:
    """The input gradient of the shuffle with `groups` groups, given its output gradient."""
    _checks.floating("dy", dy, 4)
    _check_groups(dy.shape[1], groups)
    return _shuffled(dy, dy.shape[1] // groups)
