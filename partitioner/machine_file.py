"""The machine file (`--machine F`): a JSON object, read into a `partitioner.machine.Machine`.

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

`"process_baseline_mib"` is what a rank's process holds before its buffers (the interpreter,
NumPy, Numba's compiled kernels, MPI), which the memory prediction adds to the buffers
(`runtime.step.rank_memory`). `bench machine` measures it; the default
(`machine.DEFAULT_BASELINE_MIB`) is what a rank of `train` measured on the development machine.

The default machine is the one above: 100 GFLOP/s per rank, a 100 Gb/s link (12.5 GB/s), 2 µs
latency, 16 GiB per rank, memory traffic not priced and no per-task overhead.

`legion-nn bench machine` measures all of these on the machine it runs on and adds (all
optional; see the README's table of keys):

- `"ranks_per_host"`: ranks sit on hosts in blocks of this many; the link keys are then the
  link between hosts, and `"intra_host": {"latency_us", "gbytes_per_s"}` the one within a host
  (without `ranks_per_host` every rank is its own host: the link is between ranks);
- `"pieces"`: the runtime's kernels timed on the pieces of a network's plans
  (`partitioner.piece_times`), each `{"op", "phase", "attrs", "shape", "requirements":
  [[role, shape]], "seconds", "threads"}`, and `"mode"` where the piece was timed as a step
  runs it writing its gradient or taking its optimizer's step (`runtime.step.piece_modes`);
  `"compute_factor"` (a task's kernels in a running step take this many times their time
  alone) and `"loop_us"` (a step's time outside its tasks);
- `"duplex_gbytes_per_s"`: the rate each way while both directions of a link between hosts carry
  messages at once. Where a host's cores move the bytes (a software link: veth, loopback, TCP
  without offloads) its network stack serves both directions, and each runs slower than alone;
  a link that is full duplex measures the one-way rate, and nothing changes (`stack_beta`);
- `"computing_gbytes_per_s"`: the most a message between hosts moves while the rank it goes to
  runs a kernel. MPI takes a message in over TCP only when its rank calls into MPI, and a rank
  in a kernel leaves that to its progress thread, every 10 ms (`LEGION_NN_PROGRESS_US`): on
  unshaped veths 0.2-0.35 GB/s against 0.4-1.6 GB/s each way while the rank waits (what one
  call takes in, this rate times the interval, crosses at the link's speed). Without it a
  message moves at its link's rate whatever its ranks do;
- `"computing_send_gbytes_per_s"`: the same for a message leaving a rank that runs a kernel
  (with offloads 0.2-0.5 GB/s; without, the stream crossed at the link's rate while the
  kernel waited for the host's core, and the key is left out);
- `"buffer_gbytes_per_s"`: `{"copy", "add", "zero"}`, the GB/s of data the runtime's own
  passes over its buffers move beyond the cache (a message packed or unpacked, a window filled;
  a received or kept partial sum added in; a scratch or a summed rect zeroed), timed as its NumPy
  passes run them (`runtime.step.local_passes`): on a 2-core AMD EPYC VM about 8-16, 11 and
  17 GB/s, where a streaming add's memory traffic (`memory_gbytes_per_s`) had priced a copy at 21
  and an add at 14 GB/s, and the windows, zeroings and kept parts at nothing;
- `"pingpong"`: the raw ping-pong points, `{"pair", "bytes", "seconds"}`, which price each
  message by the measured time of its size (`Machine.link_per_byte`), and the exchanges
  between hosts (`"duplex"`) the stack's time a byte at each size (`Machine.stack_per_byte`);
- what was measured and where, for the record: `"hosts"`, `"rank_cores"`, `"measured_on"`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from legion_nn.errors import LegionNNError
from legion_nn.micro_batches import PLACEMENT_ATTRS
from partitioner.machine import BUFFER_PASSES, DEFAULT_BASELINE_MIB, KEYS, Machine

OPTIONAL_KEYS = (
    "memory_gbytes_per_s",
    "task_overhead_us",
    "process_baseline_mib",
    "message_overhead_us",
    "link_burst_bytes",
    "network_cpu_ns_per_byte",
    "duplex_gbytes_per_s",
    "computing_gbytes_per_s",
    "computing_send_gbytes_per_s",
)
#: measured by `bench machine`, priced by the cost model and the step simulator
MEASURED_KEYS = (
    "buffer_gbytes_per_s",
    "ranks_per_host",
    "intra_host",
    "pieces",
    "compute_factor",
    "loop_us",
    "host_cores",
)
#: measured by `bench machine` and kept for the record (`pingpong` is also priced: `link_curves`)
RECORD_KEYS = ("hosts", "rank_cores", "pingpong", "measured_on")
#: the ping-pongs' pairs of ranks: on two hosts, on one, and on two hosts sending both ways at
#: once (`duplex`: the seconds of an exchange of `bytes` each way)
LINK_PAIRS = ("inter_host", "intra_host", "duplex")
#: the passes `legion-nn bench kernels` measures
PASSES = ("forward", "backward_data", "backward_filter")


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
    known = (*KEYS, *OPTIONAL_KEYS, "op_gflops", *MEASURED_KEYS, *RECORD_KEYS)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise LegionNNError(f"{where}: unknown key {unknown[0]!r}; keys: {', '.join(known)}")
    for key in (
        "task_overhead_us",
        "message_overhead_us",
        "link_burst_bytes",
        "network_cpu_ns_per_byte",
    ):
        value = data.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise LegionNNError(f"{where}: {key} must be a number >= 0, got {value!r}")
    ops = data.get("op_gflops", {})
    if not isinstance(ops, dict):
        raise LegionNNError(f"{where}: op_gflops must map op names to GFLOP/s")
    return Machine(
        *(_positive(data, key, where) for key in KEYS),
        op_gflops={op: _positive(ops, op, f"{where}: op_gflops") for op in ops},
        memory_gbytes_per_s=(
            _positive(data, "memory_gbytes_per_s", where) if "memory_gbytes_per_s" in data else None
        ),
        task_overhead_us=float(data.get("task_overhead_us", 0)),
        message_overhead_us=float(data.get("message_overhead_us", 0)),
        link_burst_bytes=float(data.get("link_burst_bytes", 0)),
        network_cpu_ns_per_byte=float(data.get("network_cpu_ns_per_byte", 0)),
        duplex_gbytes_per_s=(
            _positive(data, "duplex_gbytes_per_s", where) if "duplex_gbytes_per_s" in data else None
        ),
        computing_gbytes_per_s=(
            _positive(data, "computing_gbytes_per_s", where)
            if "computing_gbytes_per_s" in data
            else None
        ),
        computing_send_gbytes_per_s=(
            _positive(data, "computing_send_gbytes_per_s", where)
            if "computing_send_gbytes_per_s" in data
            else None
        ),
        process_baseline_mib=(
            _positive(data, "process_baseline_mib", where)
            if "process_baseline_mib" in data
            else DEFAULT_BASELINE_MIB
        ),
        **_measured(data, where),
        record={key: data[key] for key in RECORD_KEYS if key in data},
    )


def piece_key_of(
    op: str, phase: str, attrs: dict, shape, requirements, mode: str | None = None
) -> str:
    """The key of a piece in a machine's table: what decides its kernel's work, as canonical
    JSON (not where a micro-batch's task sits, `PLACEMENT_ATTRS`). `requirements` are (role,
    rect shape or None) pairs; `mode`, how a step runs the piece where that is not adding its
    results to what its reductions hold (`runtime.step.piece_modes`), or None where it is."""
    work = {k: v for k, v in attrs.items() if k not in PLACEMENT_ATTRS}
    key = [op, phase, work, list(shape),
           [[role, None if s is None else list(s)] for role, s in requirements]]  # fmt: skip
    if mode is not None:
        key.append(mode)
    return json.dumps(key, sort_keys=True, default=str, separators=(",", ":"))


def _measured(data: dict, where: str) -> dict:
    out: dict = {}
    if "buffer_gbytes_per_s" in data:
        rates = data["buffer_gbytes_per_s"]
        kinds = ", ".join(BUFFER_PASSES)
        if not isinstance(rates, dict) or not set(rates) <= set(BUFFER_PASSES):
            raise LegionNNError(f"{where}: buffer_gbytes_per_s must map some of {kinds} to GB/s")
        out["buffer_gbytes_per_s"] = {
            kind: _positive(rates, kind, f"{where}: buffer_gbytes_per_s") for kind in rates
        }
    for key in ("ranks_per_host", "host_cores"):
        if key in data:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LegionNNError(f"{where}: {key} must be a positive integer, got {value!r}")
            out[key] = value
    if "intra_host" in data:
        intra = data["intra_host"]
        if not isinstance(intra, dict) or set(intra) != {"latency_us", "gbytes_per_s"}:
            raise LegionNNError(f'{where}: intra_host must be {{"latency_us", "gbytes_per_s"}}')
        out["intra_host"] = (
            _positive(intra, "latency_us", f"{where}: intra_host"),
            _positive(intra, "gbytes_per_s", f"{where}: intra_host"),
        )
    if "pingpong" in data:
        out["link_curves"] = _link_curves(data["pingpong"], where)
    for key in ("compute_factor", "loop_us"):
        if key in data:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise LegionNNError(f"{where}: {key} must be a number >= 0, got {value!r}")
            out[key] = float(value)
    rows = data.get("pieces", [])
    if not isinstance(rows, list):
        raise LegionNNError(f"{where}: pieces must be a list of measured pieces")
    pieces = {}
    for index, row in enumerate(rows):
        fields = ("op", "phase", "attrs", "shape", "requirements", "seconds")
        if not isinstance(row, dict) or any(f not in row for f in fields):
            raise LegionNNError(f"{where}: pieces[{index}] needs {', '.join(fields)}")
        mode = row.get("mode")
        if mode is not None and not isinstance(mode, str):
            raise LegionNNError(f"{where}: pieces[{index}].mode must be a string, got {mode!r}")
        try:
            key = piece_key_of(row["op"], row["phase"], row["attrs"], row["shape"],
                               [(role, shape) for role, shape in row["requirements"]],
                               mode)  # fmt: skip
        except (TypeError, ValueError):
            raise LegionNNError(f"{where}: pieces[{index}] is malformed") from None
        value = row["seconds"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise LegionNNError(f"{where}: pieces[{index}].seconds must be >= 0, got {value!r}")
        pieces[key] = float(value)
    if pieces:
        out["pieces"] = pieces
        out["piece_rows"] = tuple(rows)
    return out


def _link_curves(rows: object, where: str) -> dict[str, tuple[tuple[int, float], ...]]:
    """`pingpong`'s points per pair, ascending in bytes, one time per size (the least)."""
    if not isinstance(rows, list):
        raise LegionNNError(f"{where}: pingpong must be a list of measured ping-pongs")
    found: dict[str, dict[int, float]] = {}
    for index, row in enumerate(rows):
        if not isinstance(row, dict) or set(row) != {"pair", "bytes", "seconds"}:
            raise LegionNNError(
                f'{where}: pingpong[{index}] must be {{"pair", "bytes", "seconds"}}'
            )
        pair, size, seconds = row["pair"], row["bytes"], row["seconds"]
        if pair not in LINK_PAIRS:
            raise LegionNNError(
                f"{where}: pingpong[{index}].pair must be one of {', '.join(LINK_PAIRS)}, "
                f"got {pair!r}"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise LegionNNError(f"{where}: pingpong[{index}].bytes must be a positive integer")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise LegionNNError(f"{where}: pingpong[{index}].seconds must be a positive number")
        times = found.setdefault(pair, {})
        times[size] = min(float(seconds), times.get(size, float("inf")))
    return {pair: tuple(sorted(times.items())) for pair, times in found.items()}


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
