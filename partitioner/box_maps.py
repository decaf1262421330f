"""Access maps over arrays of pieces, for the ops whose maps dominate planning at scale.

The layers' access maps (`legion_nn.access`) take one piece and build a `Rect` per role, some
5-10 µs a call; cutting vgg19's spaces for the search's grids at 1024 ranks calls them some
50,000 times even when probing (`pieces.py`). The functions here compute the same rects for
every piece of a grid at once, with NumPy, for `filter`/`conv`, `linear`, `maxpool` and the
elementwise ops and `set_zero` (whose maps are cheap, but called as often).

Each restates its layer's map over arrays (`lo`, `hi`: (n, ndim) int64, every piece non-empty)
and returns {role: (lo, hi)} for the roles asked for; a role's rect that is empty may come back
with any bounds (`pieces.py` zeroes them). They are an optimisation, never the definition:
`pieces.grid_pieces` checks their answer against the layer's own map on a sample of pieces and
probes instead where they differ, and `tests/test_box_maps.py` compares them on random pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from partitioner.boxes import INDEX

Boxes = tuple[np.ndarray, np.ndarray]
BoxMap = Callable[[Mapping[str, Any], Mapping[str, tuple[int, ...]], np.ndarray, np.ndarray], dict]

_TABLE: dict[tuple[str, str], BoxMap] = {}


def box_map(op: str, phase: str) -> BoxMap | None:
    """The array form of the access map of `op` in `phase`, if there is one."""
    return _TABLE.get((op, phase))


def _register(ops: tuple[str, ...], phases: tuple[str, ...]):
    def wrap(fn: BoxMap) -> BoxMap:
        for op in ops:
            for phase in phases:
                _TABLE[(op, phase)] = fn
        return fn

    return wrap


def window_spans(
    lo: np.ndarray, hi: np.ndarray, stride: int, pad: int, size: int, extent: int
) -> Boxes:
    """`legion_nn.access.window_span` of each (lo, hi): (0, 0) where nothing is read."""
    first = np.maximum(lo * stride - pad, 0)
    last = np.minimum((hi - 1) * stride - pad + size, extent)
    read = (hi > lo) & (first < last)
    return np.where(read, first, 0), np.where(read, last, 0)


def _columns(n: int, *columns) -> np.ndarray:
    """An (n, len(columns)) array from columns that are arrays of n or scalars."""
    out = np.empty((n, len(columns)), INDEX)
    for d, column in enumerate(columns):
        out[:, d] = column
    return out


@_register(("filter", "conv"), ("forward", "backward"))
def _filter_boxes(attrs, dims, lo, hi) -> dict[str, Boxes]:
    """`legion_nn.layers.filter._filter_rects`."""
    n = len(lo)
    _, c_in, h_in, w_in = dims["input"]
    kernel_r, kernel_s = attrs["kernel"]
    stride = attrs["stride"]
    top, _, left, _ = attrs["pad"]
    n0, k0, p0, q0 = lo.T
    n1, k1, p1, q1 = hi.T
    rows = window_spans(p0, p1, stride, top, kernel_r, h_in)
    cols = window_spans(q0, q1, stride, left, kernel_s, w_in)
    halo = (_columns(n, n0, 0, rows[0], cols[0]), _columns(n, n1, c_in, rows[1], cols[1]))
    if attrs["untied"]:
        pos_lo, pos_hi = (p0, q0), (p1, q1)
    else:
        pos_lo, pos_hi = (0, 0), (1, 1)
    c_lo, c_hi = attrs.get("channels") or (0, c_in)
    weights = (
        _columns(n, k0, 0, 0, 0, 0, 0, *pos_lo),
        _columns(n, k1, 1, 1, c_in, kernel_r, kernel_s, *pos_hi),
    )
    delta = (
        _columns(n, k0, 0, 0, c_lo, 0, 0, *pos_lo),
        _columns(n, k1, 1, 1, c_hi, kernel_r, kernel_s, *pos_hi),
    )
    bias = (_columns(n, 0, k0, 0, 0), _columns(n, 1, k1, 1, 1))
    found = {
        "input": halo,
        "filters": weights,
        "output": (lo, hi),
        "output.delta": (lo, hi),
        "input.delta": halo,
        "filters.delta": delta,
        "b": bias,
        "b.delta": bias,
    }
    return {role: found[role] for role in dims}


@_register(("linear",), ("forward", "backward"))
def _linear_boxes(attrs, dims, lo, hi) -> dict[str, Boxes]:
    """`legion_nn.layers.linear._linear_rects`."""
    n = len(lo)
    rest = dims["input"][1:]
    inputs = (_columns(n, lo[:, 0], *(0 for _ in rest)), _columns(n, hi[:, 0], *rest))
    m0, m1 = lo[:, 1], hi[:, 1]
    weights = (_columns(n, m0, 0, 0, 0), _columns(n, m1, *dims["weights"][1:]))
    bias = (_columns(n, 0, m0, 0, 0), _columns(n, 1, m1, 1, 1))
    found = {
        "input": inputs,
        "weights": weights,
        "b": bias,
        "output": (lo, hi),
        "output.delta": (lo, hi),
        "input.delta": inputs,
        "weights.delta": weights,
        "b.delta": bias,
    }
    return {role: found[role] for role in dims}


@_register(("maxpool",), ("forward", "backward"))
def _pool_boxes(attrs, dims, lo, hi) -> dict[str, Boxes]:
    """`legion_nn.layers.pool._pool_rects`."""
    n = len(lo)
    _, _, h_in, w_in = dims["input"]
    (kh, kw), (sh, sw) = attrs["kernel"], attrs["stride"]
    top, _, left, _ = attrs["pad"]
    rows = window_spans(lo[:, 2], hi[:, 2], sh, top, kh, h_in)
    cols = window_spans(lo[:, 3], hi[:, 3], sw, left, kw, w_in)
    halo = (
        _columns(n, lo[:, 0], lo[:, 1], rows[0], cols[0]),
        _columns(n, hi[:, 0], hi[:, 1], rows[1], cols[1]),
    )
    found = {"input": halo, "output": (lo, hi), "output.delta": (lo, hi), "input.delta": halo}
    return {role: found[role] for role in dims}


@_register(("filterNL", "dropout"), ("forward", "backward"))
def _elementwise_boxes(attrs, dims, lo, hi) -> dict[str, Boxes]:
    """`legion_nn.access.elementwise`: every role touches the piece."""
    roles = ("input", "output", "output.delta", "input.delta")
    found = {role: (lo, hi) for role in roles}
    return {role: found[role] for role in dims}


@_register(("set_zero",), ("set_zero",))
def _set_zero_boxes(attrs, dims, lo, hi) -> dict[str, Boxes]:
    """`legion_nn.layers.common_access._set_zero_rects`."""
    return {"output": (lo, hi)}
