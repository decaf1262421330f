"""The rank watcher: the process the launcher started waits for its rank (a forked child), names
it when a signal killed it, and otherwise ends as it ended. Under `mpiexec` see
tests/runtime/test_distributed.py; here the launcher is the test."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.supervisor import Status, mapped_segments, release_segments

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux watchers")

#: a rank under its watcher: it says its pid, then does what argv[1] says once told to go on
WATCHED_RANK = """
import os, signal, sys, time
from runtime.supervisor import start_watcher
status = start_watcher(3)
status.set(7, "L1.filter")
def handle(number, _frame):
    print(f"rank got {signal.Signals(number).name}", flush=True)
    os._exit(5)
if sys.argv[1] == "handle":
    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
print(os.getpid(), flush=True)
sys.stdin.readline()
if sys.argv[1].startswith("exit"):
    sys.exit(int(sys.argv[1][4:]))
if sys.argv[1] == "segv":
    os.kill(os.getpid(), signal.SIGSEGV)
time.sleep(120)
"""


def start(what: str, tmp_path: Path, session: bool = False) -> tuple[subprocess.Popen, int]:
    """The watcher (the process started here) and its rank's pid; with `session`, the two in a
    process group of their own, as hydra starts them."""
    watcher = subprocess.Popen(
        [sys.executable, "-c", WATCHED_RANK, what],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        start_new_session=session,
    )
    rank = int(watcher.stdout.readline())
    assert rank != watcher.pid
    return watcher, rank


def gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("number", [signal.SIGKILL, signal.SIGSEGV])
def test_a_killed_rank_is_named_and_its_watcher_dies_of_the_same_signal(tmp_path, number):
    """One line with rank, step, task and signal; then the launcher sees the signal itself."""
    watcher, rank = start("sleep", tmp_path)
    killed = time.monotonic()
    os.kill(rank, number)
    _, stderr = watcher.communicate(timeout=30)
    assert time.monotonic() - killed < 5
    name = signal.Signals(number).name
    expected = f"legion-nn train: rank 3 died in step 7, task L1.filter: killed by {name}"
    assert stderr.splitlines() == [expected]
    assert watcher.returncode == -number


def test_a_rank_that_crashes_by_itself_is_named(tmp_path):
    watcher, _ = start("segv", tmp_path)
    _, stderr = watcher.communicate("go\n", timeout=30)
    assert "rank 3 died in step 7, task L1.filter: killed by SIGSEGV" in stderr
    assert watcher.returncode == -signal.SIGSEGV


@pytest.mark.parametrize("code", [0, 3])
def test_a_rank_that_exits_is_not_named_and_its_status_is_the_watchers(tmp_path, code):
    watcher, rank = start(f"exit{code}", tmp_path)
    _, stderr = watcher.communicate("go\n", timeout=30)
    assert watcher.returncode == code
    assert "died" not in stderr
    assert gone(rank)


def test_a_killed_watcher_takes_its_rank_with_it_and_says_nothing(tmp_path):
    """What the launcher does to the ranks still alive after the first death."""
    watcher, rank = start("sleep", tmp_path)
    watcher.kill()
    _, stderr = watcher.communicate(timeout=30)
    assert gone(rank), "the rank outlived its watcher"
    assert stderr == ""


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_process_group_reaches_the_rank_once_and_the_watcher_outlives_it(
    tmp_path, number
):
    """Hydra sends Ctrl-C and SIGTERM to the whole process group: the rank handles it (here it
    says so and exits 5), and the watcher stays to end as the rank ended."""
    watcher, _ = start("handle", tmp_path, session=True)
    os.killpg(watcher.pid, number)
    stdout, stderr = watcher.communicate(timeout=30)
    assert stdout.splitlines() == [f"rank got {signal.Signals(number).name}"]
    assert watcher.returncode == 5
    assert "died" not in stderr


def test_a_rank_that_dies_of_sigterm_is_named(tmp_path):
    """A scheduler's SIGTERM that the rank does not handle: a death like any other."""
    watcher, _ = start("sleep", tmp_path, session=True)
    os.killpg(watcher.pid, signal.SIGTERM)
    _, stderr = watcher.communicate(timeout=30)
    assert stderr.splitlines() == [
        "legion-nn train: rank 3 died in step 7, task L1.filter: killed by SIGTERM"
    ]
    assert watcher.returncode == -signal.SIGTERM


def test_a_rank_killed_before_its_first_task_is_named_in_start_up():
    status = Status(None)
    assert (
        status.death(signal.SIGKILL)
        == "legion-nn train: rank ? died in start-up: killed by SIGKILL"
    )
    status.set_rank(2)
    status.set(8, "x" * 1000)  # a long task name is cut to the page
    rank, step, task = status.read()
    assert (rank, step) == ("2", "8") and task == "x" * len(task) and 400 < len(task) < 512


def test_release_segments_unlinks_only_mpis_and_the_mapping_stays(tmp_path):
    ours = Path(f"/dev/shm/mpich_test_{os.getpid()}")
    other = Path(f"/dev/shm/legion_nn_test_{os.getpid()}")
    maps = []
    try:
        for path in (ours, other):
            path.write_bytes(b"segment!" * 512)
            with path.open("r+b") as file:
                maps.append(mmap.mmap(file.fileno(), 0))
        assert str(ours) in mapped_segments()
        assert str(other) not in mapped_segments()
        assert str(ours) in release_segments()
        assert not ours.exists() and other.exists()
        assert maps[0][:8] == b"segment!"  # the ranks go on using what they mapped
        assert str(ours) not in release_segments()  # another rank of the host got there first
    finally:
        for mapping in maps:
            mapping.close()
        for path in (ours, other):
            path.unlink(missing_ok=True)
