"""Which input rows and columns a filter's window reaches, for the packed kernels
(`filter_packed`, `filter_one_example`): compiled inline into their loops."""

from __future__ import annotations

from numba import njit


@njit(cache=True, inline="always")
def clip(start, size, extent):
    """The part [lo, hi) of window offsets whose input index start + i is inside [0, extent)."""
    return max(0, -start), min(size, extent - start)


@njit(cache=True, inline="always")
def reading_row(row, r, pad_top, stride, p_out):
    """The output row whose window row `r` reads input row `row`, or -1 where none does."""
    t = row + pad_top - r
    if t < 0 or t % stride != 0 or t // stride >= p_out:
        return -1
    return t // stride


@njit(cache=True, inline="always")
def inside(offset, size, extent, stride, positions):
    """The positions [lo, hi) whose window element `offset` (padding `size` before the input)
    falls inside the input: 0 <= i·stride + offset − size < extent."""
    lo = max(0, -((offset - size) // stride))
    hi = min(positions, (extent - 1 + size - offset) // stride + 1)
    return lo, max(lo, hi)
