"""The machine a plan is costed on: `--machine F`, a JSON object.

    {"rank_gflops": 100, "link_gbytes_per_s": 12.5, "latency_us": 2, "rank_memory_gib": 16}

Optional `"op_gflops"` overrides the throughput of single ops. A key names an op (`"filter"`),
an op and one of the passes the kernels run (`"filter.forward"`, `"filter.backward_data"`,
`"filter.backward_filter"`), optionally with `.untied` or `.tied`; the most specific key present
wins, then `rank_gflops`. A filter or conv backward task runs two passes (input and weight
gradients, half its FLOPs each; only the second when its input needs no gradient); every other
task runs one pass, named after its phase (`"linear.forward"`, `"linear.backward"`).

`calibrate` fills `op_gflops` from a `legion-nn bench kernels --json` report (`partition
--calibrate BENCH.json`): each (pass, untied/tied) of the filter at the mean GFLOP/s of the
`legion-nn` rows over the measured batch sizes, the same tied rates for `conv` (a tied filter plus
a bias), and `linear` (GEMMs through BLAS) at the report's SGEMM rate. Other ops (elementwise,
pooling, softmax: memory-bound, and nearly free in this model) keep `rank_gflops`.

Two optional keys price what FLOPs do not (`legion-nn bench scaling` measures both):

- `"memory_gbytes_per_s"`: a rank's streaming memory bandwidth. With it a task takes the longer of
  its FLOPs over the op's throughput and its memory traffic (`accounting.bytes_per_rank`) over
  this bandwidth (a roofline), so zeroing, loading and the elementwise ops cost their bytes, a
  `linear` at a small batch pays for reading its weights, and a message or collective adds the
  runtime's local passes over memory (`cost.py`). Without it memory traffic is free.
- `"task_overhead_us"`: a runtime's fixed cost per task and rank (dispatch, views, bookkeeping),
  added to every task. Default 0.

The default machine is the one above: 100 GFLOP/s per rank, a 100 Gb/s link (12.5 GB/s), 2 µs
latency, 16 GiB per rank, memory traffic not priced and no per-task overhead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from legion_nn.errors import LegionNNError

KEYS = ("rank_gflops", "link_gbytes_per_s", "latency_us", "rank_memory_gib")
OPTIONAL_KEYS = ("memory_gbytes_per_s", "task_overhead_us")
#: the passes `legion-nn bench kernels` measures
PASSES = ("forward", "backward_data", "backward_filter")


@dataclass(frozen=True)
class Machine:
    rank_gflops: float = 100.0
    link_gbytes_per_s: float = 12.5
    latency_us: float = 2.0
    rank_memory_gib: float = 16.0
    op_gflops: dict[str, float] = field(default_factory=dict)
    #: None: memory traffic is not priced
    memory_gbytes_per_s: float | None = None
    task_overhead_us: float = 0.0

    @property
    def alpha(self) -> float:
        """Seconds per message."""
        return self.latency_us * 1e-6

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / (self.link_gbytes_per_s * 1e9)

    @property
    def seconds_per_memory_byte(self) -> float:
        """Seconds per byte of memory traffic; 0 where the machine does not price it."""
        if self.memory_gbytes_per_s is None:
            return 0.0
        return 1.0 / (self.memory_gbytes_per_s * 1e9)

    @property
    def task_overhead(self) -> float:
        return self.task_overhead_us * 1e-6

    @property
    def memory_bytes(self) -> float:
        return self.rank_memory_gib * 2**30

    def flops_per_second(self, op: str, pass_: str = "", variant: str = "") -> float:
        """FLOP/s of `pass_` of `op` (`variant`: "untied" or "tied"), by the most specific key."""
        for key in (f"{op}.{pass_}.{variant}", f"{op}.{pass_}", op):
            if key in self.op_gflops:
                return self.op_gflops[key] * 1e9
        return self.rank_gflops * 1e9

    def to_json(self) -> dict:
        out = {key: getattr(self, key) for key in KEYS}
        if self.memory_gbytes_per_s is not None:
            out["memory_gbytes_per_s"] = self.memory_gbytes_per_s
        if self.task_overhead_us:
            out["task_overhead_us"] = self.task_overhead_us
        if self.op_gflops:
            out["op_gflops"] = dict(self.op_gflops)
        return out


def _positive(data: dict, key: str, where: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise LegionNNError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def machine_from_json(data: object, where: str = "machine") -> Machine:
    if not isinstance(data, dict):
        raise LegionNNError(f"{where}: a machine must be a JSON object with keys {', '.join(KEYS)}")
    missing = [key for key in KEYS if key not in data]
    if missing:
        raise LegionNNError(f"{where}: missing {', '.join(missing)}")
    unknown = sorted(set(data) - set(KEYS) - set(OPTIONAL_KEYS) - {"op_gflops"})
    if unknown:
        raise LegionNNError(
            f"{where}: unknown key {unknown[0]!r}; keys: {', '.join(KEYS + OPTIONAL_KEYS)}, "
            "op_gflops"
        )
    overhead = data.get("task_overhead_us", 0)
    if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or overhead < 0:
        raise LegionNNError(f"{where}: task_overhead_us must be a number >= 0, got {overhead!r}")
    ops = data.get("op_gflops", {})
    if not isinstance(ops, dict):
        raise LegionNNError(f"{where}: op_gflops must map op names to GFLOP/s")
    return Machine(
        *(_positive(data, key, where) for key in KEYS),
        op_gflops={op: _positive(ops, op, f"{where}: op_gflops") for op in ops},
        memory_gbytes_per_s=(
            _positive(data, "memory_gbytes_per_s", where) if "memory_gbytes_per_s" in data else None
        ),
        task_overhead_us=float(overhead),
    )


def load_machine(path: str | None) -> Machine:
    """The machine in file `path`, or the default."""
    if path is None:
        return Machine()
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise LegionNNError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    return machine_from_json(data, str(path))


def calibrate(machine: Machine, bench: object, where: str = "--calibrate") -> Machine:
    """`machine` with per-pass throughput from a `legion-nn bench kernels --json` report."""
    if not isinstance(bench, dict) or not isinstance(bench.get("results"), list):
        raise LegionNNError(f"{where}: not a `legion-nn bench kernels --json` report (no results)")
    rates: dict[str, list[float]] = {}
    for row in bench["results"]:
        if not isinstance(row, dict) or row.get("impl") != "legion-nn" or row.get("op") != "filter":
            continue
        if row.get("pass") not in PASSES:
            raise LegionNNError(f"{where}: unknown pass {row.get('pass')!r}")
        variant = "untied" if row.get("untied") else "tied"
        rate = _positive(row, "gflops", where)
        rates.setdefault(f"filter.{row['pass']}.{variant}", []).append(rate)
        if variant == "tied":
            rates.setdefault(f"conv.{row['pass']}", []).append(rate)
    if not rates:
        raise LegionNNError(f"{where}: no legion-nn filter measurements to calibrate from")
    ops = {key: sum(found) / len(found) for key, found in rates.items()}
    if "sgemm_gflops" in bench:
        ops["linear"] = _positive(bench, "sgemm_gflops", where)
    return replace(machine, op_gflops={**machine.op_gflops, **ops})


def load_calibrated(machine: Machine, path: str) -> Machine:
    """`calibrate` from the report in file `path`."""
    try:
        bench = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise LegionNNError(
            f"--calibrate {path}: not JSON ({exc.msg} at line {exc.lineno})"
        ) from None
    return calibrate(machine, bench, f"--calibrate {path}")
