"""Benchmark: training on a directory of .npy files larger than a rank may hold, against the same
kind of data in memory.

    python bench/data_loading.py [--network three-layer-convnet] [--gib 4] [--batch 64]
        [--steps 60] [--ranks 2] [--strategy data] [--dir D] [--json F]

It writes (once; kept in `--dir` for the next run) a training set of `--gib` GiB of float32 samples
of the network's input with seeded random labels, and an `.npz` of its first samples small
enough to hold in memory. Then, side by side, `mpiexec -n R legion-nn train` on each: the median
step time of rank 0 past the first 5 steps (from the `--log-json` records), each rank's peak
resident set, and the ratio of the step times: the median over `--repeat` runs of each, run in
turn, since one run's median moves by ±30% on a shared 2-core machine. Machine facts are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine_facts import describe, machine_facts
from legion_nn.atomic import write_text
from legion_nn.networks import load_network

#: samples written per chunk (a few hundred MB at most in memory while writing)
CHUNK_BYTES = 256 << 20


def make_directory(directory: Path, shape, classes: int, gib: float) -> int:
    """x_train.npy of `gib` GiB and y_train.npy in `directory` (kept if already there)."""
    sample = int(np.prod(shape)) * 4
    count = int(gib * (1 << 30)) // sample
    x_path = directory / "x_train.npy"
    if x_path.exists() and np.load(x_path, mmap_mode="r").shape == (count, *shape):
        return count
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    x = np.lib.format.open_memmap(x_path, mode="w+", dtype=np.float32, shape=(count, *shape))
    step = max(1, CHUNK_BYTES // sample)
    for start in range(0, count, step):
        stop = min(count, start + step)
        x[start:stop] = rng.standard_normal((stop - start, *shape), dtype=np.float32)
    x.flush()
    del x
    np.save(directory / "y_train.npy", rng.integers(0, classes, count))
    return count


def run(args, data: str, log: Path) -> dict:
    command = [
        "mpiexec", "-n", str(args.ranks), sys.executable, "-m", "cli", "train",
        args.network, "--data", data, "--steps", str(args.steps), "--batch", str(args.batch),
        "--strategy", args.strategy, "--no-progress", "--log-json", str(log),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    rank0 = [r["seconds"] for r in steps if r["rank"] == 0][5:]
    last = {r["rank"]: r for r in steps}
    return {
        "step_seconds": statistics.median(rank0),
        "rss_peak_bytes": [last[r]["rss_peak_bytes"] for r in sorted(last)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--network", default="three-layer-convnet")
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategy", default="data")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each, alternated")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "legion-nn-4gib"))
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before the directory's run (root), so its reads come from the disk",
    )
    parser.add_argument("--json", metavar="F")
    args = parser.parse_args()
    network = load_network(args.network)
    directory = Path(args.dir)
    count = make_directory(directory, network.input, network.classes, args.gib)
    small = directory / "in_memory.npz"
    if not small.exists():
        x = np.load(directory / "x_train.npy", mmap_mode="r")
        rows = min(count, 20 * args.batch * args.ranks)
        y = np.load(directory / "y_train.npy")
        np.savez(small, x_train=np.array(x[:rows]), y_train=y[:rows])
    runs: dict[str, list[dict]] = {"directory": [], "in_memory": []}
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.repeat):  # alternated: the machine's drift falls on both alike
            if args.cold:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
            runs["directory"].append(run(args, str(directory), Path(scratch) / "directory.jsonl"))
            runs["in_memory"].append(run(args, str(small), Path(scratch) / "memory.jsonl"))
    on_disk, memory = ({
        "step_seconds": statistics.median(r["step_seconds"] for r in runs[name]),
        "step_seconds_per_run": [r["step_seconds"] for r in runs[name]],
        "rss_peak_bytes": [max(per) for per in zip(*(r["rss_peak_bytes"] for r in runs[name]))],
    } for name in ("directory", "in_memory"))  # fmt: skip
    size = os.path.getsize(directory / "x_train.npy")
    result = {
        "machine": machine_facts(),
        "network": args.network,
        "ranks": args.ranks,
        "strategy": args.strategy,
        "batch": args.batch,
        "x_train_bytes": size,
        "page_cache_dropped": args.cold,
        "directory": on_disk,
        "in_memory": memory,
        "step_ratio": on_disk["step_seconds"] / memory["step_seconds"],
    }
    print(
        f"{args.network}, {args.ranks} ranks ({args.strategy}), batch {args.batch}, "
        f"x_train.npy {size / (1 << 30):.2f} GiB{' from the disk' if args.cold else ''}"
    )
    print(describe(result["machine"]))
    for name in ("directory", "in_memory"):
        r = result[name]
        rss = ", ".join(f"{b / (1 << 20):.0f}" for b in r["rss_peak_bytes"])
        each = " ".join(f"{t * 1e3:.0f}" for t in r["step_seconds_per_run"])
        print(
            f"  {name:9s}: step {r['step_seconds'] * 1e3:7.1f} ms (runs: {each}), "
            f"peak RSS per rank {rss} MiB"
        )
    print(f"  step time directory / in memory: {result['step_ratio']:.3f}")
    if args.json:
        write_text(args.json, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
