"""Pausing Python's cycle collector around work that allocates many small objects and keeps them.

Planning a step (the search's tables, a plan's pieces, every rank's program and the simulator's
instructions) allocates some 10⁵ to 10⁶ rects, dicts and tuples and keeps most of them alive
until it is done; none forms a reference cycle, yet each allocation burst makes the collector walk
everything alive (a tenth of `partition`'s time on DenseNet-121's 64 ranks). Work that ends, like
one `partition` command, pauses it and resumes it after; a training run does not.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Cycle collection paused inside, and resumed after where it was on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
