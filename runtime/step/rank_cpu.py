"""A rank's CPU work in a simulated step beyond its tasks' given seconds: the rules both step
simulators (`runtime.step.simulator`, and the compiled loop of `runtime.step.loop`, which follows
them point for point) price it by.

- Ranks beyond their host's cores time-share them: all of a rank's CPU work takes 1/share as
  long (`cpu_slowdown`).
- A kernel, and the rank's own passes over its buffers around it (which the runtime makes with
  its progress thread on, as it runs its kernels: `RankStep.task`), share the core with the
  network stack's work for the bytes crossing between hosts meanwhile (`sharing_core`).
- Meanwhile the rank's messages between hosts move at most the rate its progress thread moves
  them (`held_spread`, `held_back`).
- Where a kernel and its passes are stretched as one, the kernel's part of the time they took
  is its part of their seconds (`kernel_share`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from partitioner.machine import Machine


def cpu_slowdown(
    machine: Machine, programs: Iterable[int], nranks: int | None = None
) -> dict[int, float]:
    """Per rank of `programs` (or any ranks) of a step on `nranks` ranks (default: one past the
    last of them), how much longer its CPU work (posting, packing, adding, the network
    stack's) takes than with its cores to itself: 1 / `Machine.core_share`, as its compute
    (`cost.compute_per_rank`) is priced."""
    ranks = list(programs)
    share = machine.core_share(max(ranks, default=0) + 1 if nranks is None else nranks)
    return {rank: 1.0 / float(share[rank]) for rank in ranks}


def sharing_core(seconds: float, cpu: float, wire: Sequence[tuple[float, float, int]]) -> float:
    """How long `seconds` of compute take beside transfers that take `cpu` seconds of the same
    core per byte: the least s with s = seconds + cpu × (the bytes on the wire in [0, s]), each
    transfer (start, end, bytes), relative to the compute's start, moving its bytes evenly.
    The bytes that cross while the stack stretches the compute cost the core too, so where the
    transfers would take the whole core (cpu × their rate ≥ 1) the compute waits for them."""
    if seconds == 0.0:
        return 0.0  # no kernel runs: the stack has the core
    points = sorted({0.0, *(max(a, 0.0) for a, _, _ in wire), *(max(b, 0.0) for _, b, _ in wire)})
    moved = 0.0  # bytes on the wire in [0, low]
    for low, high in itertools.pairwise(points):
        rate = sum(n / (b - a) for a, b, n in wire if a <= low and b >= high and b > a)
        # on [low, high] the bytes grow at `rate`: s = seconds + cpu * (moved + rate * (s - low))
        if cpu * rate < 1.0:
            found = (seconds + cpu * (moved - rate * low)) / (1.0 - cpu * rate)
            if found <= high:
                return found
        moved += rate * (high - low)
    return seconds + cpu * moved


# The three below are also compiled, as they stand, for the compiled loop (`runtime.step.loop`):
# both simulators hold a message back, and share out a stretch, by the same arithmetic.


def held_spread(
    start: float, end: float, nbytes: int, begin: float, rate: float, free: float
) -> tuple[float, float, float]:
    """How a transfer moving `nbytes` evenly from `start` to `end` crosses from `begin` on while
    the rank it goes to computes: its first `free` bytes left at `begin` at its own speed (what
    the sockets' buffers take at once), the rest at `rate` bytes a second at most (0: no limit).
    (start, end, bytes) relative to `begin`, what is left at `begin` spread evenly over that
    time (`sharing_core`'s wire). A transfer that is slower anyway crosses as it would."""
    at = max(start, begin)
    if rate <= 0.0 or nbytes <= 0 or end <= at or rate * (end - start) >= nbytes:
        return start - begin, end - begin, float(nbytes)
    left = nbytes * (end - at) / (end - start)
    if left <= free:
        return start - begin, end - begin, float(nbytes)
    speed = nbytes / (end - start)
    return at - begin, at - begin + free / speed + (left - free) / rate, left


def held_back(
    start: float, end: float, nbytes: int, begin: float, until: float, rate: float, free: float
) -> float:
    """When a transfer moving `nbytes` evenly from `start` to `end` ends where, from `begin` to
    `until` (a kernel where it goes), its first `free` bytes left at `begin` move at its own
    speed and the rest at `rate` bytes a second at most, and after `until` at its own speed
    again."""
    at = max(start, begin)
    if rate <= 0.0 or nbytes <= 0 or end <= at or rate * (end - start) >= nbytes:
        return end
    speed = nbytes / (end - start)
    at = at + free / speed  # the free bytes through
    if until <= at or end <= at:
        return end
    keep = rate / speed  # the share of its own speed it keeps
    if at + (end - at) / keep <= until:
        return at + (end - at) / keep
    return until + (end - at) - keep * (until - at)


def kernel_share(took: float, part: float, whole: float) -> float:
    """The part of `took` seconds (`whole` seconds of CPU work, stretched) that `part` of them
    took: in proportion, and exactly `took` where the part is the whole."""
    return took if part == whole else took * part / whole
