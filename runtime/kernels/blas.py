"""The BLAS thread policy of the kernels, and the transpose flags of the linear products.

No kernel calls BLAS: the filter and linear products run on `microkernel`'s GEMM on Numba's
threads. A process that also calls NumPy's BLAS around the steps (a caller's own code, the
benchmarks' ceilings) has BLAS's threads in the mix, and each pool's workers spin-wait for a
while after their work and starve the other's: on 2 cores, alternating a NumPy matmul with a
Numba parallel loop measured 8.8 ms a round against 0.06 ms for the same work on one pool.

`kernel_threading()` pins every BLAS library in the process to one thread while a kernel runs
(about 12 µs to enter) and restores the previous setting when the outermost one exits. It is
re-entrant and shared by threads, so an executor can hold it for a whole step and the kernels'
own entries inside cost nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

NO_TRANS = np.int8(ord("N"))
TRANS = np.int8(ord("T"))


class _Pinning:
    """Process-wide, re-entrant: BLAS pinned to one thread while any holder is inside."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.controller = None
        self.restore = None

    def enter(self) -> None:
        with self.lock:
            if self.depth == 0:
                if self.controller is None:
                    from threadpoolctl import ThreadpoolController

                    self.controller = ThreadpoolController().select(user_api="blas")
                self.restore = self.controller.limit(limits=1)
            self.depth += 1

    def exit(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                restore, self.restore = self.restore, None
                restore.restore_original_limits()


_pinning = _Pinning()


@contextmanager
def kernel_threading() -> Iterator[None]:
    """Run the enclosed kernels (or a whole step) with every BLAS library on one thread."""
    _pinning.enter()
    try:
        yield
    finally:
        _pinning.exit()
