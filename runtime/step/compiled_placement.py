"""The step buffers' placement (`runtime.step.buffers._placement`) as a compiled scan, for
programs of many buffers: its own module, so that placing a few hundred buffers, or planning
alone, loads no Numba.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def first_fit(table, line, page, coloured_from, colour_step):
    """`_placement`'s starts and size by a scan, compiled: each slot (bytes, first, last), in
    order, past the placed slots live with it in order of offset, at the first gap that holds
    it (a coloured slot's offset rounded up to a page first). The placed slots are kept sorted
    by (offset, end)."""
    n = table.shape[0]
    placed = np.empty((n, 4), np.int64)  # offset, end, first, last
    starts = np.empty(n, np.int64)
    size, colour = 0, 0
    for k in range(n):
        nbytes, first, last = table[k, 0], table[k, 1], table[k, 2]
        coloured = nbytes >= coloured_from
        need = -(-nbytes // line) * line + (page if coloured else 0)
        offset = 0
        for j in range(k):  # the k slots placed so far
            if placed[j, 2] <= last and first <= placed[j, 3]:
                if coloured:
                    offset = -(-offset // page) * page
                if offset + need <= placed[j, 0]:
                    break
                offset = max(offset, placed[j, 1])
        if coloured:
            offset = -(-offset // page) * page
            starts[k] = offset + colour * colour_step * line % page
            colour += 1
        else:
            starts[k] = offset
        at = k
        while at > 0 and (
            placed[at - 1, 0] > offset
            or (placed[at - 1, 0] == offset and placed[at - 1, 1] > offset + need)
        ):
            placed[at] = placed[at - 1]
            at -= 1
        placed[at, 0], placed[at, 1], placed[at, 2], placed[at, 3] = (
            offset,
            offset + need,
            first,
            last,
        )
        size = max(size, offset + need)
    return starts, size
