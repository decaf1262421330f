"""Helper processes that compile a run's kernels beside it (`runtime.compile_ahead`).

This module imports neither Numba nor the kernels, so that a one-process run can start its
helpers first thing, before it imports them itself: the helpers then import on the spare cores
while the run imports, loads its data and plans (importing the kernels' modules is 0.3 s of the
default job's cold start, which had delayed its helper by as much). Where Numba's cache already
holds the run's kernels the helpers are not started at all (`cache_may_be_warm`): importing
beside the run slowed its own imports by 0.04-0.08 s.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

#: seconds a helper process takes to start and import the kernels' modules before it compiles
#: (0.45-0.5 s on the 2-core AMD EPYC VM; `compile_ahead.assign` gives its share that much late)
HELPER_START_S = 0.5
#: the argument that starts a helper waiting for its share on stdin (`Helpers`)
WAIT = "--wait"
#: the source of the kernel whose cache entry tells a warm cache (`compile_ahead.cache_is_cold`'s
#: probe, the linear layer's product, which almost every network calls), and its twins' names
PROBE_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "linear.py")
PROBE_NAMES = ("linear._tiled_product-", "linear._tiled_product_serial-")


def probe_cache_folders() -> list[Path]:
    """Where Numba keeps the cache of the probe's module, in the order of its locators
    (`numba.core.caching`): `NUMBA_CACHE_DIR`'s folder for the module's folder where that is
    set, else the module's `__pycache__`, or the user-wide cache where that is not writable."""
    folder = os.path.dirname(PROBE_SOURCE)
    subpath = f"{os.path.basename(folder)}_{hashlib.sha1(folder.encode()).hexdigest()}"
    given = os.environ.get("NUMBA_CACHE_DIR")
    if given:
        return [Path(given) / subpath]
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [Path(folder) / "__pycache__", user / "numba" / subpath]


def cache_may_be_warm() -> bool:
    """Whether Numba's cache holds an index for either twin of the probe, told from the files'
    names alone, before Numba is imported. An index whose source has changed since, or that
    holds another dtype, looks warm here: the run then starts its helpers when it knows its
    shares (`compile_ahead.cache_is_cold` decides), a little later than it could have."""
    suffix = f".py{sys.version_info[0]}{sys.version_info[1]}.nbi"
    for folder in probe_cache_folders():
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        if any(name.startswith(PROBE_NAMES) and name.endswith(suffix) for name in names):
            return True
    return False


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
