"""A watcher per rank, so that a rank killed by a signal is named with the step and task it died in.

What MPICH's launcher gives, measured here (hydra 5.0.2, `mpiexec -n 3` of a rank that only
sleeps, rank 1 sent SIGKILL): hydra prints "BAD TERMINATION ... PID 7380 ... EXIT CODE: 9" and
"Killed (signal 9)", kills the other two ranks with SIGKILL (`-print-all-exitcodes`: 9,9,0; a
handler for SIGTERM, SIGINT, SIGHUP and SIGUSR1 never ran) and exits 9, 42 ms after the kill. It
names a process id and a signal, never a rank, and nothing of the job outlives that: no process
that knew the rank's step and task is left to say them. That is the case a design without a
watcher fails, so one process outside the rank has to stay.

So the process the launcher starts forks before MPI starts: the child goes on as the rank
(`start_watcher` returns in it), and the parent only waits for it. The rank writes its rank, step
and task into a page shared with the parent as it goes. A parent learns from `waitpid` how its
child ended: when the rank was killed by a signal, the parent prints one line naming the rank,
step, task and signal, then dies of the same signal, so that hydra reports the death as before;
when the rank exited, the parent exits with its status and says nothing. The ranks hydra kills
next are killed with their parents, the processes it started (it signals their process groups):
a parent killed by SIGKILL prints nothing, and a rank whose parent is gone follows it
(`PR_SET_PDEATHSIG`). So only the first death is named, with no coordination between ranks and
nothing to clean up. From the kill to the line: 21-64 ms on one host, 55-80 ms on 2 emulated
hosts (3 ranks, seed-lcn-small).

The parent keeps the launcher's connection (`PMI_FD`) and the output pipes open until it has
written its line, so hydra cannot end the job before the line is out: the rank's death alone
closes none of them. The first watcher here was such a parent, dropped after MPICH's launcher
killed jobs at random as they finished (the cause was not recorded); with this one, 20 jobs of
3 ranks and 30 of 4 in a row, and every run of the MPI tests, end cleanly. Its successor, a
watcher forked as the rank's child, cannot learn how its rank died, and told the first death
apart with System V semaphores; that took about ten commits of race fixes.

MPICH maps a shared-memory segment per host (`/dev/shm/mpich_shm_*`) and unlinks it in
`MPI_Finalize`; a job that ends in `MPI_Abort` or by a signal would leave it behind, megabytes a
job. Once every rank has it mapped, nothing opens it by name again, so `release_segments` unlinks
it right then: the mappings stay valid, and the memory goes back when the last rank ends, however
it ends. (`MPI_Finalize` then finds it gone and says nothing.)
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import resource
import signal
import sys

_SIZE = 512
_SEGMENT_PREFIX = "/dev/shm/mpich_"
PR_SET_PDEATHSIG = 1
#: what the watcher ignores: hydra sends Ctrl-C and SIGTERM to the rank's whole process group
#: (measured: one of each in the forked child and in the parent), so the rank has them already,
#: and a watcher that passed them on would deliver them twice
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Status:
    """Where a rank is, readable by its watcher after it died."""

    def __init__(self, rank: int | None = None) -> None:
        self._page = mmap.mmap(-1, _SIZE)
        self.rank = rank
        self.step: int | None = None
        self.task = "start-up"
        self._write()

    def set(self, step: int, task: str) -> None:
        self.step, self.task = step, task
        self._write()

    def set_rank(self, rank: int) -> None:
        self.rank = rank
        self._write()

    def _write(self) -> None:
        text = f"{self.rank if self.rank is not None else '?'}\t{self.step}\t{self.task}"
        self._page.seek(0)
        self._page.write(text.encode()[: _SIZE - 1].ljust(_SIZE, b"\0"))

    def read(self) -> tuple[str, str, str]:
        raw = bytes(self._page[:_SIZE]).rstrip(b"\0").decode(errors="replace")
        rank, step, task = (raw.split("\t") + ["?", "?", "?"])[:3]
        return rank, step, task

    def death(self, number: int) -> str:
        """The line that names this rank, killed by signal `number`."""
        rank, step, task = self.read()
        where = f"step {step}, task {task}" if step not in ("None", "?") else task
        return f"legion-nn train: rank {rank} died in {where}: killed by {_signal_name(number)}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _die_with_parent() -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    except (OSError, AttributeError):
        return False


def start_watcher(rank_hint: int | None = None) -> Status:
    """Fork: return the shared status in the child, which goes on as the rank; the parent
    watches it and never returns (Linux; elsewhere no watcher)."""
    status = Status(rank_hint)
    if not sys.platform.startswith("linux"):
        return status
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _IGNORED)  # until the watcher ignores them
    child = os.fork()
    if child == 0:
        _die_with_parent()
        if os.getppid() != parent:  # the watcher died before the line above
            os._exit(1)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return status
    _watch(child, status)


def _watch(child: int, status: Status) -> None:
    """Wait for the rank; end as it ended, naming it first if a signal killed it."""
    try:
        for number in _IGNORED:
            signal.signal(number, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _IGNORED)
        _, state = os.waitpid(child, 0)
        if os.WIFEXITED(state):
            os._exit(os.WEXITSTATUS(state))
        number = os.WTERMSIG(state)
        print(status.death(number), file=sys.stderr, flush=True)
        _die_of(number)
    finally:
        os._exit(1)  # the watcher never runs on as a second copy of the command


def _die_of(number: int) -> None:
    """End this process by signal `number`, as the rank did, without a core of the watcher."""
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    with contextlib.suppress(ValueError, OSError):  # SIGKILL has no handler to reset
        signal.signal(number, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {number})
    os.kill(os.getpid(), number)


def mapped_segments() -> list[str]:
    """The MPI library's shared-memory segments this process has mapped (read once MPI is up)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split(maxsplit=5)[-1].strip() for line in maps if _SEGMENT_PREFIX in line]
    except OSError:
        return []
    return sorted({p for p in paths if p.startswith(_SEGMENT_PREFIX) and " " not in p})


def release_segments() -> list[str]:
    """Unlink the MPI library's segments this process maps; call it once every rank on the host
    has them mapped (after a barrier). Returns what this call removed."""
    removed = []
    for path in mapped_segments():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed
