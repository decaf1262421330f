"""The settings a step's kernels run under, entered once a step (by the executor) rather than
once a kernel: every BLAS library on one thread (`blas.kernel_threading`) and denormals
flushed (`denormals.flushing_denormals`). The profiler (`bench.task_profile`) and the linear
benchmarks time their kernels under the same."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from runtime.kernels.blas import kernel_threading
from runtime.kernels.denormals import flushing_denormals


@contextmanager
def step_kernel_settings() -> Iterator[None]:
    """Enter both settings; leave both as they were."""
    with kernel_threading(), flushing_denormals():
        yield
