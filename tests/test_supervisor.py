"""The rank watchers: the first rank to die is named once, whoever's watcher runs first."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from runtime import supervisor
from runtime.supervisor import _CLAIMED, _FIRST_SLOT, _GETVAL, _IPC_RMID, _DeathClaim

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux watchers")

LIBC = ctypes.CDLL(None, use_errno=True)
HOLDING_GIL = ctypes.PyDLL(None)  # calls that keep the GIL
_GETZCNT = 15

JOINING_RANK = """
import sys, time
from runtime.supervisor import _DeathClaim
_DeathClaim(int(sys.argv[1]), 2, int(sys.argv[2])).join()
print("joined", flush=True)
time.sleep(120)
"""

WATCHED_RANK = """
import os, sys, time
from runtime.supervisor import start_watcher
rank = int(os.environ["MPI_LOCALRANKID"])
status = start_watcher(rank)
status.set(7, f"L{rank}.filter")
print("started", flush=True)
sys.stdin.readline()  # until every rank has started
if sys.argv[1] == "end":
    status.ended()
    sys.exit(0)
if sys.argv[1] == "report":
    status.reported()
    sys.exit(1)
time.sleep(120)
"""


def existing_set(key: int) -> int | None:
    semid = LIBC.semget(ctypes.c_int(key), 0, 0)
    if semid < 0:
        assert ctypes.get_errno() == errno.ENOENT
        return None
    return semid


def remove_set(key: int) -> None:
    semid = existing_set(key)
    if semid is not None:
        LIBC.semctl(semid, 0, _IPC_RMID)


@pytest.fixture(name="key")
def fresh_key():
    """A semaphore-set key of the test's own, with no set behind it before or after the test."""
    key = random.randrange(1 << 20, 1 << 30)
    remove_set(key)
    yield key
    remove_set(key)


@pytest.fixture
def launcher_key():
    """These tests' ranks are children of pytest: their set is the one keyed by pytest's pid."""
    key = supervisor._launcher_key(os.getpid())
    remove_set(key)
    yield key
    remove_set(key)


def start(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    rank = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert rank.stdout.readline().strip() in ("joined", "started"), rank.stderr.read()
    return rank


def kill(rank: subprocess.Popen) -> str:
    """SIGKILL a rank and return what it and its watcher wrote to stderr, once both are gone."""
    rank.kill()
    _, stderr = rank.communicate(timeout=30)  # EOF only when the watcher has let go too
    return stderr


def test_the_first_death_is_claimed_in_the_kernel_before_any_watcher_runs(key):
    """The watchers are threads here. The test holds the GIL from the kill until it has read the
    claim, so no watcher can have run a line of Python in between: only the kernel can have
    claimed."""
    ranks = [start(JOINING_RANK, str(key), str(slot)) for slot in (0, 1)]
    switch_interval = sys.getswitchinterval()
    try:
        claims = [_DeathClaim(key, 2, slot) for slot in (0, 1)]
        semid = claims[0].id
        results: dict[int, bool] = {}
        dead: set[int] = set()

        def watch(slot: int) -> None:
            results[slot] = claims[slot].wait_for_death_claim(lambda: slot in dead)

        watchers = [threading.Thread(target=watch, args=(slot,)) for slot in (0, 1)]
        for watcher in watchers:
            watcher.start()
        deadline = time.monotonic() + 30
        while any(LIBC.semctl(semid, _FIRST_SLOT + s, _GETZCNT) != 1 for s in (0, 1)):
            assert time.monotonic() < deadline, "the watchers never slept in the claim"
            time.sleep(0.01)
        victim, survivor = ranks[1], ranks[0]
        sys.setswitchinterval(30.0)
        HOLDING_GIL.kill(victim.pid, 9)
        while HOLDING_GIL.semctl(semid, _FIRST_SLOT + 1, _GETVAL) != 0:
            assert time.monotonic() < deadline, "the victim never died"
        claimed = HOLDING_GIL.semctl(semid, _CLAIMED, _GETVAL)
        watcher_ran = bool(results)
        sys.setswitchinterval(switch_interval)
        assert (claimed, watcher_ran) == (1, False)
        victim.wait(timeout=30)
        dead.add(1)
        survivor.kill()
        survivor.wait(timeout=30)
        dead.add(0)
        for watcher in watchers:
            watcher.join(timeout=30)
        assert results == {1: True, 0: False}
    finally:
        sys.setswitchinterval(switch_interval)
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_a_watcher_that_sees_its_rank_gone_before_the_undo_still_claims(key):
    """A killed rank's first exiting thread hands the watcher to init while its last thread may
    still be tearing down memory, its counts not yet taken back. Here the watcher is told its
    rank is gone from the start, and the rank is killed 100 ms later: the watcher must wait for
    the undo and claim, not give up at once (CI once named a survivor for that)."""
    rank = start(JOINING_RANK, str(key), "1")
    try:
        claim = _DeathClaim(key, 2, 1)
        result: list[bool] = []
        watcher = threading.Thread(
            target=lambda: result.append(claim.wait_for_death_claim(lambda: True))
        )
        watcher.start()
        time.sleep(0.1)
        assert not result, "the watcher gave up while its rank still counted"
        rank.kill()
        rank.wait(timeout=30)
        watcher.join(timeout=30)
        assert result == [True]
        assert LIBC.semctl(claim.id, _CLAIMED, _GETVAL) == 1
    finally:
        rank.kill()
        rank.wait()


def test_a_gone_rank_that_ended_by_its_own_hand_is_not_waited_for(key):
    claim = _DeathClaim(key, 1, 0)
    claim._semop((claim.slot, 1, 0), (claim.slot, 1, 0))  # alive, then mark_ended's count
    started = time.monotonic()
    assert not claim.wait_for_death_claim(lambda: True, lambda: True)
    assert time.monotonic() - started < 1
    assert LIBC.semctl(claim.id, _CLAIMED, _GETVAL) == 0


def test_a_rank_that_lost_a_peer_waits_until_the_claimant_has_written_not_longer(key):
    """A claim alone does not release the waiting rank: it would abort the job as the watcher
    wakes, and the launcher could close the pipes before the watcher's line is written (this
    lost the victim's line once). The watcher's `mark_named` after writing does."""
    claim = _DeathClaim(key, 2, 0)
    started = time.monotonic()
    assert not claim.wait_until_named(0.2)
    assert 0.15 < time.monotonic() - started < 5
    watcher = _DeathClaim(key, 2, 1)
    watcher._semop((_CLAIMED, 1, 0))  # what the kernel completes for the victim's watcher
    assert not claim.wait_until_named(0.2)
    threading.Timer(0.1, watcher.mark_named).start()
    started = time.monotonic()
    assert claim.wait_until_named(20.0)
    assert time.monotonic() - started < 5


def test_a_rank_that_reports_its_own_error_claims_as_named(key):
    claim = _DeathClaim(key, 2, 0)
    assert claim.claim_now()
    assert not _DeathClaim(key, 2, 1).claim_now()
    assert claim.wait_until_named(0.0)


def test_a_killed_rank_is_named_once_with_its_task_and_the_set_is_removed(launcher_key):
    environments = [{"MPI_LOCALRANKID": str(r), "MPI_LOCALNRANKS": "2"} for r in (0, 1)]
    ranks = [start(WATCHED_RANK, "sleep", env=env) for env in environments]
    assert existing_set(launcher_key) is not None
    victim_says = kill(ranks[1])
    assert LIBC.semctl(existing_set(launcher_key), _CLAIMED, _GETVAL) == 2  # claimed and named
    survivor_says = kill(ranks[0])
    died = [line for line in victim_says.splitlines() if "died" in line]
    expected = "legion-nn train: rank 1 died in step 7, task L1.filter: killed by a signal"
    assert died == [f"{expected} (or a crash in native code)"]
    assert "died" not in survivor_says
    assert existing_set(launcher_key) is None


def test_ranks_that_end_by_their_own_hand_are_not_named(launcher_key):
    environments = [{"MPI_LOCALRANKID": str(r), "MPI_LOCALNRANKS": "2"} for r in (0, 1)]
    ranks = [start(WATCHED_RANK, "end", env=env) for env in environments]
    for rank in ranks:
        _, stderr = rank.communicate("go\n", timeout=30)
        assert rank.returncode == 0
        assert "died" not in stderr
    assert existing_set(launcher_key) is None


def test_after_a_rank_reports_its_own_error_the_deaths_that_follow_are_not_named(launcher_key):
    reporter = start(WATCHED_RANK, "report", env={"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"})
    other = start(WATCHED_RANK, "sleep", env={"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    _, reporter_says = reporter.communicate("go\n", timeout=30)
    assert reporter.returncode == 1
    other_says = kill(other)
    assert "died" not in reporter_says + other_says
    assert existing_set(launcher_key) is None


def test_a_rank_outside_the_slots_gets_no_claim():
    assert _DeathClaim.for_launcher(os.getpid(), slots=2, slot=2) is None
    assert _DeathClaim.for_launcher(os.getpid(), slots=2, slot=-1) is None


def test_a_watcher_without_a_claim_still_names_its_rank():
    """Where System V semaphores are unavailable, every death is named: a line too many, none
    missing."""
    code = WATCHED_RANK.replace(
        "from runtime.supervisor import start_watcher",
        "from runtime import supervisor\n"
        "supervisor._DeathClaim.for_launcher = classmethod(lambda *a: None)\n"
        "start_watcher = supervisor.start_watcher",
    )
    rank = start(code, "sleep", env={"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"})
    assert "rank 0 died in step 7, task L0.filter" in kill(rank)


@pytest.mark.parametrize("ended", [True, False])
def test_the_last_watcher_waits_for_its_ranks_counts_before_removing_the_set(key, ended):
    """The watcher can see its rank gone before the kernel has taken back the rank's counts
    (they go back in the rank's last exiting thread). Here the test plays the dying rank: its
    slot and membership still count when the watcher looks, and go back 50 ms later, as the
    kernel's undo would. The watcher must still remove the set."""
    claim = _DeathClaim(key, 1, 0)
    ops = [(claim.slot, 1, 0), (supervisor._MEMBERS, 1, 0)]
    if ended:
        ops.append((claim.slot, 1, 0))  # mark_ended's count, which death leaves in place
    claim._semop(*ops)

    def undo() -> None:
        time.sleep(0.05)
        claim._semop((claim.slot, -1, 0), (supervisor._MEMBERS, -1, 0))

    undoing = threading.Thread(target=undo)
    undoing.start()
    claim.remove_if_unused(ended=ended)
    undoing.join(timeout=30)
    assert existing_set(key) is None


def test_a_watcher_leaves_the_set_to_ranks_still_alive(key):
    claim = _DeathClaim(key, 2, 0)
    other = _DeathClaim(key, 2, 1)
    other._semop((other.slot, 1, 0), (supervisor._MEMBERS, 1, 0))  # rank 1 is alive
    claim.remove_if_unused(ended=False)
    assert existing_set(key) == claim.id


def test_the_page_keeps_the_mpi_segments_apart_from_the_task():
    from runtime.supervisor import Status

    status = Status(3)
    status.set(7, "L1.filter.grad")
    status.set_segments(["/dev/shm/mpich_shm_1a2b_0", "/dev/shm/other", "/dev/shm/mpich_x"])
    assert status.read() == ("3", "7", "L1.filter.grad")
    # only the MPI library's segments are ever removed
    assert status.segments() == ["/dev/shm/mpich_shm_1a2b_0", "/dev/shm/mpich_x"]
    status.set(8, "x" * 1000)  # a long task name stays in its half of the page
    assert status.segments() == ["/dev/shm/mpich_shm_1a2b_0", "/dev/shm/mpich_x"]
