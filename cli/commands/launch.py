"""`legion-nn launch -n R [--hostfile F] [--max-restarts K] -- COMMAND...`: torchrun's role for
MPI jobs.

It runs COMMAND as one `mpiexec` job of R ranks (on the hosts of an MPICH host file where one is
given). When a rank dies, its watcher names the rank, step and task (`runtime.supervisor`) and
MPI ends the job; with `--max-restarts K` a training job is then started again from its newest
checkpoint, K times at most, each restart said in one line (`runtime.restarts`). The exit status
is the last run's.
"""

from __future__ import annotations

import argparse

NAME = "launch"
HELP = "run a command as an mpiexec job of R ranks, restarting a training job that loses a rank"


def add_max_restarts(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="when the job fails (a rank lost, a stall), start a training job again from its "
        "newest checkpoint (train --checkpoint DIR), K times at most (default 0)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", type=int, required=True, metavar="R", help="ranks")
    parser.add_argument(
        "--hostfile",
        metavar="F",
        help="MPICH's host file: one host a line, as host or host:slots (default: this host)",
    )
    add_max_restarts(parser)
    parser.add_argument(
        "job", nargs=argparse.REMAINDER, metavar="command", help="-- COMMAND... run on every rank"
    )


def job_words(args: argparse.Namespace, usage: str) -> list[str]:
    """The command after `--`; one line, showing `usage`, when there is none."""
    from legion_nn.errors import LegionNNError

    words = args.job[1:] if args.job[:1] == ["--"] else args.job
    if not words:
        raise LegionNNError(f"no command ({usage})")
    return words


def run(args: argparse.Namespace) -> int:
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from legion_nn.errors import LegionNNError
    from runtime.restarts import check_restartable, exit_status, run_with_restarts

    words = job_words(args, "legion-nn launch -n R -- COMMAND...")
    if args.n < 1:
        raise LegionNNError(f"-n: expected a positive rank count, got {args.n}")
    check_restartable(words, args.max_restarts)
    if shutil.which("mpiexec") is None:
        raise LegionNNError("launch: mpiexec not found (pip install mpich)")
    mpiexec = ["mpiexec", "-n", str(args.n)]
    if args.hostfile:
        if not Path(args.hostfile).is_file():
            raise LegionNNError(f"--hostfile {args.hostfile}: no such file")
        mpiexec += ["-f", args.hostfile]

    def run_job(command: list[str]) -> int:
        job = subprocess.Popen([*mpiexec, *command])
        try:
            code = job.wait()
        except KeyboardInterrupt:  # mpiexec has the Ctrl-C too: let it end the ranks
            try:
                job.wait(timeout=10)
            except subprocess.TimeoutExpired:
                job.kill()
            return 130
        return exit_status(code)

    def say(line: str) -> None:
        print(f"legion-nn launch: {line}", file=sys.stderr, flush=True)

    return run_with_restarts(run_job, words, args.max_restarts, say)
