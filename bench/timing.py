"""Timing a call as the benchmarks do: each of several calls' wall time, after an untimed one."""

from __future__ import annotations

import time
from collections.abc import Callable


def call_seconds(fn: Callable[[], object], repeat: int, warm: bool = True) -> list[float]:
    """The wall time of each of `repeat` calls, after one untimed call (compilation, page
    faults) unless `warm` is False (the caller made it)."""
    if warm:
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times
