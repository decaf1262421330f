"""Keeping Python's cycle collector off the large heaps that planning builds.

Planning a step (the search's tables, a plan's pieces, every rank's program and the simulator's
instructions) allocates some 10⁵ to 10⁶ rects, dicts and tuples and keeps most of them alive
until it is done; none forms a reference cycle, yet each allocation burst makes the collector walk
everything alive (a tenth of `partition`'s time on DenseNet-121's 64 ranks). Work that ends, like
one planning command (`cli.main.PAUSES_COLLECTION`), pauses it and resumes it after. A training
job is paused while it starts (the imports, Numba's kernels, the plan and the rank's program,
kept to its end: two full collections of 25–40 ms a rank in the default job) and collects as
usual while it steps, the steps' garbage being what there is to collect, with what start-up made
frozen out of the way (`collecting_past_setup`).

Two walks would remain: the first collection after the pause, whose youngest generation holds
everything the work allocated, and the interpreter's collections at exit, over everything still
alive. Each took 0.3 s of the 2.1 s that `partition` needs for ResNet-18 on 64 ranks.
`no_cycle_collection` ages what the work leaves alive into the oldest generation as it resumes
(`gc.freeze` then `gc.unfreeze`: moved, and the young count reset), where it is walked only by a
full collection, as any long-lived object is; `skip_collection_at_exit` leaves what a command
leaves alive to the end of its process.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Cycle collection paused inside, and resumed after where it was on, with what the work
    left alive in the oldest generation."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


@contextmanager
def collecting_past_setup() -> Iterator[None]:
    """Cycle collection on inside, with every object alive on entry (a run's setup, kept to its
    end) exempt from its walks (`gc.freeze`) until the block ends; then as it was before."""
    enabled = gc.isenabled()
    gc.freeze()
    gc.enable()
    try:
        yield
    finally:
        if not enabled:
            gc.disable()
        gc.unfreeze()


def skip_collection_at_exit() -> None:
    """Exempt every object alive now from the collections the interpreter runs as it exits.
    Only for a process about to end: a cycle among them is never collected. Python does not
    promise to finalize what is alive at exit (the data model's `__del__`), so nothing the
    project cleans up relies on it: temporary files, namespaces and MPI end through `atexit`
    and context managers, which still run."""
    gc.freeze()
