"""Compile a run's kernels before its first step, shared among the processes of a host.

On a cold cache the default job spent 10 of its 12.6 s compiling (`runtime.compile_units`), on
one core of two. The run's units are cut among the processes of the host by longest-first
greedy assignment; units that share kernels (a filter's tied and untied passes) stay together,
and the GEMM they and the linear layers call is compiled by one process, first (`assign`).
Under `mpiexec` the ranks of a host take a share each and wait for one another; a run in one
process starts helper processes (`Helpers`, `python -m runtime.compile_ahead --wait`, each told
its share on stdin) for the others' shares whose kernels are not in Numba's cache yet, and waits
for them: they compile what it would otherwise compile itself. A one-process run starts its
helpers first thing (`runtime.compile_helpers`), so that they import the kernels' modules while
it imports them, loads its data and plans, and ends them where Numba's cache proves warm
(`cache_is_cold`).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import numba
import numpy as np

from runtime.compile_helpers import HELPER_START_S, WAIT, Helpers
from runtime.compile_units import UNITS, cached, in_cache, warm


def assign(units: list[str], processes: int, late: float = 0.0) -> list[list[str]]:
    """The units of each process: groups, longest first, each to the least loaded process;
    every process but the first starts `late` seconds behind it (a helper's start).

    The compiled GEMM (`microkernel.kernels`, `GEMM_SECONDS`) is compiled once: by the process
    that takes the first of its callers' groups, which compiles them first. Every other
    process puts its GEMM callers last, by which time the GEMM is in Numba's cache: two ranks
    of the default job had each compiled it at once, one with the filters, the other with the
    classifier. For the same reason every other process starts with the optimizer's step
    (`STEP_GROUPS`), which the GEMM callers' fused updates call: a one-process run's helper had
    compiled it while the main process compiled it again inside the filter's fused step."""
    groups: dict[str, list[str]] = {}
    for name in units:
        groups.setdefault(UNITS[name].group, []).append(name)
    load = [0.0] + [late] * (processes - 1)
    shares: list[list[str]] = [[] for _ in range(processes)]
    weight = {key: sum(UNITS[n].weight() for n in names) for key, names in groups.items()}
    gemm_at = None
    for key in sorted(groups, key=lambda key: -weight[key]):
        target = load.index(min(load))
        shares[target] += groups[key]
        load[target] += weight[key]
        if key in GEMM_GROUPS and gemm_at is None:
            gemm_at = target
            load[target] += GEMM_SECONDS

    def order(name: str, first: bool) -> tuple[bool, bool]:
        group = UNITS[name].group
        if first:
            return (group not in GEMM_GROUPS, False)
        return (group in GEMM_GROUPS, group not in STEP_GROUPS)

    return [
        sorted(share, key=lambda name: order(name, i == gemm_at)) for i, share in enumerate(shares)
    ]


#: the groups whose kernels call the compiled GEMM (`microkernel.kernels`)
GEMM_GROUPS = ("gemm", "gradient", "step")
#: the groups whose kernels the GEMM callers' kernels call in their fused optimizer steps
#: (`update.step_elements`)
STEP_GROUPS = ("update",)
#: what compiling the GEMM takes, once per dtype (its 20 unrolled tile bodies), beyond its
#: callers' `Unit.seconds`, with plain loops or parallel ones alike (a C function of its own;
#: `bench/unit_compile_seconds.py`)
GEMM_SECONDS = 0.8


#: how long a run waits for a helper before it goes on and compiles what is left itself
HELPER_TIMEOUT_S = 300.0


def compile_ahead(
    units: list[str],
    dtype,
    local_rank: int = 0,
    local_size: int = 1,
    barrier: Callable[[], None] | None = None,
    helpers: int | Helpers = 0,
) -> None:
    """Compile `units` among the `local_size` ranks of this host (this one is `local_rank`), or,
    alone on it, with `helpers` helper processes (or those begun with the command, `Helpers`);
    then wait at `barrier` (every rank of a job calls it, whatever its host's rank count)."""
    if local_size > 1:
        warm(assign(units, local_size)[local_rank], dtype)
    else:
        _with_helpers(units, dtype, helpers)
    if barrier is not None:
        barrier()


def _with_helpers(units: list[str], dtype, helpers: int | Helpers) -> None:
    """Compile `units` here and in helper processes: those begun with the command (`Helpers`),
    each given its share, or `helpers` of them, started now for the shares Numba's cache
    misses."""
    if isinstance(helpers, Helpers):
        shares = assign(units, 1 + len(helpers), helpers.starting_for())
        _compile_beside(shares[0], dtype, helpers.give(orders(shares[1:], dtype)))
        return
    shares = assign(units, 1 + helpers, HELPER_START_S)
    missed = [share for share in shares[1:] if share and not cached(share, dtype)]
    with Helpers(len(missed)) as started:
        _compile_beside(shares[0], dtype, started.give(orders(missed, dtype)))


def orders(shares: list[list[str]], dtype) -> list[str]:
    """What `Helpers.give` tells each helper: its share of units, for `dtype` and this process's
    thread count (the twins it calls), or nothing where the share is empty or in Numba's cache
    already."""
    threads = numba.get_num_threads()
    name = np.dtype(dtype).name
    return [
        f"{name} {threads} {' '.join(share)}" if share and not cached(share, dtype) else ""
        for share in shares
    ]


def cache_is_cold(dtype) -> bool:
    """Whether Numba's cache is cold for `dtype`: it holds neither twin of the linear layer's
    product, which almost every network calls (helpers begun with a command are ended where it
    is warm; on a warmer cache `compile_ahead` starts a helper only for a share it misses, when
    it knows the shares)."""
    probe = UNITS["linear"].probe
    return not any(in_cache(twin, dtype) for twin in (probe.serial, probe.parallel))


def _compile_beside(mine: list[str], dtype, busy: list[subprocess.Popen]) -> None:
    """Compile `mine` while the helpers `busy` compile theirs, and wait for them."""
    try:
        warm(mine, dtype)
        for process in busy:
            try:
                process.wait(timeout=HELPER_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # the run compiles what is left itself
                pass
    finally:
        for process in busy:
            if process.poll() is None:
                process.kill()
                process.wait()


def main(argv: list[str]) -> int:
    usage = (
        f"usage: python -m runtime.compile_ahead float32|float64 [{'|'.join(UNITS)}]...\n"
        f"       python -m runtime.compile_ahead {WAIT}  (then DTYPE THREADS UNIT... on stdin)"
    )
    if argv == [WAIT]:
        told = sys.stdin.readline().split()
        if not told:
            return 0
        if len(told) < 2 or not told[1].isdigit():
            print(usage, file=sys.stderr)
            return 2
        argv = [told[0], *told[2:]]
        threads = int(told[1])
        if not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
            print(usage, file=sys.stderr)
            return 2
        numba.set_num_threads(threads)
    if not argv or argv[0] not in ("float32", "float64") or any(n not in UNITS for n in argv[1:]):
        print(usage, file=sys.stderr)
        return 2
    warm(argv[1:], argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
