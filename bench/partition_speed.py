"""Benchmark: seconds for `legion-nn partition --json` to report a plan, as a user runs it.

    python bench/partition_speed.py [--repeat 3] [--cases resnet18-data,seed-lcn-spatial]

Each case runs the whole command in a child process (imports, the network, the plan, the search
for `auto`, every rank's program, the simulated step and the placed memory): the cost model's
speed goals are stated for it. The cases are the cost model's speed goals: torchvision's
ResNet-18 at 64×64 (`bench/resnet18_onnx.py`, written to a temporary file), batch 64, on 64
ranks with data parallelism (goal 3 s) and with `auto` (goal 6 s); seed-lcn on 1024 ranks with
spatial splits, simulated rather than summed (goal 15 s); vgg19's `auto` on 1024 ranks, whose
planning (the search, the fit and the built-ins compared, as the command prints it) has
a goal of 2 s, its report simulated since every rank's program is built in shares
(`runtime.step.simulated_in_shares`), and in 4 pipeline stages of 8 micro-batches (planning
goal 3 s; its report, whose ranks all differ, simulated in shares too);
and vgg19's data plan on 1024 ranks, simulated since its ranks are built once per class;
and deep-mlp's model plan on 2048 ranks, simulated since its layers' inputs are all-gathered
(`partitioner.gathers`; as copies, 4.2 million messages a layer, it was summed), and vgg19's,
simulated since its classifier's input gradient is one reduce-scatter, not 1,048 reduces, and
vgg19's model plan on 8192 ranks, simulated since the tasks a rank has no part in are told it
at once and the ranks with a part in none are not built (`runtime.step.rank_parts`). Each
figure is the best of `--repeat` runs, wall and CPU (user and system of the child), with the
command's planning and prediction seconds as it prints them; the machine's facts and the same run's SGEMM print
beside them, since the machine is shared and its speed varies from minute to minute. The
children read Python's cached bytecode, as a user's second command does
(`bench.jobs.command_environment`).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.jobs import command_environment
from bench.kernels import sgemm_gflops
from bench.machine_facts import describe, machine_facts

#: name -> (network, extra arguments of `partition`, goal in seconds or None, what the goal is
#: of: the command's wall time, or its planning alone)
CASES = {
    "resnet18-data": (
        "resnet18", ["--batch", "64", "--ranks", "64", "--strategy", "data"], 3.0, "wall"
    ),
    "resnet18-auto": (
        "resnet18", ["--batch", "64", "--ranks", "64", "--strategy", "auto"], 6.0, "wall"
    ),
    "seed-lcn-spatial": ("seed-lcn", ["--ranks", "1024", "--strategy", "spatial"], 15.0, "wall"),
    "vgg19-auto": ("vgg19", ["--ranks", "1024", "--strategy", "auto"], 2.0, "planning"),
    "vgg19-data": ("vgg19", ["--ranks", "1024", "--strategy", "data"], None, "wall"),
    "vgg19-auto-4stages": (
        "vgg19", ["--ranks", "1024", "--stages", "4", "--strategy", "auto"], 3.0, "planning"
    ),
    "deep-mlp-model-2048": (
        "deep-mlp", ["--batch", "128", "--ranks", "2048", "--strategy", "model"], None, "wall"
    ),
    "vgg19-model-2048": ("vgg19", ["--ranks", "2048", "--strategy", "model"], None, "wall"),
    "vgg19-model-8192": ("vgg19", ["--ranks", "8192", "--strategy", "model"], None, "wall"),
}  # fmt: skip


#: the line `partition` ends with: where its time went
TIMED = re.compile(r"planned in ([0-9.]+) s; its step and memory predicted in ([0-9.]+) s")


def run_once(command: list[str]) -> tuple[float, float, dict, tuple[float, float]]:
    """(wall seconds, CPU seconds of the child, its JSON report, its planning and prediction
    seconds as it printed them)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(
            [*command, "--json", str(out)],
            check=True,
            capture_output=True,
            text=True,
            env=command_environment(),
        )
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        timed = TIMED.search(done.stdout)
        return wall, cpu, json.loads(out.read_text()), (float(timed[1]), float(timed[2]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES)
    )
    args = parser.parse_args()
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown or args.repeat < 1:
        print(f"partition_speed: unknown case {unknown[0]!r}" if unknown else
              "partition_speed: --repeat must be at least 1", file=sys.stderr)  # fmt: skip
        return 2
    print(describe(machine_facts()))
    print(f"SGEMM {sgemm_gflops():.0f} GFLOP/s")
    with tempfile.TemporaryDirectory() as tmp:
        resnet = Path(tmp) / "resnet18.onnx"
        if any(CASES[n][0] == "resnet18" for n in names):
            subprocess.run(
                [sys.executable, str(ROOT / "bench" / "resnet18_onnx.py"), str(resnet)],
                check=True,
                capture_output=True,
            )
        print(
            f"{'case':18} {'wall':>8} {'cpu':>8} {'planning':>8} {'predict':>8} {'goal':>13}"
            "  step model"
        )
        for name in names:
            network, extra, goal, goal_of = CASES[name]
            source = str(resnet) if network == "resnet18" else network
            command = [sys.executable, "-m", "cli", "partition", source, *extra]
            runs = [run_once(command) for _ in range(args.repeat)]
            wall = min(r[0] for r in runs)
            cpu = min(r[1] for r in runs)
            planning = min(r[3][0] for r in runs)
            predicting = min(r[3][1] for r in runs)
            report = runs[-1][2]
            goal_text = f"{goal:.0f} s {goal_of}" if goal else "-"
            print(
                f"{name:18} {wall:7.2f}s {cpu:7.2f}s {planning:7.2f}s {predicting:7.2f}s "
                f"{goal_text:>13}  {report['step_model']}"
            )
    print(f"SGEMM after: {sgemm_gflops():.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
