"""A watcher per rank, so that a rank killed by a signal is named with the task it died in.

When a rank of an MPI job dies from a signal (SIGKILL from the OOM killer, a segfault in a
kernel), `mpiexec` kills the others and reports a process id. Nobody can say which rank and task
it was, because the process that knew is gone. So each rank's process forks: the child does the
work (and initialises MPI, inheriting the launcher's connection), the parent only waits. The
child writes its rank, step and task into a small shared page as it goes; when it dies from a
signal, the parent reads the page, prints one line naming the rank and task, and exits with the
signal's status, and the launcher then ends the job. The parent holds the launcher's connection
open until it has printed, so the line always comes out.

If the parent itself is killed (the launcher cleaning up), the child is killed too
(`PR_SET_PDEATHSIG` on Linux), so no rank outlives its job.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import sys
from collections.abc import Callable

_SIZE = 512
PR_SET_PDEATHSIG = 1


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
        data = text.encode()[: _SIZE - 1].ljust(_SIZE, b"\0")
        self._page.seek(0)
        self._page.write(data)

    def read(self) -> tuple[str, str, str]:
        raw = bytes(self._page[:_SIZE]).rstrip(b"\0").decode(errors="replace")
        rank, step, task = (raw.split("\t") + ["?", "?", "?"])[:3]
        return rank, step, task


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: a child may outlive a killed watcher


def supervised(body: Callable[[Status], int], rank_hint: int | None = None) -> int:
    """Run `body(status)` in a child process; return its exit code, naming it if killed."""
    status = Status(rank_hint)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _die_with_parent()
        code = 1
        try:
            code = body(status)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    forward = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda s, _f: os.kill(pid, s)) for sig in forward}
    try:
        while True:
            try:
                _, state = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if os.WIFSIGNALED(state):
        number = os.WTERMSIG(state)
        rank, step, task = status.read()
        where = f"step {step}, task {task}" if step not in ("None", "?") else task
        print(
            f"legion-nn: rank {rank} was killed by {signal.Signals(number).name} in {where}",
            file=sys.stderr,
            flush=True,
        )
        return 128 + number
    return os.WEXITSTATUS(state)
