"""Work a command will ask for, done ahead on the cores it leaves idle.

A command that plans runs in one Python process, on one core, while its machine has more; and
some of what it will ask is known before it asks. `auto` compares its search's grids with the
built-in families' plans (`partitioner.resolve`), each of which takes seconds to predict
(resnet18 on 64 ranks: its model-parallel plan's programs alone take 2.5 s), and none of which
the search needs. A `Foresight` forks processes that work such jobs out while the command goes on
(its search, its own candidates); each process takes the next job nobody has begun. The command
takes a job's value when it asks for it (`take`), waiting where a process is at it, and works it
out itself where none has begun it (and then none will) or where the process doing it died.

The value is the same either way: the same code on the same inputs, in a copy of the command's
process made by `fork` as it stood when the jobs were given. Forking, rather than spawning, is
what makes it worth it: a process starts in milliseconds with the graph, the plans and the
modules it needs, nothing pickled or imported again. So a `Foresight` works only where the
platform forks and the process runs no other thread (a forked copy of a thread's locks may be
held forever); elsewhere, and with no core to spare, every job is left to the command.

The processes ignore SIGINT (the command's own handling ends them) and end with the
`Foresight` (`close`, which its owner calls on every exit path: `StepModel.looking_ahead`),
whatever job they are at: a value not taken by then is not wanted.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from legion_nn.cores import can_fork

#: a job's state in the shared array: not begun, taken by the command, or begun by process w
#: (`BEGUN + w`)
QUEUED, MINE, BEGUN = 0, 1, 2
#: seconds the command waits for the jobs' states, which a process holds only to take a job
LOCK_WAIT = 5.0


class Foresight:
    """`jobs` (each a call without arguments, whose value pickles) worked out by up to
    `workers` forked processes, in the order given; see the module docstring."""

    def __init__(self, jobs: Mapping[Hashable, Callable[[], Any]], workers: int) -> None:
        self._index = {key: i for i, key in enumerate(jobs)}
        self._done: dict[int, tuple[bool, Any]] = {}
        self._processes: list[multiprocessing.Process] = []
        self._connections: dict[int, Connection] = {}
        workers = min(workers, len(jobs))
        if workers < 1 or not can_fork():
            self._state = None
            return
        context = multiprocessing.get_context("fork")
        self._state = context.Array("b", len(jobs))
        calls = list(jobs.values())
        for w in range(workers):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_work, args=(calls, self._state, w, sender), daemon=True
            )
            process.start()
            sender.close()
            self._processes.append(process)
            self._connections[w] = receiver

    def take(self, key: Hashable) -> tuple[bool, Any]:
        """(True, the job's value) where a process worked it out; (False, None) where the
        caller is to work it out: no process began it (none will now), the process at it died,
        or the job raised (the caller then meets the error itself). A job is taken once."""
        i = self._index.pop(key, None)
        if i is None or self._state is None:
            return False, None
        lock = self._state.get_lock()
        if not lock.acquire(timeout=LOCK_WAIT):  # a process died holding it
            return False, None
        try:
            state = self._state[i]
            if state == QUEUED:
                self._state[i] = MINE
                return False, None
        finally:
            lock.release()
        worker = state - BEGUN
        while i not in self._done:
            if not self._receive(worker):
                return False, None
        return self._done.pop(i)

    def forgo(self, keys: Iterable[Hashable]) -> None:
        """The jobs `keys` are no longer wanted: those no process has begun never will be, and
        a process at one is ended (the values it sent before are kept; the jobs it would have
        gone on to are left to the caller, as a dead process's are)."""
        if self._state is None:
            return
        lock = self._state.get_lock()
        if not lock.acquire(timeout=LOCK_WAIT):
            return
        try:  # held, so that no process begins another job meanwhile
            at: dict[int, int] = {}
            for key in keys:
                i = self._index.pop(key, None)
                if i is None:
                    continue
                if self._state[i] == QUEUED:
                    self._state[i] = MINE
                else:
                    at[i] = self._state[i] - BEGUN
            self._drain()
            for i, worker in at.items():
                if self._done.pop(i, None) is None:
                    self._processes[worker].terminate()
        finally:
            lock.release()

    def busy(self) -> bool:
        """Whether a process is at a job still wanted, or such a job waits for one: a job
        forked beside it would share a core with it."""
        if self._state is None:
            return False
        self._drain()
        states = self._state[:]
        return any(
            states[i] == QUEUED
            or (
                states[i] >= BEGUN
                and i not in self._done
                and states[i] - BEGUN in self._connections
            )
            for i in self._index.values()
        )

    def _drain(self) -> None:
        """Read every value the processes have sent so far, without waiting."""
        while self._connections and wait(list(self._connections.values()), timeout=0):
            self._receive(next(iter(self._connections)))

    def _receive(self, worker: int) -> bool:
        """Read what the processes have sent, waiting for some; False where `worker` has ended
        without sending more (died or finished)."""
        receiver = self._connections.get(worker)
        if receiver is None:
            return False
        ready = wait(list(self._connections.values()))
        for w, connection in list(self._connections.items()):
            if connection not in ready:
                continue
            try:
                i, ok, value = connection.recv()
            except (EOFError, OSError):
                connection.close()
                del self._connections[w]
            else:
                self._done[i] = (ok, value)
        return True

    def close(self) -> None:
        """End the processes, whatever they are at, and free what they held."""
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            process.join()
            process.close()
        for connection in self._connections.values():
            connection.close()
        self._processes, self._connections, self._state = [], {}, None


def _work(calls: Sequence[Callable[[], Any]], state, worker: int, sender: Connection) -> None:
    """A forked process's loop: take the first job nobody has, work it out, send its value."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        with state.get_lock():
            i = next((j for j in range(len(calls)) if state[j] == QUEUED), None)
            if i is None:
                break
            state[i] = BEGUN + worker
        try:
            sent = (i, True, calls[i]())
        except Exception:  # noqa: BLE001 (the command meets it itself, working the job out)
            sent = (i, False, None)
        sender.send(sent)
    sender.close()


def shared_out(
    jobs: Mapping[Hashable, Callable[[], Any]],
    workers: int,
    meanwhile: Callable[[], Any] | None = None,
) -> dict[Hashable, Any]:
    """Every job's value, worked out by this process and up to `workers` forked ones at once
    (fewer where there are fewer jobs): the processes take the jobs from the first, this one
    from the last, then each job nobody has begun, then waits for the others; a job whose
    process died or raised is worked out here. `meanwhile` is called here once the processes
    are forked, before this process's first job (what it alone will need next: the others
    would work it out for nothing)."""
    ahead = Foresight(jobs, min(workers, len(jobs) - 1))
    found: dict[Hashable, Any] = {}
    try:
        if meanwhile is not None:
            meanwhile()
        for key in reversed(list(jobs)):
            done, value = ahead.take(key)
            found[key] = value if done else jobs[key]()
    finally:
        ahead.close()
    return {key: found[key] for key in jobs}
