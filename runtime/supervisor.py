"""A watcher per rank, so that a rank killed by a signal is named with the task it died in.

When a rank of an MPI job dies from a signal (SIGKILL from the OOM killer or a user, a segfault in
native code), `mpiexec` kills the others and reports a process id; the process that knew which
rank and task it was is gone. So before it initialises MPI, each rank forks a small watcher. The
rank writes its rank, step and task into a page shared with the watcher as it goes, and marks the
page when it ends by its own hand (success, or an error it has already reported). The watcher only
waits for its rank to die (`PR_SET_PDEATHSIG`); if the page is not marked then, the rank was killed,
and the watcher prints one line naming the rank, step and task before it exits.

The rank process stays the one the launcher started, and the watcher lets go of the launcher's
connection (`PMI_FD`) at once, so the launcher sees an ordinary MPI process. (The other way round,
MPI in a forked child, makes MPICH's launcher kill the job at random when it finishes.)
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import signal
import sys
import tempfile
import time

_SIZE = 512
PR_SET_PDEATHSIG = 1
_ENDED = "\x00ended"


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

    def ended(self) -> None:
        """The rank ends by its own hand: its watcher has nothing to say."""
        self.task = _ENDED
        self._write()

    def _write(self) -> None:
        text = f"{self.rank if self.rank is not None else '?'}\t{self.step}\t{self.task}"
        self._page.seek(0)
        self._page.write(text.encode()[: _SIZE - 1].ljust(_SIZE, b"\0"))

    def read(self) -> tuple[str, str, str]:
        raw = bytes(self._page[:_SIZE]).rstrip(b"\0").decode(errors="replace")
        rank, step, task = (raw.split("\t") + ["?", "?", "?"])[:3]
        return rank, step, task


def _prctl_death_signal(number: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, number, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _first_death_marker(launcher: int) -> str | None:
    """Claim the right to report for this launcher's job; None when another rank died first.

    Once one rank dies, the launcher kills the others, and their watchers would report them
    too: only the first death, the cause, is named."""
    path = os.path.join(tempfile.gettempdir(), f"legion-nn-death-{os.getuid()}-{launcher}")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return None
    except OSError:
        return path  # cannot coordinate: better a line too many than none
    return path


def start_watcher(rank_hint: int | None = None) -> Status:
    """Fork this rank's watcher (Linux; elsewhere no watcher) and return the shared status."""
    status = Status(rank_hint)
    if not sys.platform.startswith("linux"):
        return status
    parent = os.getpid()
    launcher = os.getppid()
    sys.stdout.flush()
    sys.stderr.flush()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    pid = os.fork()
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        return status
    code = 0
    try:
        pmi = os.environ.get("PMI_FD", "")
        if pmi.isdigit():
            with contextlib.suppress(OSError):
                os.close(int(pmi))
        os.setsid()  # out of the rank's process group, which the launcher may kill whole
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        if _prctl_death_signal(signal.SIGUSR1) and os.getppid() == parent:
            signal.sigwait({signal.SIGUSR1})
        rank, step, task = status.read()
        if task != _ENDED:
            marker = _first_death_marker(launcher)
            if marker is not None:
                where = f"step {step}, task {task}" if step not in ("None", "?") else task
                print(
                    f"legion-nn train: rank {rank} died in {where}: killed by a signal "
                    f"(or a crash in native code)",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(1.0)  # the launcher now kills the other ranks: keep them quiet
                with contextlib.suppress(OSError):
                    os.unlink(marker)
    except BaseException:  # noqa: BLE001  (a watcher never outlives its rank or raises)
        code = 1
    finally:
        os._exit(code)
