"""The simulated step's wakes (`runtime.step.loop`): a binary min-heap of (time, rank), ordered by
time and then by the order the wakes were made, each rank's latest wake the live one. Compiled
without Numba's reference counting, as the loop's helpers are (`HELPER`).
"""

from __future__ import annotations

from numba import njit

#: how the loop's helpers are compiled: each once, cached, without reference counting (they
#: allocate nothing and hold no array beyond the call; see `runtime.step.loop`)
HELPER = njit(cache=True, _nrt=False)


@HELPER
def _before(time, order, a, b):
    return time[a] < time[b] or (time[a] == time[b] and order[a] < order[b])


@HELPER
def _swap(time, order, rank, a, b):
    time[a], time[b] = time[b], time[a]
    order[a], order[b] = order[b], order[a]
    rank[a], rank[b] = rank[b], rank[a]


@HELPER
def wake(heap, rank, at):
    """`_Simulator._wake`: one live wake per rank; superseded ones stay in the heap."""
    wake_at, state = heap[0], heap[4]
    if at < wake_at[rank]:
        wake_at[rank] = at
        n = state[0]
        if n >= len(heap[1]):
            raise RuntimeError("step simulation: event heap overflow")
        heap[1][n], heap[2][n], heap[3][n] = at, state[1], rank
        state[0] = n + 1
        state[1] += 1
        while n > 0:
            parent = (n - 1) // 2
            if _before(heap[1], heap[2], n, parent):
                _swap(heap[1], heap[2], heap[3], n, parent)
                n = parent
            else:
                break


@HELPER
def pop_earliest(heap):
    """The earliest wake (time, rank), by time and then the order they were made."""
    time, order, ranks, state = heap[1], heap[2], heap[3], heap[4]
    at, rank = time[0], ranks[0]
    n = state[0] - 1
    state[0] = n
    if n > 0:
        _swap(time, order, ranks, 0, n)
        i = 0
        while True:
            left = 2 * i + 1
            if left >= n:
                break
            child = left
            if left + 1 < n and _before(time, order, left + 1, left):
                child = left + 1
            if _before(time, order, child, i):
                _swap(time, order, ranks, child, i)
                i = child
            else:
                break
    return at, rank
