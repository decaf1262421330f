"""A training job that survives a lost rank: rerun it from its newest checkpoint, up to K times.

MPI ends the whole job when a rank dies (hydra kills the others, and the rank's watcher names
the rank, step and task it died in: `runtime.supervisor`). What survives is the checkpoint
directory, whose files are whole whatever the moment of death (`runtime.checkpoint`). So the
launcher (`legion-nn launch`, `legion-nn cluster run`) reruns the same command with `--resume`,
and the run continues exactly where its newest checkpoint stands, on however many ranks.

Not every failure is worth a rerun: exit status 2 is a bad input, which fails the same way
again, and 130 or 143 a person stopping the job (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from legion_nn.errors import LegionNNError
from runtime import checkpoint

#: exit statuses that a rerun would not change
NOT_RESTARTED = {0: "done", 2: "bad input", 130: "interrupted", 143: "terminated"}


def exit_status(returncode: int) -> int:
    """A job's exit status as a shell gives it: 128 + n for a job killed by signal n (what
    `NOT_RESTARTED` reads), where `subprocess` gives −n."""
    return 128 - returncode if returncode < 0 else returncode


def checkpoint_dir(command: Sequence[str]) -> str | None:
    """The `--checkpoint DIR` of a `legion-nn train` command line, if it has one."""
    for i, word in enumerate(command):
        if word == "--checkpoint" and i + 1 < len(command):
            return command[i + 1]
        if word.startswith("--checkpoint="):
            return word.split("=", 1)[1]
    return None


def check_restartable(command: Sequence[str], max_restarts: int) -> str | None:
    """The checkpoint directory a job restarts from (None without restarts); one line when the
    job cannot restart."""
    if max_restarts < 0:
        raise LegionNNError(f"--max-restarts must be 0 or more, got {max_restarts}")
    if max_restarts == 0:
        return None
    if "train" not in command:
        raise LegionNNError("--max-restarts restarts a training job: the command must be a train")
    directory = checkpoint_dir(command)
    if directory is None:
        raise LegionNNError(
            "--max-restarts needs the job to write checkpoints to restart from "
            "(train --checkpoint DIR, and --checkpoint-every N)"
        )
    return directory


def run_with_restarts(
    run_job: Callable[[list[str]], int],
    command: Sequence[str],
    max_restarts: int,
    say: Callable[[str], None],
) -> int:
    """Run `command` with `run_job` (its exit status), and again with `--resume` from the newest
    checkpoint each time it fails, `max_restarts` times at most; the last run's status."""
    directory = check_restartable(command, max_restarts)
    words = list(command)
    status = run_job(words)
    for attempt in range(1, max_restarts + 1):
        if status in NOT_RESTARTED:
            break
        newest = checkpoint.newest(directory)
        where = "from the start (no checkpoint yet)"
        if newest.exists():
            where = f"from {newest.resolve()}"
            if "--resume" not in words:
                words = [*words, "--resume"]
        say(f"the job ended with status {status}; restart {attempt} of {max_restarts} {where}")
        status = run_job(words)
    return status
