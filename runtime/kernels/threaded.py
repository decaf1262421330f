"""Kernels whose loops run across Numba's threads (`prange`), compiled twice: as parallel loops,
and as plain ones for a caller that has one thread.

A rank under `mpiexec` on a host with as many cores as ranks runs on one thread. Numba's
parallel loops still cost it their compile (each `prange` loop is outlined and compiled again
for the threading layer): the default job under `mpiexec -n 2` took 12.0-13.5 s on an empty
cache with parallel loops and 8.2-9.0 s with plain ones, its warm runs alike (4.0-4.4 s). Run on
one thread the two compile the same arithmetic in the same order (a parallel loop on one
thread takes the whole range as one chunk), so a result does not depend on which one ran
(`tests/runtime/kernels/test_threaded.py`, a loop whose sums LLVM may reassociate among them).

Each twin has a cache entry of its own: Numba names one by the function's qualified name, so
the plain loops' copy of the function is named `<name>_serial`.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numba
from numba import njit


class ThreadedKernel:
    """A kernel called from Python that runs its parallel loops where the caller has more
    than one Numba thread (`numba.get_num_threads`, which `runtime.launch` sets per rank) and
    its plain loops where it has one."""

    __slots__ = ("parallel", "serial")

    def __init__(self, fn: Callable, options: dict[str, Any]) -> None:
        self.parallel = njit(cache=True, nogil=True, parallel=True, **options)(fn)
        twin = types.FunctionType(
            fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        twin.__qualname__ = f"{fn.__qualname__}_serial"
        twin.__module__ = fn.__module__
        twin.__doc__ = fn.__doc__
        self.serial = njit(cache=True, nogil=True, **options)(twin)

    def current(self):
        """The dispatcher a call from this thread runs."""
        return self.serial if numba.get_num_threads() == 1 else self.parallel

    def __call__(self, *args):
        return self.current()(*args)


def threaded(fn: Callable | None = None, **options: Any):
    """Decorator, bare or with `njit` options (`fastmath`): `fn` as a `ThreadedKernel`.

    Only for kernels called from Python: jitted code calls dispatchers, not this object."""
    if fn is None:
        return lambda f: ThreadedKernel(f, options)
    return ThreadedKernel(fn, options)
