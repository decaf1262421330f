"""Numba kernels: NumPy arrays in, NumPy arrays out; no graph or MPI imports.

`filter` and `conv` take the logical layouts of the design; `filter_packed` and the `*_packed`
functions of `conv` run on the packed layouts of `layout`, which an executor keeps
across training steps. `reference` holds the plain NumPy oracles.

Importing them changes no environment: the `legion-nn` command bounds how long idle OpenMP and
OpenBLAS threads spin in its process (`cli.main.quiet_idle_threads` says why).
"""

import hashlib
import os
from pathlib import Path


def _drop_stale_caches() -> None:
    """Remove the kernels' Numba caches when any kernel's source has changed since they were
    written. Numba checks only the cached function's own file, but a kernel inlines compiled
    functions of other files (`update.step_elements` into the filter and linear kernels): after
    an edit there, the cache would keep running the old arithmetic. Caches that cannot be
    removed (a read-only install) stand, and a cache kept under the user's `NUMBA_CACHE_DIR`
    is not looked at (`bench/cold_start.py` gives each run a new one)."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for source in sorted(here.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    cache = here / "__pycache__"
    stamp = cache / "kernel-sources.sha256"
    try:
        if stamp.read_text() == digest.hexdigest():
            return
    except OSError:
        pass
    try:
        for entry in (*cache.glob("*.nbi"), *cache.glob("*.nbc")):
            entry.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        partial = stamp.with_suffix(f".{os.getpid()}")
        partial.write_text(digest.hexdigest())
        partial.replace(stamp)
    except OSError:
        pass


_drop_stale_caches()
