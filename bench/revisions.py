"""Benchmark: the same measurements on two revisions of the project, alternated in one run.

    python bench/revisions.py BEFORE [--after REV] [--rounds 3] [--kernels] [--json F]

A change that should leave performance alone (a refactor of the runtime) is checked by measuring
both sides in one run: BEFORE, and AFTER (default: this working tree), each in a git worktree of
its own in a temporary directory, removed on every exit path. The measurements go round-robin
over the two trees, round after round, so that neither side alone lands in one of this shared
machine's slow stretches, and each figure is the best of its rounds:

- the main job, `mpiexec -n 2 legion-nn train` on its defaults: the training loop's seconds
  (its `--log-json` "done" record: steps, evaluations and checkpoints, no start-up);
- one training step of seed-lcn at batch 64 in one process (no launcher): the median step after
  the first two;
- the 1-rank rows of `bench scaling`, the same jobs it times: seed-lcn-small at batch 64 and
  seed-lcn at batch 4, data-parallel, SGD, under `mpiexec -n 1`, the median step after the
  first two;
- with `--kernels`, `legion-nn bench kernels` (every pass, untied and tied, at batches 64 and 256)
  in each tree, with the machine's SGEMM beside it as the ceiling.

Only the command line is used, so any revision with `legion-nn train` can be measured. Each
tree first runs a short job that compiles its kernels (Numba caches them beside the sources),
so no figure includes compilation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.jobs import failure_line

#: steps a job's step time skips: compilation and first touch
WARMUP = 2

#: (label, network, batch, ranks (None: one process, no launcher), steps, extra train arguments)
STEP_JOBS = (
    ("seed-lcn step, batch 64, 1 process", "seed-lcn", 64, None, 5, ()),
    ("scaling 1-rank: seed-lcn-small b64", "seed-lcn-small", 64, 1, 60, ("--optimizer", "sgd")),
    ("scaling 1-rank: seed-lcn b4", "seed-lcn", 4, 1, 8, ("--optimizer", "sgd")),
)


def _run(tree: Path, command: Sequence[str], timeout: float = 1800) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    result = subprocess.run(
        command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        sys.exit(
            f"bench revisions: {' '.join(command[:6])} ... in {tree} failed: "
            f"{failure_line(result.stderr)}"
        )


def command_line(tree: Path) -> list[str]:
    """`legion-nn` as the tree's own module runs it: `cli` since the command line became its own
    package, `legion_nn.cli` before."""
    module = "cli" if (tree / "cli" / "main.py").exists() else "legion_nn.cli"
    return [sys.executable, "-m", module]


def _train(tree: Path, ranks: int | None, arguments: Sequence[str], log: Path) -> list[dict]:
    launcher = ["mpiexec", "-n", str(ranks)] if ranks is not None else []
    command = [
        *launcher, *command_line(tree), "train",
        *arguments, "--no-progress", "--log-json", str(log),
    ]  # fmt: skip
    _run(tree, command)
    return [json.loads(line) for line in log.read_text().splitlines()]


def main_job_seconds(tree: Path, work: Path) -> float:
    records = _train(tree, 2, [], work / "main.jsonl")
    return next(r["seconds"] for r in records if r.get("event") == "done")


def step_seconds(tree: Path, work: Path, job: tuple) -> float:
    _, network, batch, ranks, steps, extra = job
    arguments = [network, "--data", "synthetic", "--batch", str(batch), "--steps", str(steps)]
    records = _train(tree, ranks, [*arguments, "--strategy", "data", *extra], work / "step.jsonl")
    slowest: dict[int, float] = {}
    for r in records:
        if "step" in r and "event" not in r and r["step"] >= WARMUP:
            slowest[r["step"]] = max(slowest.get(r["step"], 0.0), r["seconds"])
    return statistics.median(slowest.values())


def kernel_rates(tree: Path, work: Path) -> dict:
    out = work / "kernels.json"
    command = [*command_line(tree), "bench", "kernels", "--quiet"]
    _run(tree, [*command, "--impl", "legion-nn", "--json", str(out)], timeout=3600)
    report = json.loads(out.read_text())
    rates = {"sgemm": report["sgemm_gflops"]}
    for r in report["results"]:
        shape = r["shape"]
        kind = "untied" if r["untied"] else "tied"
        rates[f"{r['pass']} {kind} N={shape['N']}"] = r["gflops"]
    return rates


def warm_up(tree: Path, work: Path) -> None:
    """Compile the tree's kernels once, outside every measurement."""
    _train(tree, None, ["--data", "synthetic", "--steps", "3", "--batch", "8"], work / "w.jsonl")
    _train(tree, None, ["seed-lcn", "--data", "synthetic", "--steps", "1", "--batch", "2"],
           work / "w.jsonl")  # fmt: skip


def worktree(stack: ExitStack, revision: str, where: Path) -> Path:
    """`revision` checked out at `where`, removed when `stack` closes."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), revision],
        check=True,
        capture_output=True,
    )
    stack.callback(
        subprocess.run,
        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
        check=False,
        capture_output=True,
    )
    return where


def measure(trees: dict[str, Path], rounds: int, kernels: bool, work: Path) -> dict:
    figures: dict[str, dict[str, float]] = {side: {} for side in trees}

    def keep_best(side: str, label: str, value: float) -> None:
        figures[side][label] = min(value, figures[side].get(label, float("inf")))

    for side, tree in trees.items():
        print(f"warming up {side}", file=sys.stderr)
        warm_up(tree, work)
    for round_ in range(rounds):
        for side, tree in trees.items():
            print(f"round {round_ + 1}/{rounds}: {side}", file=sys.stderr)
            keep_best(side, "main job (mpiexec -n 2), s", main_job_seconds(tree, work))
            for job in STEP_JOBS:
                keep_best(side, f"{job[0]}, s", step_seconds(tree, work, job))
    if kernels:
        for side, tree in trees.items():
            print(f"bench kernels: {side}", file=sys.stderr)
            for label, rate in kernel_rates(tree, work).items():
                figures[side][f"{label}, GFLOP/s"] = rate
    return figures


def format_table(figures: dict[str, dict[str, float]], names: dict[str, str]) -> str:
    before, after = figures["before"], figures["after"]
    width = max(len(label) for label in before)
    lines = [f"{'':{width}}  {names['before']:>12}  {names['after']:>12}  after/before"]
    for label, value in before.items():
        other = after.get(label, float("nan"))
        lines.append(f"{label:{width}}  {value:12.4f}  {other:12.4f}  {other / value:11.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the revision measured as before (e.g. a commit or tag)")
    parser.add_argument("--after", help="the revision measured as after (default: this tree)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over both trees (best kept)")
    parser.add_argument("--kernels", action="store_true", help="also run bench kernels in each")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    if shutil.which("mpiexec") is None:
        sys.exit("bench revisions: mpiexec not found (pip install mpich)")
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lnn-revs-")))
        trees = {"before": worktree(stack, args.before, scratch / "before")}
        trees["after"] = worktree(stack, args.after, scratch / "after") if args.after else ROOT
        work = scratch / "work"
        work.mkdir()
        figures = measure(trees, args.rounds, args.kernels, work)
    names = {"before": args.before[:12], "after": (args.after or "this tree")[:12]}
    print(format_table(figures, names))
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps({"revisions": names, "figures": figures}, indent=1))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
