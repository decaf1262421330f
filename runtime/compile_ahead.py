"""Compile a run's kernels before its first step, shared among the processes of a host.

On a cold cache the default job spent 10 of its 12.6 s compiling (`runtime.compile_units`), on
one core of two. The run's units are cut among the processes of the host by longest-first
greedy assignment; units that share kernels (a filter's tied and untied passes) stay together,
and the GEMM they and the linear layers call is compiled by one process, first (`assign`).
Under `mpiexec` the ranks of a host take a share each and wait for one another; a run in one
process has helper processes compile the others' shares whose kernels are not in Numba's cache
yet, and waits for them: they compile what it would otherwise compile itself. A helper is a copy
of the run forked once it knows its units (`_forked`): it has the kernels' modules imported
already and starts compiling at once. Where the run may not fork (another thread runs, the
platform cannot, or the run's kernels run parallel loops, which GNU OpenMP does not allow a
copy of a process that has started its threads), it starts a new interpreter instead
(`Helpers`), which imports them first (`HELPER_START_S`). Forked, the default job's compiling
ended 0.1-0.5 s sooner than with an interpreter started with the command, which had also
slowed the run's own imports by importing beside them.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import numba
import numpy as np

from legion_nn.cores import can_fork
from runtime.compile_units import UNITS, cached, parallel_only, warm


def assign(units: list[str], processes: int, late: float = 0.0) -> list[list[str]]:
    """The units of each process, in the order it compiles them; every process but the first
    starts `late` seconds behind it (a new interpreter's start). Units of one group go to one
    process: they share kernels.

    The compiled GEMM (`microkernel.kernels`, `GEMM_SECONDS`) is compiled once a host
    (`microkernel._compiled_once`): by one process, which compiles its GEMM callers first.
    Every other process compiles its GEMM callers last and, where the GEMM is not in Numba's
    cache yet, waits there for it; before them it compiles the optimizer's step
    (`STEP_GROUPS`), which the callers' fused updates call: a one-process run's helper had
    compiled it while the main process compiled it again inside the filter's fused step.

    The groups are placed where the compiling ends soonest as `_ends` times it (the GEMM, and
    the wait for it, included): of every placement where there are few (`_placement`). The
    default job had its filters' fused step, the GEMM and the classifier's two products in one
    process, 0.4-0.6 s after its helper had finished: the balance by summed seconds alone had
    kept the classifier with the step as one group, and knew no wait."""
    groups: dict[str, list[str]] = {}
    for name in units:
        groups.setdefault(UNITS[name].group, []).append(name)
    weight = {key: sum(UNITS[n].weight() for n in names) for key, names in groups.items()}
    placed = _placement(sorted(groups, key=lambda key: -weight[key]), weight, processes, late)
    gemm_at = _gemm_process(placed, weight, late)

    def order(name: str, first: bool) -> tuple[bool, bool]:
        group = UNITS[name].group
        if first:
            return (group not in GEMM_GROUPS, False)
        return (group in GEMM_GROUPS, group not in STEP_GROUPS)

    return [
        sorted((n for key in keys for n in groups[key]), key=lambda n: order(n, i == gemm_at))
        for i, keys in enumerate(placed)
    ]


#: up to how many placements of the groups on the processes `_placement` tries every one (the
#: default job's 6 groups on 2 processes: 64, in 4 ms; 1024 take some 60 ms, which a warm run
#: pays too)
EVERY_PLACEMENT_UP_TO = 1024


def _placement(
    keys: list[str], weight: dict[str, float], processes: int, late: float
) -> list[list[str]]:
    """The groups `keys` of each process: of every placement where there are at most
    `EVERY_PLACEMENT_UP_TO`, the first whose compiling ends soonest (`_ends`); beyond, each
    group longest first where it ends soonest, then `_improved`."""
    if processes ** len(keys) <= EVERY_PLACEMENT_UP_TO:
        every = itertools.product(range(processes), repeat=len(keys))
        placements = ([[k for k, p in zip(keys, places) if p == i] for i in range(processes)]
                      for places in every)  # fmt: skip
        return min(placements, key=lambda placed: _ends(placed, weight, late))
    placed: list[list[str]] = [[] for _ in range(processes)]
    for key in keys:
        target = min(range(processes), key=lambda i: _ends(_with(placed, key, i), weight, late))
        placed[target].append(key)
    return _improved(placed, weight, late)


def _with(placed: list[list[str]], key: str, target: int) -> list[list[str]]:
    return [keys + [key] if i == target else keys for i, keys in enumerate(placed)]


def _improved(placed: list[list[str]], weight: dict[str, float], late: float) -> list[list[str]]:
    """`placed` after moving a group to another process, or swapping two groups of two
    processes, while the best such change ends the compiling sooner (`_ends`)."""
    best = _ends(placed, weight, late)
    while True:
        changes = []
        for a, keys in enumerate(placed):
            for key in keys:
                for b in range(len(placed)):
                    if b == a:
                        continue
                    moved = [list(k) for k in placed]
                    moved[a].remove(key)
                    moved[b].append(key)
                    changes.append(moved)
                    for other in placed[b] if b > a else ():
                        swapped = [list(k) for k in moved]
                        swapped[b].remove(other)
                        swapped[a].append(other)
                        changes.append(swapped)
        scored = [(_ends(change, weight, late), change) for change in changes]
        ends, found = min(scored, key=lambda pair: pair[0], default=(best, placed))
        if ends >= best:
            return placed
        placed, best = found, ends


def _gemm_process(placed: list[list[str]], weight: dict[str, float], late: float) -> int | None:
    """The process that compiles the GEMM: of those with GEMM callers, the one with which the
    compiling ends soonest (`_ends`); None where no process calls it."""
    return min(
        _callers(placed), key=lambda g: _ends_with_gemm_at(placed, weight, late, g), default=None
    )


def _ends(placed: list[list[str]], weight: dict[str, float], late: float) -> tuple[float, ...]:
    """When each process ends compiling its groups, latest first, with the GEMM compiled where
    that ends soonest: what the placement minimises, in this order (the last end first)."""
    return min(_ends_with_gemm_at(placed, weight, late, g) for g in _callers(placed) or [None])


def _callers(placed: list[list[str]]) -> list[int]:
    """The processes with GEMM callers."""
    return [i for i, keys in enumerate(placed) if any(k in GEMM_GROUPS for k in keys)]


def _ends_with_gemm_at(
    placed: list[list[str]], weight: dict[str, float], late: float, gemm_at: int | None
) -> tuple[float, ...]:
    """`_ends` with process `gemm_at` compiling the GEMM at its start (`GEMM_SECONDS`): every
    other process's callers start once the rest of its share is compiled and the GEMM is."""
    ready = (0.0 if gemm_at == 0 else late) + GEMM_SECONDS
    ends = []
    for i, keys in enumerate(placed):
        start = 0.0 if i == 0 else late
        calling = sum(weight[k] for k in keys if k in GEMM_GROUPS)
        rest = sum(weight[k] for k in keys if k not in GEMM_GROUPS)
        if i == gemm_at:
            ends.append(start + GEMM_SECONDS + calling + rest)
        elif calling:
            ends.append(max(start + rest, ready) + calling)
        else:
            ends.append(start + rest)
    return tuple(sorted(ends, reverse=True))


#: the groups whose kernels call the compiled GEMM (`microkernel.kernels`)
GEMM_GROUPS = ("gemm", "gradient", "step", "linear", "matmul")
#: the groups whose kernels the GEMM callers' kernels call in their fused optimizer steps
#: (`update.step_elements`)
STEP_GROUPS = ("update",)
#: what compiling the GEMM takes, once per dtype (its 20 unrolled tile bodies), beyond its
#: callers' `Unit.seconds`, with plain loops or parallel ones alike (a C function of its own;
#: `bench/unit_compile_seconds.py`)
GEMM_SECONDS = 1.3


#: seconds a new interpreter takes to start and import the kernels' modules before it compiles
#: (0.45-0.5 s on the 2-core AMD EPYC VM; `assign` gives its share that much late)
HELPER_START_S = 0.5
#: the argument that starts a helper waiting for its share on stdin (`Helpers`)
WAIT = "--wait"
#: how long a run waits for a helper before it goes on and compiles what is left itself
HELPER_TIMEOUT_S = 300.0


def compile_ahead(
    units: list[str],
    dtype,
    local_rank: int = 0,
    local_size: int = 1,
    barrier: Callable[[], None] | None = None,
    helpers: int = 0,
) -> None:
    """Compile `units` among the `local_size` ranks of this host (this one is `local_rank`), or,
    alone on it, with up to `helpers` helper processes; then wait at `barrier` (every rank of a
    job calls it, whatever its host's rank count)."""
    if local_size > 1:
        warm(assign(units, local_size)[local_rank], dtype)
    else:
        _with_helpers(units, dtype, helpers)
    if barrier is not None:
        barrier()


def _with_helpers(units: list[str], dtype, helpers: int) -> None:
    """Compile `units` here and in `helpers` helper processes, one for each other share that
    Numba's cache misses: copies of this process where it may fork, else new interpreters."""
    # a copy running parallel loops ends at its first (GNU OpenMP's handler: this process has
    # started Numba's threading layer, as asking its thread count does): copies only for plain
    forking = helpers > 0 and can_fork() and numba.get_num_threads() == 1
    mine, missed = _shares(units, dtype, helpers, forking)
    if forking and any(parallel_only(share) for share in missed):
        forking = False
        mine, missed = _shares(units, dtype, helpers, forking)
    if forking:
        if missed:
            _set_up_numba()
        running = {_forked(share, dtype) for share in missed}
        try:
            warm(mine, dtype)
            _wait_for(running)
        finally:
            _end(running)
        return
    with Helpers(len(missed)) as started:
        _compile_beside(mine, dtype, started.give(orders(missed, dtype)))


def _shares(
    units: list[str], dtype, helpers: int, forking: bool
) -> tuple[list[str], list[list[str]]]:
    """This process's share of `units` beside `helpers` helpers, and the helpers' shares that
    Numba's cache misses: a copy starts with this process, a new interpreter `HELPER_START_S`
    late."""
    shares = assign(units, 1 + helpers, 0.0 if forking else HELPER_START_S)
    return shares[0], [share for share in shares[1:] if share and not cached(share, dtype)]


def _set_up_numba() -> None:
    """Pay here what a process's first compile costs beside its own (Numba's typing and target
    contexts, LLVM's, the first array's types: 0.25-0.45 s on the 2-core AMD EPYC VM), so that
    the copies forked after it inherit it rather than each paying it again."""
    numba.njit(lambda x: x[0])(np.zeros(1))


def _forked(share: list[str], dtype) -> int:
    """The pid of a copy of this process that compiles `share` and exits, with status 0 where
    that succeeded."""
    pid = os.fork()
    if pid == 0:  # the copy: nothing of the run's but the compiling, and no exit handlers
        code = 1
        try:
            warm(share, dtype)
            code = 0
        finally:
            os._exit(code)
    return pid


def _wait_for(running: set[int]) -> None:
    """Reap the children `running` as they exit, each leaving the set, until none is left or
    `HELPER_TIMEOUT_S` has passed (the run then compiles what is left itself, as it calls it)."""
    deadline = time.monotonic() + HELPER_TIMEOUT_S
    while running and time.monotonic() < deadline:
        for pid in list(running):
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                running.discard(pid)
        if running:
            time.sleep(0.005)


def _end(running: set[int]) -> None:
    """Kill and reap the children `running`, whatever ended the wait. Only children not yet
    reaped: until it is, a child's pid cannot name another process."""
    for pid in running:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    running.clear()


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


class Helpers:
    """New interpreters that compile beside a run that may not fork (`python -m
    runtime.compile_ahead --wait`): each imports the kernels' modules, then compiles the share
    it reads on its stdin (`give`), or exits on an empty line. Leaving the block ends every one
    still running, whatever happened in it; so does `close`, after which there are none."""

    def __init__(self, count: int) -> None:
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
