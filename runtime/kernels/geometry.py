"""Shapes of a filter (locally connected or convolutional) layer, validated once.

A `Geometry` is the plain description shared by the logical-layout API, the packed kernels and
the NumPy references: batch N, C input channels of H×W, K output channels of P×Q, an R×S
window, a stride and a (top, bottom, left, right) zero padding. Padding is asymmetric because
the runtime runs kernels on pieces of a tensor: a piece on the image border is padded on that
side only and its other sides read halo rows of real data.

A weight tensor holds one R×S×C window per output channel and per weight position. It is
untied (locally connected) when its positions are the P×Q output positions, tied (an ordinary
convolution) when it has a single position; both readings agree when the output is 1×1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Pad = tuple[int, int, int, int]

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def normalize_pad(pad: int | tuple[int, ...]) -> Pad:
    """An int (all sides) or a 4-tuple (top, bottom, left, right) of non-negative ints."""
    values = (pad,) * 4 if isinstance(pad, (int, np.integer)) else tuple(pad)
    if len(values) != 4 or not all(isinstance(v, (int, np.integer)) and v >= 0 for v in values):
        raise ValueError(f"pad: expected an int or (top, bottom, left, right) >= 0, got {pad!r}")
    return tuple(int(v) for v in values)


def normalize_stride(stride: int) -> int:
    if not isinstance(stride, (int, np.integer)) or stride < 1:
        raise ValueError(f"stride: expected a positive int, got {stride!r}")
    return int(stride)


def check_dtypes(**arrays: np.ndarray) -> np.dtype:
    """The common float dtype of the named arrays; a ValueError names the odd one out."""
    first = None
    for name, array in arrays.items():
        if array.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {array.dtype} is not float32 or float64")
        if first is not None and array.dtype != first[1]:
            raise ValueError(f"{name}: dtype {array.dtype} differs from {first[0]}'s {first[1]}")
        first = first or (name, array.dtype)
    return first[1]


def check_ndim(name: str, array: np.ndarray, ndim: int, layout: str) -> None:
    if array.ndim != ndim:
        raise ValueError(f"{name}: expected {layout}, got shape {array.shape}")


@dataclass(frozen=True)
class Geometry:
    n: int
    c: int
    h: int
    w: int
    k: int
    r: int
    s: int
    p: int
    q: int
    stride: int
    pad: Pad
    untied: bool

    @property
    def flops(self) -> int:
        """Multiply-adds times two of one pass (forward, backward-data or backward-filter)."""
        return 2 * self.n * self.k * self.c * self.r * self.s * self.p * self.q

    @property
    def weight_positions(self) -> tuple[int, int]:
        return (self.p, self.q) if self.untied else (1, 1)


def make_geometry(
    x_dims: tuple[int, int, int, int],
    w_dims: tuple[int, int, int, int, int, int],
    stride: int,
    pad: int | tuple[int, ...],
    x_name: str = "x",
    w_name: str = "w",
) -> Geometry:
    """Validate x as (N, C, H, W) and w as (K, C, R, S, Pw, Qw) sizes; shapes in messages."""
    stride, pad = normalize_stride(stride), normalize_pad(pad)
    n, c, h, w = (int(d) for d in x_dims)
    k, wc, r, s, wp, wq = (int(d) for d in w_dims)
    if wc != c:
        raise ValueError(f"{w_name}: has {wc} input channels but {x_name} has {c}")
    if r < 1 or s < 1:
        raise ValueError(f"{w_name}: window {r}x{s} is empty")
    p = (h + pad[0] + pad[1] - r) // stride + 1
    q = (w + pad[2] + pad[3] - s) // stride + 1
    if p < 1 or q < 1:
        raise ValueError(f"{w_name}: window {r}x{s} does not fit input {h}x{w} padded by {pad}")
    if (wp, wq) not in ((p, q), (1, 1)):
        raise ValueError(
            f"{w_name}: weight positions {wp}x{wq} are neither the output {p}x{q} (untied) "
            "nor 1x1 (tied)"
        )
    return Geometry(n, c, h, w, k, r, s, p, q, stride, pad, untied=(wp, wq) != (1, 1))
