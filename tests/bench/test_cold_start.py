"""`bench/cold_start.py` runs the rows it names: one per thread count for one process, each child
given its thread count and its own Numba cache."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.cold_start import timed, variants

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "cold_start.py"


def test_one_process_runs_once_per_thread_count_and_mpiexec_once():
    assert variants("1,2", "1,2") == [
        (1, 1, "1 process, 1 thread"),
        (1, 2, "1 process, 2 threads"),
        (2, None, "mpiexec -n 2"),
    ]
    assert variants("1", None) == [(1, None, "1 process")]
    assert variants("4", "1") == [(4, None, "mpiexec -n 4")]


@pytest.mark.parametrize(
    ("ranks", "threads", "flag"),
    [("0", None, "--ranks"), ("1", "x", "--threads"), ("1", "2,-1", "--threads")],
)
def test_counts_that_are_not_positive_integers_are_named(ranks, threads, flag):
    with pytest.raises(ValueError, match=flag):
        variants(ranks, threads)


def test_bad_threads_exit_2_with_one_line():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--threads", "two"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "cold_start: --threads: 'two' is not a positive integer"
    ]


@pytest.mark.parametrize("threads", [1, 3])
def test_a_child_runs_with_its_thread_count_and_cache(tmp_path, threads):
    report = (
        f"import os; assert os.environ['NUMBA_CACHE_DIR'] == {str(tmp_path)!r}; "
        "print('done in', os.environ['NUMBA_NUM_THREADS'], 's')"
    )
    wall, reported = timed([sys.executable, "-c", report], str(tmp_path), True, threads)
    assert reported == threads
    assert wall > 0
