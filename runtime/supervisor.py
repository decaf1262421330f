"""A watcher per rank, so that a rank killed by a signal is named with the task it died in.

When a rank of an MPI job dies from a signal (SIGKILL from the OOM killer or a user, a segfault in
native code), `mpiexec` kills the others and reports a process id; the process that knew which
rank and task it was is gone. So before it initialises MPI, each rank forks a small watcher. The
rank writes its rank, step and task into a page shared with the watcher as it goes, and marks the
page when it ends by its own hand (success, or an error it has already reported). If the rank
dies unmarked, its watcher prints one line naming the rank, step and task.

Only the first death is named: once one rank dies, the launcher kills the others, and their
watchers must stay quiet. Which death came first cannot be read from the order the watchers wake
in (on a loaded machine a survivor's watcher may run before the victim's). It is decided by the
kernel instead, with a System V semaphore set per launcher (`_DeathClaim`): each rank holds an
`alive` count with `SEM_UNDO`, and its watcher sleeps in one atomic operation "my rank's count is
zero and nobody has claimed; claim". The kernel undoes a dead process's semaphore counts in its
exit path, before it closes the process's files, and completes sleeping operations right there.
So the victim's watcher has claimed before the launcher can even see the victim's pipes close,
let alone kill anyone else. Once its line is written the watcher marks the claim named; a rank
that lost a peer waits for that (bounded) before it reports and aborts, since an abort can close
the launcher's pipes before a watcher just woken has written.

The last watcher out on a host also removes MPICH's shared-memory segment of the job
(`/dev/shm/mpich_shm_*`, which MPICH unlinks in `MPI_Finalize`): a job that ends in `MPI_Abort`
or by a signal would leave it behind, megabytes a job. The rank names the segments it has mapped
once MPI is up (`Status.set_segments`); a job that finalized has unlinked them already.

The rank process stays the one the launcher started, and the watcher lets go of the launcher's
connection (`PMI_FD`) at once, so the launcher sees an ordinary MPI process. (The other way round,
MPI in a forked child, makes MPICH's launcher kill the job at random when it finishes.)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import signal
import sys
import time
import zlib

_SIZE = 512
_SEGMENTS_AT = 256  # the page's second half: the MPI library's shared-memory segments
_SEGMENT_PREFIX = "/dev/shm/mpich_"
PR_SET_PDEATHSIG = 1
_ENDED = "\x00ended"

# <sys/ipc.h>, <sys/sem.h> on Linux
_IPC_CREAT = 0o1000
_IPC_NOWAIT = 0o4000
_IPC_RMID = 0
_GETVAL = 12
_SEM_UNDO = 0x1000

_CLAIMED = 0  # 0 until the first death (or a reported error) claims the right to speak, 1 while
# the claimant's line is still to be written, 2 once it is (`_NAMED`)
_NAMED = 2
_MEMBERS = 1  # ranks alive on this host, so that the last watcher out removes the set
_FIRST_SLOT = 2  # then one `alive` count per local rank: 1 alive, 0 killed, 2 ended by itself
_WAKE_EVERY_S = 1  # a watcher re-checks its rank this often, should it miss the death signal
_UNDO_WAIT_S = 10.0  # the longest a watcher waits for the kernel to take back its rank's counts
_UNDO_POLL_S = 0.01  # meanwhile it re-reads its slot this often


class Status:
    """Where a rank is, readable by its watcher after it died."""

    def __init__(self, rank: int | None = None, claim: _DeathClaim | None = None) -> None:
        self._page = mmap.mmap(-1, _SIZE)
        self._claim = claim
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
        if self.task == _ENDED:
            return
        self.task = _ENDED
        self._write()
        if self._claim is not None:
            self._claim.mark_ended()

    def wait_for_a_death_named(self, seconds: float) -> None:
        """Give a lost peer's watcher on this host up to `seconds` to claim and write its line.

        Waiting for the claim alone is not enough: the rank would wake with the watcher, abort
        the job, and the launcher could close the pipes before the watcher has written."""
        if self._claim is None:
            time.sleep(seconds)
        else:
            self._claim.wait_until_named(seconds)

    def reported(self) -> None:
        """The rank has reported its own error: the deaths that follow are not to be named."""
        if self._claim is not None:
            self._claim.claim_now()
        self.ended()

    def _write(self) -> None:
        text = f"{self.rank if self.rank is not None else '?'}\t{self.step}\t{self.task}"
        self._page.seek(0)
        self._page.write(text.encode()[: _SEGMENTS_AT - 1].ljust(_SEGMENTS_AT, b"\0"))

    def set_segments(self, paths: list[str]) -> None:
        """The MPI library's shared-memory segments this rank has mapped (see the module)."""
        text = "\n".join(p for p in paths if len(p) < _SIZE - _SEGMENTS_AT).encode()
        self._page[_SEGMENTS_AT:_SIZE] = text[: _SIZE - _SEGMENTS_AT - 1].ljust(
            _SIZE - _SEGMENTS_AT, b"\0"
        )

    def segments(self) -> list[str]:
        raw = bytes(self._page[_SEGMENTS_AT:_SIZE]).rstrip(b"\0").decode(errors="replace")
        return [p for p in raw.split("\n") if p.startswith(_SEGMENT_PREFIX)]

    def has_ended(self) -> bool:
        """Whether the rank has ended by its own hand, as its watcher reads the shared page."""
        return self.read()[2] == _ENDED

    def read(self) -> tuple[str, str, str]:
        raw = bytes(self._page[:_SEGMENTS_AT]).rstrip(b"\0").decode(errors="replace")
        rank, step, task = (raw.split("\t") + ["?", "?", "?"])[:3]
        return rank, step, task


class _SemBuf(ctypes.Structure):
    _fields_ = [
        ("sem_num", ctypes.c_ushort),
        ("sem_op", ctypes.c_short),
        ("sem_flg", ctypes.c_short),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _timespec(seconds: float) -> _Timespec:
    return _Timespec(int(seconds), int(seconds % 1 * 1e9))


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _operations(*ops: tuple[int, int, int]) -> ctypes.Array:
    return (_SemBuf * len(ops))(*(_SemBuf(*op) for op in ops))


class _DeathClaim:
    """The semaphore set through which the first rank to die on a host is told apart.

    Layout: `_CLAIMED`, `_MEMBERS`, then one `alive` count per local rank (`slot`)."""

    def __init__(self, key: int, slots: int, slot: int) -> None:
        self._libc = _libc()
        self.slot = _FIRST_SLOT + slot
        self.id = self._libc.semget(ctypes.c_int(key), _FIRST_SLOT + slots, _IPC_CREAT | 0o600)
        if self.id < 0:
            raise OSError(ctypes.get_errno(), "semget")

    @classmethod
    def for_launcher(cls, launcher: int, slots: int, slot: int) -> _DeathClaim | None:
        """The claim shared by the ranks `launcher` started; None where SysV IPC is unavailable."""
        if not 0 <= slot < slots:
            return None
        try:
            return cls(_launcher_key(launcher), slots, slot)
        except (OSError, AttributeError):
            return None

    def join(self) -> None:
        """Called by the rank: the kernel takes both counts back when it dies, however it dies."""
        self._semop((self.slot, 1, _SEM_UNDO), (_MEMBERS, 1, _SEM_UNDO))

    def mark_ended(self) -> None:
        with contextlib.suppress(OSError):
            self._semop((self.slot, 1, 0))

    def claim_now(self) -> bool:
        """Claim for a rank that has already written its own line (so: named at once)."""
        try:
            self._semop((_CLAIMED, 0, _IPC_NOWAIT), (_CLAIMED, _NAMED, _IPC_NOWAIT))
        except OSError:
            return False
        return True

    def wait_for_death_claim(self, rank_gone, rank_ended=lambda: False) -> bool:
        """Called by the watcher: True when its rank died first; False once it is gone otherwise.

        The operation sleeps in the kernel, which completes it inside the dying rank's exit, so
        the claim's order is the order of the deaths. `rank_gone` is checked between sleeps.

        The watcher can see its rank gone (reparented, by the rank's first exiting thread)
        before the kernel has taken back the rank's counts, which happens in its last exiting
        thread, perhaps after tearing down gigabytes. Giving up then would leave the victim
        unnamed and the first survivor the launcher kills named in its place. So a gone rank's
        watcher goes on sleeping in the claim, in short sleeps, until its slot has dropped (then
        one last try that does not sleep), its rank turns out to have ended by its own hand, or
        `_UNDO_WAIT_S` has passed."""

        def claim(flags: int) -> ctypes.Array:
            return _operations((self.slot, 0, flags), (_CLAIMED, 0, flags), (_CLAIMED, 1, flags))

        sleeping, last_try = claim(0), claim(_IPC_NOWAIT)
        gone_since: float | None = None
        while True:
            timeout = _timespec(_WAKE_EVERY_S)
            attempt = sleeping
            if gone_since is None and rank_gone():
                gone_since = time.monotonic()
            if gone_since is not None:
                if rank_ended():
                    return False
                undone = self._libc.semctl(self.id, self.slot, _GETVAL) == 0
                if undone or time.monotonic() - gone_since > _UNDO_WAIT_S:
                    attempt = last_try  # nobody will wake a sleeping one now
                else:
                    timeout = _timespec(_UNDO_POLL_S)
            if self._libc.semtimedop(self.id, attempt, 3, ctypes.byref(timeout)) == 0:
                return True
            if attempt is last_try or ctypes.get_errno() not in (errno.EINTR, errno.EAGAIN):
                return False

    def mark_named(self) -> None:
        """Called by the watcher that claimed, once its line is written (or will never be)."""
        with contextlib.suppress(OSError):
            self._semop((_CLAIMED, _NAMED - 1, 0))

    def wait_until_named(self, seconds: float) -> bool:
        """Sleep until a claimant on this host has written its line, at most `seconds`."""
        operations = _operations((_CLAIMED, -_NAMED, 0), (_CLAIMED, _NAMED, 0))
        return self._libc.semtimedop(self.id, operations, 2, ctypes.byref(_timespec(seconds))) == 0

    def remove_if_unused(self, ended: bool) -> bool:
        """Called by the watcher once its rank is gone: the last watcher out removes the set, so
        that nothing outlives the job; True for the last watcher out.

        The kernel takes a dead rank's counts back in whichever of its threads exits last, and
        another of its threads may already have handed the watcher to init: the watcher can see
        its rank gone while the rank still counts as a member (1 job in 8 here, leaving the set
        behind). So it first waits, briefly, for its own slot to drop to what a dead rank leaves:
        1 when the rank ended by its own hand (`mark_ended`), else 0."""
        after_death = 1 if ended else 0
        deadline = time.monotonic() + _UNDO_WAIT_S
        while self._libc.semctl(self.id, self.slot, _GETVAL) > after_death:
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        if self._libc.semctl(self.id, _MEMBERS, _GETVAL) == 0:
            self._libc.semctl(self.id, 0, _IPC_RMID)
            return True
        return False

    def _semop(self, *ops: tuple[int, int, int]) -> None:
        array = _operations(*ops)
        if self._libc.semop(self.id, array, len(array)) != 0:
            raise OSError(ctypes.get_errno(), "semop")


def _launcher_key(launcher: int) -> int:
    """A SysV key for this launcher process, its start time included so a reused pid differs."""
    try:
        with open(f"/proc/{launcher}/stat") as stat:
            started = stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"
    key = zlib.crc32(f"legion-nn:{os.getuid()}:{launcher}:{started}".encode()) & 0x7FFFFFFF
    return key or 1


def _local_slot(rank_hint: int | None) -> tuple[int, int]:
    """This rank's index among the ranks its launcher started, and their number."""
    from runtime.launch import local_rank_from_env, ranks_on_this_host

    slot = local_rank_from_env()
    if slot is None:
        slot = rank_hint if rank_hint is not None else -1
    return slot, ranks_on_this_host()


def _prctl_death_signal(number: int) -> bool:
    try:
        return _libc().prctl(PR_SET_PDEATHSIG, number, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start_watcher(rank_hint: int | None = None) -> Status:
    """Fork this rank's watcher (Linux; elsewhere no watcher) and return the shared status."""
    if not sys.platform.startswith("linux"):
        return Status(rank_hint)
    launcher = os.getppid()
    slot, slots = _local_slot(rank_hint)
    claim = _DeathClaim.for_launcher(launcher, slots, slot)
    if claim is not None:
        try:
            claim.join()
        except OSError:
            claim = None
    status = Status(rank_hint, claim)
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    pid = os.fork()
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        return status
    _watch(status, claim, parent)


def _watch(status: Status, claim: _DeathClaim | None, parent: int) -> None:
    code = 0
    first = False
    try:
        pmi = os.environ.get("PMI_FD", "")
        if pmi.isdigit():
            with contextlib.suppress(OSError):
                os.close(int(pmi))
        os.setsid()  # out of the rank's process group, which the launcher may kill whole
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, lambda *_: None)  # only to interrupt the wait
        _prctl_death_signal(signal.SIGUSR1)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})

        def rank_gone() -> bool:
            return os.getppid() != parent

        if claim is not None:
            first = claim.wait_for_death_claim(rank_gone, status.has_ended)
        else:  # no coordination: better a line too many than none
            while not rank_gone():
                signal.sigtimedwait({signal.SIGUSR1}, _WAKE_EVERY_S)
            first = True
        rank, step, task = status.read()
        if first and task != _ENDED:
            where = f"step {step}, task {task}" if step not in ("None", "?") else task
            print(
                f"legion-nn train: rank {rank} died in {where}: killed by a signal "
                f"(or a crash in native code)",
                file=sys.stderr,
                flush=True,
            )
    except BaseException:  # noqa: BLE001  (a watcher never outlives its rank or raises)
        code = 1
    finally:
        if claim is not None:
            with contextlib.suppress(BaseException):
                if first:
                    claim.mark_named()
                if claim.remove_if_unused(ended=status.has_ended()):
                    for path in status.segments():
                        with contextlib.suppress(OSError):
                            os.unlink(path)
        os._exit(code)


def mapped_segments() -> list[str]:
    """The MPI library's shared-memory segments this process has mapped (read once MPI is up)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split(maxsplit=5)[-1].strip() for line in maps if _SEGMENT_PREFIX in line]
    except OSError:
        return []
    return sorted({p for p in paths if p.startswith(_SEGMENT_PREFIX) and " " not in p})
