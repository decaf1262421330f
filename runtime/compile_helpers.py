"""Helper processes that compile a run's kernels beside it (`runtime.compile_ahead`).

This module imports neither Numba nor the kernels, so that a one-process run can start its
helpers first thing, before it imports them itself: the helpers then import on the spare cores
while the run imports, loads its data and plans (importing the kernels' modules is 0.3 s of the
default job's cold start, which had delayed its helper by as much).
"""

from __future__ import annotations

import subprocess
import sys
import time

#: seconds a helper process takes to start and import the kernels' modules before it compiles
#: (0.45-0.5 s on the 2-core AMD EPYC VM; `compile_ahead.assign` gives its share that much late)
HELPER_START_S = 0.5
#: the argument that starts a helper waiting for its share on stdin (`Helpers`)
WAIT = "--wait"


class Helpers:
    """Helper processes started before a run knows what it compiles (`python -m
    runtime.compile_ahead --wait`): each imports the kernels' modules meanwhile, then compiles
    the share it reads on its stdin (`give`), or exits on an empty line. Leaving the block ends
    every one still running, whatever happened in it; so does `close`, after which there are
    none."""

    def __init__(self, count: int) -> None:
        self.started = time.monotonic()
        self.processes = [
            subprocess.Popen(
                [sys.executable, "-m", "runtime.compile_ahead", WAIT],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for _ in range(count)
        ]

    def __len__(self) -> int:
        return len(self.processes)

    def __enter__(self) -> Helpers:  # noqa: PYI034 (Python 3.10 has no typing.Self)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def starting_for(self) -> float:
        """Seconds the helpers may still spend importing (`HELPER_START_S` since they began)."""
        return max(HELPER_START_S - (time.monotonic() - self.started), 0.0)

    def give(self, orders: list[str]) -> list[subprocess.Popen]:
        """Each helper its order, a line `DTYPE THREADS UNIT...` (`compile_ahead.main`); an
        empty one ends its helper. The helpers given work."""
        busy = []
        for process, order in zip(self.processes, orders):
            try:
                process.stdin.write(order + "\n")
                process.stdin.close()
            except OSError:  # it has died: the run compiles that share when it calls it
                continue
            if order:
                busy.append(process)
        return busy

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            if process.stdin is not None and not process.stdin.closed:
                try:
                    process.stdin.close()
                except OSError:
                    pass
        self.processes = []
