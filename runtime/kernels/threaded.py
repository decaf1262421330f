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

A function that only other kernels call is compiled as an `inner` one: without the wrappers
through which Python and C would call it (`no_cpython_wrapper`, `no_cfunc_wrapper`). The
default job's four (the filter gradient's block and step, the GEMM's address, the sigmoid) took
3.9-4.5 s to compile with its other kernels on one thread, 3.6-4.1 s without their wrappers.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numba
from numba import njit
from numba.core.registry import CPUDispatcher


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


class InnerKernel(CPUDispatcher):
    """A function compiled for calls from other kernels only (`inner`). Its code has no
    wrapper to take Python's arguments, so a call from Python raises TypeError here rather than
    running it on them (which ends the process)."""

    def __call__(self, *args, **kwargs):
        raise TypeError(
            f"{self.py_func.__qualname__} is compiled for calls from other kernels only"
        )


def inner(fn: Callable | None = None, **options: Any):
    """Decorator, bare or with `njit` options: `fn` compiled (cached, without the GIL) for
    calls from other kernels only, as an `InnerKernel`."""

    def compile_inner(f: Callable):
        if numba.config.DISABLE_JIT:  # as `njit` does
            return f
        targetoptions = {"nogil": True, "no_cpython_wrapper": True, "no_cfunc_wrapper": True}
        kernel = InnerKernel(py_func=f, locals={}, targetoptions={**targetoptions, **options})
        kernel.enable_caching()
        return kernel

    return compile_inner if fn is None else compile_inner(fn)
