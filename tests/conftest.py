"""The suite runs in two pytest-xdist workers (`-n 2` in pyproject's addopts) on the 2-core
machines it targets: most tests are one process compiling or running kernels, and two of them
run side by side. A test that starts MPI jobs, builds the emulated cluster or measures the
machine needs the machine to itself: its ranks want every core, and its measurements (a link's
rate, the network stack's CPU) and its time limits hold only on an idle machine. Such a test is
*serial*: it holds a lock exclusively, which every other test holds shared, so it waits for the
test running in the other worker and that worker waits for it, until the serial tests that
follow it in its worker are done.

A test is serial if its module is in `SERIAL_MODULES` or it is marked `serial`. With `-n 0`
every test runs in turn and the lock is never taken.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

#: modules whose every test starts MPI jobs or clusters, or measures the machine
SERIAL_MODULES = {
    "tests.runtime.test_distributed",
    "tests.runtime.test_cluster",
    "tests.runtime.test_conformance",
    "tests.runtime.test_supervisor",
    "tests.bench.test_machine",
    "tests.bench.test_kernels",
    "tests.bench.test_step",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "serial: the test needs the machine to itself (see tests/conftest.py)"
    )
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        _compile_kernels_ahead()


def _compile_kernels_ahead() -> None:
    """Every kernel unit's whole-tensor specialisations in both dtypes, with parallel and with
    plain loops, and the step simulator's compiled loop, compiled into Numba's cache before the
    workers start (`runtime.compile_ahead`, this process and a helper): on a cold cache each
    worker, and each rank a test launches,
    would otherwise compile the same kernels side by side. Nothing is compiled where the cache
    already holds them."""
    import numba
    import numpy as np

    from legion_nn.networks import load_network
    from partitioner.machine import Machine
    from partitioner.plan import build_plan
    from partitioner.strategy import builtin
    from runtime.aligned import LINE, PAGE
    from runtime.compile_ahead import compile_ahead
    from runtime.compile_units import UNITS, cached
    from runtime.step.buffers import COLOURED
    from runtime.step.compiled_placement import first_fit
    from runtime.step.prediction import predict_step, simulate_compiled

    # with one thread too: the plain loops that a rank of `mpiexec` on two cores and a short run
    # in one process call (`runtime.kernels.threaded`, `runtime.kernel_threads`)
    threads = numba.get_num_threads()
    for count in sorted({1, threads}):
        numba.set_num_threads(count)
        for dtype in ("float32", "float64"):
            if not cached(list(UNITS), dtype):
                compile_ahead(list(UNITS), dtype, helpers=1)
    numba.set_num_threads(threads)
    # and the step simulator's compiled loop and placement, which every partitioning test
    # calls (12 s of compiling on an empty cache)
    graph = load_network("seed-lcn-small").lower(batch=4)
    predict_step(graph, build_plan(graph, builtin(graph, "data", 2), 2), Machine(),
                 simulate=simulate_compiled)  # fmt: skip
    first_fit(np.zeros((1, 3), np.int64), LINE, PAGE, COLOURED, 1)


def _is_serial(item: pytest.Item) -> bool:
    return item.module.__name__ in SERIAL_MODULES or bool(item.get_closest_marker("serial"))


class _MachineLock:
    """A readers-writer lock over files shared by the workers of one run. A writer first takes
    the turnstile, which every reader passes through before taking the lock shared, so that a
    stream of readers in the other worker cannot starve it."""

    def __init__(self, run_id: str) -> None:
        base = Path(tempfile.gettempdir()) / f"legion-nn-tests-{run_id}"
        base.mkdir(exist_ok=True)
        self.turnstile = os.open(base / "turnstile", os.O_RDWR | os.O_CREAT, 0o600)
        self.lock = os.open(base / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        self.base = base

    def acquire(self, exclusive: bool) -> None:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def release(self) -> None:
        fcntl.flock(self.lock, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self.turnstile)
        os.close(self.lock)
        for name in ("turnstile", "lock"):
            (self.base / name).unlink(missing_ok=True)
        try:
            self.base.rmdir()
        except OSError:
            pass  # the other worker still has it open; the last to close removes it


_lock: _MachineLock | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _lock
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id and os.environ.get("PYTEST_XDIST_WORKER"):
        _lock = _MachineLock(run_id)


def pytest_sessionfinish(session: pytest.Session) -> None:
    global _lock
    if _lock is not None:
        _lock.close()
        _lock = None


#: this worker holds the lock exclusively from one serial test to the next
_held_for_next = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Each test holds the lock, shared or exclusively (`_is_serial`); a serial test followed by
    another keeps it for that one, so that a serial module runs through at once rather than
    one test at a time, each after one of the other worker's tests had run alone (one core
    idle)."""
    global _held_for_next
    if _lock is None:
        return (yield)
    serial = _is_serial(item)
    if not (_held_for_next and serial):
        _lock.acquire(exclusive=serial)
    try:
        return (yield)
    finally:
        _held_for_next = serial and nextitem is not None and _is_serial(nextitem)
        if not _held_for_next:
            _lock.release()
