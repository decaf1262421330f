"""What the benchmarks' jobs report when a command fails (`bench.jobs.failure_line`)."""

import subprocess
import sys

from bench.jobs import failure_line


def test_a_failed_commands_own_error_is_reported_not_the_launchers_last_line():
    stderr = (
        "some warning\n"
        "legion-nn train: rank 1 waited 60 s for rank 0 (a stall)\n"
        "Abort(1) on node 1 (rank 1 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 1)\n"
    )
    assert failure_line(stderr) == "legion-nn train: rank 1 waited 60 s for rank 0 (a stall)"


def test_without_an_own_error_the_last_line_is_reported():
    assert failure_line("first\n  Killed  \n\n") == "Killed"
    assert failure_line("") == "no output"


def test_a_real_commands_bad_input_is_the_line_reported():
    done = subprocess.run(
        [sys.executable, "-m", "cli", "train", "seed-lcn-small", "--steps", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    line = failure_line(done.stderr)
    assert line.startswith("legion-nn train: ") and "steps" in line
