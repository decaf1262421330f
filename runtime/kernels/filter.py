"""The `filter` op in the logical layouts: locally connected (untied) or convolutional (tied).

x is (N, C, H, W); w is (K, 1, 1, C, R, S, P, Q), untied when (P, Q) is the output size and
tied when P = Q = 1. Axes 1 and 2 of w are the unit axes of the seed's 8-D weight tensor; they
carry no data and anything but 1 is rejected. `pad` is an int or (top, bottom, left, right).

These functions convert to the packed layouts (`layout`), run the packed kernels
(`filter_packed`) and convert back: convenient and exact, but each call pays the layout
conversions, which for untied weights move as many bytes as the weights (large weights by
compiled transposes on all cores: 0.2 s each way for the seed's 585 MB of L1 weights, against
0.12 s for the weight gradient's kernel at batch 32). A caller that runs the kernels on the same
weights step after step reaches the kernels' own speed by keeping them packed, as the executor
does: pack once with `layout.pack_weights` and `layout.pack_activations`, then call
`filter_packed.forward_packed`, `backward_data_packed` and `backward_filter_packed(...,
out=dwp, accumulate=...)`, which take and return the packed layouts, and unpack only what is
read back (`layout.unpack_weights`).
"""

from __future__ import annotations

import numpy as np

from runtime.kernels.filter_packed import (
    backward_data_packed,
    backward_filter_packed,
    check_channels,
    forward_packed,
)
from runtime.kernels.geometry import Geometry, check_dtypes, check_ndim, make_geometry
from runtime.kernels.layout import (
    pack_activations,
    pack_weights,
    unpack_activations,
    unpack_weights,
)


def filter_geometry(x: np.ndarray, w: np.ndarray, stride: int = 1, pad=0) -> Geometry:
    """Validate logical x and w (ndim, unit axes, dtypes) and return their geometry."""
    check_ndim("x", x, 4, "(N, C, H, W)")
    check_ndim("w", w, 8, "(K, 1, 1, C, R, S, P, Q)")
    if w.shape[1:3] != (1, 1):
        raise ValueError(f"w: axes 1 and 2 must be unit axes, got shape {w.shape}")
    check_dtypes(x=x, w=w)
    k, _, _, c, r, s, p, q = w.shape
    return make_geometry(x.shape, (k, c, r, s, p, q), stride, pad)


def filter_forward(x: np.ndarray, w: np.ndarray, stride: int = 1, pad=0) -> np.ndarray:
    """y (N, K, P, Q) = the filter of x (N, C, H, W) by w (K, 1, 1, C, R, S, P|1, Q|1)."""
    geo = filter_geometry(x, w, stride, pad)
    yp = forward_packed(pack_activations(x), pack_weights(w), geo.stride, geo.pad)
    return unpack_activations(yp)


def filter_backward(
    dy: np.ndarray,
    x: np.ndarray,
    w: np.ndarray,
    stride: int = 1,
    pad=0,
    channels: tuple[int, int] | None = None,
    need_dx: bool = True,
) -> tuple[np.ndarray | None, np.ndarray]:
    """(dx, dw) for the incoming gradient dy (N, K, P, Q).

    dx is like x, or None when `need_dx` is false (then no dx work is done). dw is like w, or
    (K, 1, 1, hi−lo, R, S, P, Q) for `channels` = (lo, hi): only those input channels' weight
    gradient is computed.
    """
    geo = filter_geometry(x, w, stride, pad)
    check_ndim("dy", dy, 4, "(N, K, P, Q)")
    check_dtypes(dy=dy, x=x)
    if dy.shape != (geo.n, geo.k, geo.p, geo.q):
        raise ValueError(
            f"dy: expected (N, K, P, Q) = {(geo.n, geo.k, geo.p, geo.q)}, got shape {dy.shape}"
        )
    check_channels(channels, geo.c)
    dyp = pack_activations(dy)
    dx = None
    if need_dx:
        dxp = backward_data_packed(dyp, pack_weights(w), (geo.h, geo.w), geo.stride, geo.pad)
        dx = unpack_activations(dxp)
    dwp = backward_filter_packed(
        dyp, pack_activations(x), (geo.r, geo.s), geo.stride, geo.pad, geo.untied, channels
    )
    return dx, unpack_weights(dwp)
