"""`legion-nn launch` and `cluster run --max-restarts`: which failures restart, from where, and
the one-line errors (the restarted MPI job itself: `tests/runtime/test_distributed.py`)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from legion_nn.errors import LegionNNError
from runtime import checkpoint
from runtime.restarts import checkpoint_dir, run_with_restarts
from tests.cli_in_process import run_in_process
from tests.paths import ROOT


def _jobs(statuses, directory, write_checkpoint_after=0):
    """A fake `run_job` that returns `statuses` in turn, recording each command; the first
    `write_checkpoint_after`-th run leaves a checkpoint behind."""
    runs = []

    def run_job(words):
        runs.append(list(words))
        if len(runs) == write_checkpoint_after:
            checkpoint.save(directory, {"w": np.zeros(1)}, {"step": 7})
        return statuses[len(runs) - 1]

    return run_job, runs


def test_a_failed_job_restarts_with_resume_once_there_is_a_checkpoint(tmp_path):
    said = []
    command = ["legion-nn", "train", "--checkpoint", str(tmp_path)]
    run_job, runs = _jobs([9, 1, 0], tmp_path, write_checkpoint_after=2)
    assert run_with_restarts(run_job, command, 3, said.append) == 0
    assert runs == [command, command, [*command, "--resume"]]
    assert (
        said[0] == "the job ended with status 9; restart 1 of 3 from the start (no checkpoint yet)"
    )
    assert said[1] == (
        f"the job ended with status 1; restart 2 of 3 from {tmp_path}/checkpoint-00000007.npz"
    )


@pytest.mark.parametrize(("statuses", "runs_made", "status"), [
    ([9, 9, 9, 9], 3, 9),  # out of restarts: the last status
    ([2, 0], 1, 2),  # a bad input fails alike again
    ([130, 0], 1, 130),  # Ctrl-C
    ([143, 0], 1, 143),  # SIGTERM
    ([0], 1, 0),
])  # fmt: skip
def test_which_failures_restart(tmp_path, statuses, runs_made, status):
    command = ["legion-nn", "train", f"--checkpoint={tmp_path}"]
    run_job, runs = _jobs(statuses, tmp_path)
    assert run_with_restarts(run_job, command, 2, lambda line: None) == status
    assert len(runs) == runs_made


def test_the_checkpoint_directory_of_a_command():
    assert checkpoint_dir(["train", "--checkpoint", "d", "--steps", "3"]) == "d"
    assert checkpoint_dir(["train", "--checkpoint=e"]) == "e"
    assert checkpoint_dir(["train", "--steps", "3"]) is None


@pytest.mark.parametrize(("command", "message"), [
    (["legion-nn", "train"], "--max-restarts needs the job to write checkpoints"),
    (["legion-nn", "predict", "m.onnx"], "the command must be a train"),
])  # fmt: skip
def test_restarts_need_a_checkpointing_training_job(command, message):
    with pytest.raises(LegionNNError, match=message):
        run_with_restarts(lambda words: 0, command, 1, print)
    assert run_with_restarts(lambda words: 0, command, 0, print) == 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        capture_output=True, text=True, check=False, cwd=ROOT, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(("args", "message"), [
    (["launch", "-n", "2"], "no command (legion-nn launch -n R -- COMMAND...)"),
    (["launch", "-n", "0", "--", "legion-nn", "train"], "-n: expected a positive rank count, got 0"),
    (["launch", "-n", "2", "--max-restarts", "-1", "--", "legion-nn", "train"],
     "--max-restarts must be 0 or more, got -1"),
    (["launch", "-n", "2", "--hostfile", "/nonexistent/hosts", "--", "legion-nn", "train"],
     "--hostfile /nonexistent/hosts: no such file"),
    (["launch", "-n", "2", "--max-restarts", "1", "--", "legion-nn", "train", "--steps", "2"],
     ("--max-restarts needs the job to write checkpoints to restart from (train --checkpoint "
      "DIR, and --checkpoint-every N)")),
])  # fmt: skip
def test_bad_launch_input_is_one_line(args, message):
    result = run_in_process(*args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"legion-nn launch: {message}"]


@pytest.mark.serial
def test_a_bad_input_is_not_restarted(tmp_path):
    """The training job's own one-line error (exit 2) ends the launch: it would fail again."""
    result = _cli("launch", "-n", "1", "--max-restarts", "2", "--", sys.executable, "-m",
                  "cli", "train", "--checkpoint", str(tmp_path / "c"), "--batch", "0")  # fmt: skip
    assert result.returncode == 2
    assert "--batch must be at least 1" in result.stderr and "restart" not in result.stderr
