"""The `legion-nn` command: one sub-command per module in `cli.commands`.

Each command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`, and
imports the heavier packages (partitioner, runtime, visualize) inside `run`, so `legion-nn --help`
stays fast. Every `LegionNNError` and every bad file becomes one line on stderr and exit status 2;
nothing a user can cause ends in a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from contextlib import nullcontext

#: Numba's OpenMP threads spin in a barrier for a while (GNU libgomp: 300,000 polls, about a
#: millisecond) before they sleep. When another process holds one of the cores, a parallel loop
#: waits a whole time slice for its descheduled thread while the others burn theirs spinning:
#: seed-lcn-small's step went from 5 ms to 123 ms beside one busy process. 3,000 polls keep the
#: launch of a small loop as fast on an idle machine (5.1 ms a step) and give 10 ms beside the
#: busy process. libgomp reads the setting when Numba first loads it, at the first parallel loop,
#: so the command sets it for its process before any kernel runs; a user's own setting wins.
OPENMP_SPIN_POLLS = "3000"
#: OpenBLAS's idle threads spin for 2**28 cycles (about 0.1 s) after each threaded call before
#: they sleep, on the cores the next Numba kernel wants: on a 2-core Intel Xeon VM the seed's L1
#: untied forward took 128-159 ms right after a 2048² SGEMM and 80-101 ms after a pause (or with
#: this setting), and `bench step`, which measures an SGEMM beside each step, found its first
#: tasks at 2.4-8.5× their bounds. 2**4 cycles, OpenBLAS's least: its threads sleep at once, and
#: a threaded call wakes them in microseconds. OpenBLAS reads it as NumPy loads it, so the
#: command sets it before anything imports NumPy; a user's own setting wins.
OPENBLAS_SPIN_EXPONENT = "4"

#: the commands that plan, predict or start a job: what each allocates it keeps to its end (the
#: graph, plans, rank programs, a job's kernels), so the cycle collector is paused while it runs
#: (`legion_nn.cycles`; a job's steps collect their own garbage, `runtime.training`), where
#: `bench`, `cluster`, `launch` and `trace` keep it: they loop over jobs and their output
PAUSES_COLLECTION = frozenset({"graph", "memory", "partition", "predict", "render", "train"})

COMMANDS = (
    "bench",
    "cluster",
    "graph",
    "launch",
    "memory",
    "partition",
    "predict",
    "render",
    "trace",
    "train",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="legion-nn",
        description="Compile networks to Legion-style task graphs, partition them, train them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        module = importlib.import_module(f"cli.commands.{name}")
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def quiet_idle_threads() -> None:
    """Bound how long the thread pools of Numba's OpenMP layer and of OpenBLAS spin when idle
    (`OPENMP_SPIN_POLLS`, `OPENBLAS_SPIN_EXPONENT`), where the user has not: before NumPy or a
    kernel is loaded, which is when each library reads its setting."""
    os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_POLLS)
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_SPIN_EXPONENT)


def main(argv: list[str] | None = None) -> int:
    from legion_nn.cycles import no_cycle_collection
    from legion_nn.errors import LegionNNError

    quiet_idle_threads()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with no_cycle_collection() if args.command in PAUSES_COLLECTION else nullcontext():
            return int(args._run(args) or 0)
    except LegionNNError as exc:
        print(f"legion-nn {args.command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"legion-nn {args.command}: {exc.filename or ''}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"legion-nn {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The `legion-nn` command: `main`, then the process's exit, which need not walk the
    command's objects (`skip_collection_at_exit`)."""
    from legion_nn.cycles import skip_collection_at_exit

    code = main()
    skip_collection_at_exit()
    sys.exit(code)


if __name__ == "__main__":
    entry()
