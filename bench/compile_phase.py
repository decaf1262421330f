"""Benchmark: where a cold start's compiling goes, process by process and unit by unit.

    python bench/compile_phase.py [--repeat 6] [--trees DIR[,DIR...]] [--timeline] [--json F]
                                  [-- TRAIN ARGS...]

Each run is `legion-nn train --no-progress` (the default job unless TRAIN ARGS say otherwise) in
one process, on a new, empty Numba cache, in a child Python that times, in the run and in every
helper it forks: `runtime.compile_ahead.compile_ahead` (the phase, from its start to its end),
each compile unit (`runtime.compile_units.warm`), and the compiled GEMM's lock
(`microkernel._compiled_once`: waited for, held, released). The code it times is the tree's own; the
child only wraps it. With several `--trees` (checkouts of this repository, such as a `git
worktree` of a base commit) the runs alternate between them, a run of each in turn, so that a
change is measured beside its base in the same minutes: on a VM whose speed moves by the hour,
that is what makes a tenth of a second visible. Printed per tree: the phase's median and every
run's, and with `--timeline` each run's events (seconds from the child's start, process id).

`bench/cold_start.py` times the whole command, cold and warm; this times the part a cold cache
adds, and shows which process waited for which.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.jobs import command_environment
from bench.machine_facts import describe, machine_facts
from legion_nn.atomic import write_text

#: what a child writes to its stderr before each event's JSON
MARK = "@compile_phase "

_CHILD = f"""
import json, os, sys, time
from contextlib import contextmanager
START = time.perf_counter()

def event(what, **fields):
    record = dict(what=what, pid=os.getpid(), t=time.perf_counter() - START, **fields)
    os.write(2, ({MARK!r} + json.dumps(record) + "\\n").encode())

import numpy as np
from runtime import compile_ahead, compile_units
from runtime.kernels import microkernel

def warm(units, dtype):
    for name in units:
        begun = time.perf_counter()
        compile_units.UNITS[name].warm(np.dtype(dtype))
        event("unit", unit=name, seconds=time.perf_counter() - begun)

compile_units.warm = compile_ahead.warm = warm
ahead = compile_ahead.compile_ahead

def timed_ahead(units, *args, **kwargs):
    event("phase start", units=list(units))
    ahead(units, *args, **kwargs)
    event("phase end")

compile_ahead.compile_ahead = timed_ahead
once = microkernel._compiled_once

@contextmanager
def timed_once(dtype):
    event("gemm lock wait")
    with once(dtype):
        event("gemm lock held")
        yield
    event("gemm lock released")

microkernel._compiled_once = timed_once
from cli.main import main
sys.exit(main(["train", "--no-progress", *sys.argv[1:]]))
"""


def events_of(stderr: str) -> list[dict]:
    """The events a child wrote, in the order written."""
    return [json.loads(line[len(MARK) :]) for line in stderr.splitlines() if line.startswith(MARK)]


def phase_seconds(events: list[dict]) -> float:
    """From the compile phase's start to its end, in the run's own process."""
    start = next(e for e in events if e["what"] == "phase start")
    end = next(e for e in events if e["what"] == "phase end" and e["pid"] == start["pid"])
    return end["t"] - start["t"]


def run_once(tree: Path, train_args: list[str]) -> list[dict]:
    """The events of one cold run of the job in `tree`."""
    with tempfile.TemporaryDirectory(prefix="numba-phase-") as cache:
        env = dict(command_environment(True), NUMBA_CACHE_DIR=cache, PYTHONPATH=str(tree))
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, *train_args],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"the job in {tree} exited {done.returncode}: {tail[0]}")
    return events_of(done.stderr)


def timeline(events: list[dict]) -> str:
    """One line per event: seconds from the child's start, process, what."""
    lines = []
    for e in events:
        detail = ""
        if e["what"] == "unit":
            detail = f" {e['unit']} ({e['seconds']:.2f} s)"
        elif e["what"] == "phase start":
            detail = f" {' '.join(e['units'])}"
        lines.append(f"  {e['t']:6.2f} s  [{e['pid']}] {e['what']}{detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--trees", default=str(ROOT), help="checkouts to alternate, a,b,...")
    parser.add_argument("--timeline", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("train_args", nargs="*")
    args = parser.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",") if t]
    missing = [str(t) for t in trees if not (t / "runtime" / "compile_ahead.py").is_file()]
    if args.repeat < 1 or missing or not trees:
        print(
            f"compile_phase: not a checkout of legion-nn: {', '.join(missing)}"
            if missing
            else "compile_phase: --repeat and --trees need at least one",
            file=sys.stderr,
        )
        return 2
    facts = machine_facts()
    print(describe(facts))
    phases: dict[str, list[float]] = {str(t): [] for t in trees}
    runs: dict[str, list[list[dict]]] = {str(t): [] for t in trees}
    for _ in range(args.repeat):
        for tree in trees:
            try:
                events = run_once(tree, args.train_args)
            except RuntimeError as exc:
                print(f"compile_phase: {exc}", file=sys.stderr)
                return 1
            phases[str(tree)].append(phase_seconds(events))
            runs[str(tree)].append(events)
            if args.timeline:
                print(f"{tree}: compiling {phases[str(tree)][-1]:.2f} s\n{timeline(events)}")
    for tree, seconds in phases.items():
        each = ", ".join(f"{s:.2f}" for s in seconds)
        print(f"{tree}: compiling {statistics.median(seconds):.2f} s, median of ({each})")
    if args.json:
        report = {"machine": facts, "phase_s": phases, "events": runs}
        write_text(args.json, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
