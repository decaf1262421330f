"""Jobs worked out ahead in forked processes: their values, each job done once (by a process or
by the caller, never both), and no process left when the `Foresight` is closed."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from runtime.step.foresight import Foresight, shared_out
from tests.fresh_process import in_fresh_process

WAIT = 60.0  # seconds, far beyond a fork on a loaded machine


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.005)


def _marked(folder: Path, name: str, value: object) -> tuple[object, int]:
    """Leave a mark that the job began, and give its value and the process it ran in."""
    (folder / name).touch()
    return value, os.getpid()


def _held(folder: Path, name: str, value: object) -> tuple[object, int]:
    """`_marked`, then wait for the test to let it end."""
    (folder / name).touch()
    _wait_for(folder / f"{name}.release")
    return value, os.getpid()


def _raises(folder: Path) -> None:
    (folder / "raises").touch()
    raise ValueError("the caller meets this itself")


def _dies(folder: Path) -> None:
    (folder / "dies").touch()
    os._exit(3)


def _three_jobs(folder: Path, held: str) -> dict[str, partial]:
    """Jobs a, b and c, each leaving its mark and giving its name in capitals; `held` then waits
    for the test to let it end."""
    return {name: partial(_held if name == held else _marked, folder, name, name.upper())
            for name in "abc"}  # fmt: skip


def _works_jobs_out_in_order(tmp_path: Path) -> None:
    jobs = _three_jobs(tmp_path, held="a")
    foresight = Foresight(jobs, workers=1)
    _wait_for(tmp_path / "a")  # the one process is at a; b and c wait
    assert foresight.take("c") == (False, None)  # the caller's now
    (tmp_path / "a.release").touch()
    done, (value, pid) = foresight.take("a")
    assert done and value == "A" and pid != os.getpid()
    _wait_for(tmp_path / "b")  # the process went on to b, not to c
    assert foresight.take("b") == (True, ("B", pid))
    assert foresight.take("a") == (False, None)  # a job is taken once
    assert foresight.take("unknown") == (False, None)
    foresight.close()
    assert not (tmp_path / "c").exists()
    assert multiprocessing.active_children() == []


def _shares_jobs(tmp_path: Path) -> None:
    jobs = {name: partial(_held, tmp_path, name, name.upper()) for name in ("a", "b")}
    foresight = Foresight(jobs, workers=2)
    _wait_for(tmp_path / "a")
    _wait_for(tmp_path / "b")  # both begun at once: one process each
    for name in jobs:
        (tmp_path / f"{name}.release").touch()
    (done_a, (a, pid_a)), (done_b, (b, pid_b)) = foresight.take("a"), foresight.take("b")
    assert done_a and done_b and (a, b) == ("A", "B")
    assert len({pid_a, pid_b, os.getpid()}) == 3
    foresight.close()


def _shares_out_with_something_meanwhile(tmp_path: Path) -> None:
    """`shared_out` with two jobs and one process: the process takes the first, this one the
    last, after calling `meanwhile` once, here, while the process is at its job."""
    called = []

    def meanwhile() -> None:
        _wait_for(tmp_path / "a")  # the process began its job
        called.append(os.getpid())
        (tmp_path / "a.release").touch()

    jobs = {"a": partial(_held, tmp_path, "a", "A"), "b": partial(_marked, tmp_path, "b", "B")}
    found = shared_out(jobs, 1, meanwhile)
    assert list(found) == ["a", "b"] and [v for v, _ in found.values()] == ["A", "B"]
    assert called == [os.getpid()] == [found["b"][1]] != [found["a"][1]]


def _leaves_a_raising_job(tmp_path: Path) -> None:
    foresight = Foresight({"raises": partial(_raises, tmp_path)}, workers=1)
    _wait_for(tmp_path / "raises")
    assert foresight.take("raises") == (False, None)
    foresight.close()


def _leaves_a_dead_process_jobs(tmp_path: Path) -> None:
    jobs = {"dies": partial(_dies, tmp_path), "after": partial(_marked, tmp_path, "after", 1)}
    foresight = Foresight(jobs, workers=1)
    _wait_for(tmp_path / "dies")
    assert foresight.take("dies") == (False, None)
    assert foresight.take("after") == (False, None)  # no process is left to begin it
    foresight.close()
    assert not (tmp_path / "after").exists()


def _ends_a_process_at_its_job(tmp_path: Path) -> None:
    foresight = Foresight({"a": partial(_held, tmp_path, "a", "A")}, workers=1)
    _wait_for(tmp_path / "a")
    started = time.monotonic()
    foresight.close()
    assert multiprocessing.active_children() == []
    assert time.monotonic() - started < WAIT / 2  # ended, not waited for
    foresight.close()  # again: nothing to do
    assert foresight.take("a") == (False, None)


def _forks_nothing(tmp_path: Path, reason: str) -> None:
    jobs = {"a": partial(_marked, tmp_path, "a", "A")}
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    if reason == "another thread runs":
        thread.start()
    try:
        foresight = Foresight(jobs, workers=0 if reason == "no spare core" else 2)
        assert multiprocessing.active_children() == []
        assert foresight.take("a") == (False, None)
        foresight.close()
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
    assert not (tmp_path / "a").exists()


def _skips_jobs_forgone(tmp_path: Path) -> None:
    jobs = _three_jobs(tmp_path, held="a")
    foresight = Foresight(jobs, workers=1)
    _wait_for(tmp_path / "a")
    foresight.forgo(["b"])  # not begun: never will be
    (tmp_path / "a.release").touch()
    done, (value, pid) = foresight.take("a")
    assert done and value == "A" and pid != os.getpid()
    # the process went on past b; waited for, since a loaded machine may let this process ask
    # for c before the other has taken it (and the caller's then)
    _wait_for(tmp_path / "c")
    assert foresight.take("c") == (True, ("C", pid))
    assert not (tmp_path / "b").exists()
    assert foresight.take("b") == (False, None)
    foresight.close()


def _ends_a_process_at_a_job_forgone(tmp_path: Path) -> None:
    jobs = _three_jobs(tmp_path, held="b")
    foresight = Foresight(jobs, workers=1)
    _wait_for(tmp_path / "b")  # a is done and sent; the process is at b
    (process,) = multiprocessing.active_children()
    foresight.forgo(["b"])
    process.join(WAIT / 2)
    assert not process.is_alive()  # ended at b, not waited for
    done, (value, pid) = foresight.take("a")  # what it sent before is kept
    assert done and value == "A" and pid == process.pid
    assert foresight.take("c") == (False, None)  # no process is left to begin it
    foresight.close()
    assert not (tmp_path / "c").exists()
    assert multiprocessing.active_children() == []


def _tells_when_busy(tmp_path: Path) -> None:
    jobs = {name: partial(_held, tmp_path, name, name.upper()) for name in ("a", "b", "c")}
    foresight = Foresight(jobs, workers=1)
    _wait_for(tmp_path / "a")
    assert foresight.busy()  # at a, with b and c waiting
    (tmp_path / "a.release").touch()
    assert foresight.take("a")[0]
    _wait_for(tmp_path / "b")
    foresight.forgo(["c"])
    assert foresight.busy()  # at b, still wanted
    foresight.forgo(["b"])
    assert not foresight.busy()  # ended at b; c never begun
    foresight.close()
    assert not foresight.busy()


# each runs in a spawned interpreter (`tests.fresh_process`): forking needs a process with no
# other thread, which this test worker may not be


def test_a_process_works_jobs_out_in_order_and_leaves_the_caller_those_none_began(tmp_path):
    in_fresh_process(_works_jobs_out_in_order, tmp_path)


def test_jobs_are_shared_by_the_processes(tmp_path):
    in_fresh_process(_shares_jobs, tmp_path)


def test_jobs_shared_out_leave_this_process_its_own_work_meanwhile(tmp_path):
    in_fresh_process(_shares_out_with_something_meanwhile, tmp_path)


def test_a_job_that_raises_is_left_to_the_caller(tmp_path):
    in_fresh_process(_leaves_a_raising_job, tmp_path)


def test_the_jobs_of_a_process_that_died_are_left_to_the_caller(tmp_path):
    in_fresh_process(_leaves_a_dead_process_jobs, tmp_path)


def test_closing_ends_a_process_at_its_job(tmp_path):
    in_fresh_process(_ends_a_process_at_its_job, tmp_path)


@pytest.mark.parametrize("reason", ["no spare core", "another thread runs"])
def test_nothing_is_forked_without_a_spare_core_or_beside_another_thread(tmp_path, reason):
    in_fresh_process(_forks_nothing, tmp_path, reason)


def test_a_job_forgone_before_a_process_begins_it_is_never_begun(tmp_path):
    in_fresh_process(_skips_jobs_forgone, tmp_path)


def test_a_process_at_a_job_forgone_is_ended_and_what_it_sent_is_kept(tmp_path):
    in_fresh_process(_ends_a_process_at_a_job_forgone, tmp_path)


def test_a_foresight_is_busy_while_a_process_is_at_a_job_still_wanted(tmp_path):
    in_fresh_process(_tells_when_busy, tmp_path)
