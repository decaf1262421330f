"""Timing a call as the benchmarks do: each of several calls' wall time, after an untimed one."""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import pairwise


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


def ceilings_beside(measured_around: list[float]) -> list[float]:
    """For each of n timings made between n + 1 measurements of the machine's ceiling (an
    SGEMM's rate before the first, then after each), the faster of the two beside it: a shared
    machine's speed moves between seconds, and a rate set against a ceiling caught at another
    moment says little of how near it ran to what the machine could do then."""
    return [max(before, after) for before, after in pairwise(measured_around)]
