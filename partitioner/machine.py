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

`"process_baseline_mib"` is what a rank's process holds before its buffers (the interpreter,
NumPy, Numba's compiled kernels, MPI), which the memory prediction adds to the buffers
(`runtime.step.rank_memory`). `bench machine` measures it; the default, `DEFAULT_BASELINE_MIB`, is what
a rank of `train` measured on the development machine.

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
- `"pingpong"`: the raw ping-pong points, `{"pair", "bytes", "seconds"}`, which price each
  message by the measured time of its size (`Machine.link_per_byte`), and the exchanges
  between hosts (`"duplex"`) the stack's time a byte at each size (`Machine.stack_per_byte`);
- what was measured and where, for the record: `"hosts"`, `"rank_cores"`, `"measured_on"`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from legion_nn.errors import LegionNNError
from legion_nn.micro_batches import PLACEMENT_ATTRS

KEYS = ("rank_gflops", "link_gbytes_per_s", "latency_us", "rank_memory_gib")
OPTIONAL_KEYS = (
    "memory_gbytes_per_s",
    "task_overhead_us",
    "process_baseline_mib",
    "message_overhead_us",
    "link_burst_bytes",
    "network_cpu_ns_per_byte",
    "duplex_gbytes_per_s",
)
#: a rank's resident set before its buffers, measured under `mpiexec -n 2 legion-nn train`
DEFAULT_BASELINE_MIB = 200.0
#: measured by `bench machine`, priced by the cost model and the step simulator
MEASURED_KEYS = (
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
#: how far below the one-way rate a link's measured duplex rate may be and the link still be
#: full duplex: the two are fitted from separate ping-pongs, and on tbf-shaped links (full
#: duplex by construction) they differ by up to 1% (1 Gbit/s: 0.1195 and 0.1191 GB/s on an AMD
#: EPYC VM, 0.118-0.119 and 0.119 on an Intel Xeon one); a software link whose hosts' cores
#: move both directions measures 15-25% below (veth: 0.55 against 0.65 GB/s; with offloads 1.2
#: against 1.5). Taken as half duplex, a link 0.4% below made every exchange round between
#: two hosts take half as long again (`runtime.step.simulator`'s stack)
FULL_DUPLEX_WITHIN = 0.05
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
    process_baseline_mib: float = DEFAULT_BASELINE_MIB
    #: a rank's time to post its end of a message (the runtime's bookkeeping and MPI calls)
    message_overhead_us: float = 0.0
    #: bytes a link between hosts lets through at once after it has been idle (a token bucket's
    #: burst, a NIC's or a switch's buffer), refilled at the link's rate
    link_burst_bytes: float = 0.0
    #: CPU the network stack takes from a rank's kernels per byte it sends or receives between
    #: hosts (a host's cores move the bytes: copies, checksums, interrupts), in ns: a kernel
    #: shares its core with the bytes on the wire while it runs (`rank_cpu.sharing_core`)
    network_cpu_ns_per_byte: float = 0.0
    #: GB/s each way while both directions of a link between hosts are busy (None: as alone)
    duplex_gbytes_per_s: float | None = None
    #: None: one rank per host
    ranks_per_host: int | None = None
    #: (latency us, GB/s) within a host; None: the link's
    intra_host: tuple[float, float] | None = None
    #: seconds of a piece by `piece_key`
    pieces: dict[str, float] = field(default_factory=dict)
    compute_factor: float = 1.0
    loop_us: float = 0.0
    #: the cores of a host, which its ranks share (None: each rank has its cores to itself)
    host_cores: int | None = None
    #: per pair of `LINK_PAIRS` measured, the one-way seconds of messages by their bytes, in
    #: ascending bytes (`pingpong`): what a message of each size takes (`link_per_byte`,
    #: `stack_per_byte`)
    link_curves: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    #: the measured file's other keys, written back as they were read
    record: dict = field(default_factory=dict)
    #: the pieces as the file gave them, written back as they were read
    piece_rows: tuple = ()

    @property
    def alpha(self) -> float:
        """Seconds per message."""
        return self.latency_us * 1e-6

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / (self.link_gbytes_per_s * 1e9)

    @property
    def stack_beta(self) -> float:
        """Seconds per byte of a host's network stack, which every byte the host sends or
        receives between hosts passes through: 0 where the link is full duplex (both ways at
        once as fast as one alone). Where both directions at once run at d each way, below
        the one-way rate, the stack serves 2d bytes a second in all; it is never slower than
        the link alone (a one-way stream runs at the link's rate, as measured). A duplex rate
        within `FULL_DUPLEX_WITHIN` of the one-way rate is full duplex: the two fits differ
        by that much on a link that is."""
        duplex = self.duplex_gbytes_per_s
        if duplex is None or duplex >= self.link_gbytes_per_s * (1.0 - FULL_DUPLEX_WITHIN):
            return 0.0
        return min(1.0 / (2 * duplex * 1e9), self.beta)

    @property
    def ring_beta(self) -> float:
        """Seconds per byte of a collective's ring step, in which every rank sends and receives
        as many bytes at once: the link's, or the stack's for both ways where it is slower."""
        return max(self.beta, 2 * self.stack_beta)

    @property
    def seconds_per_memory_byte(self) -> float:
        """Seconds per byte of memory traffic; 0 where the machine does not price it."""
        if self.memory_gbytes_per_s is None:
            return 0.0
        return 1.0 / (self.memory_gbytes_per_s * 1e9)

    @property
    def task_overhead(self) -> float:
        return self.task_overhead_us * 1e-6

    def core_share(self, nranks: int) -> np.ndarray:
        """Per rank of a plan on `nranks` ranks, the part of its cores its CPU work gets while
        its host's ranks all work: less than 1 where a host has more of the plan's ranks than
        cores, which then time-share them. Every CPU cost of the model was measured with the
        rank alone on its cores (the pieces, the per-task and per-message overheads, the
        network stack's CPU, the loop), so each takes 1/share as long. Ranks that take turns
        get more: an upper bound on the time."""
        if self.host_cores is None or not nranks:
            return np.ones(nranks)
        hosts = np.array([self.host(rank) for rank in range(nranks)], np.int64)
        sharing = np.bincount(hosts)[hosts]
        return np.minimum(1.0, self.host_cores / sharing)

    @property
    def message_overhead(self) -> float:
        return self.message_overhead_us * 1e-6

    @property
    def network_cpu_seconds_per_byte(self) -> float:
        """The CPU the network stack takes from a kernel per byte its rank sends or receives
        between hosts: `network_cpu_ns_per_byte`, measured beside a one-way stream, but never
        more than the stack's own time per byte where it serves both directions at once
        (`stack_beta`). A stack that takes the whole core (an unshaped veth) moves both ways at
        the duplex rate d, so a byte of an exchange costs the core 1 / 2d, less than the
        one-way stream's: seed-lcn's data plan at batch 16 there, whose all-reduce runs both
        ways beside the backward pass, was priced 1.88 ns a byte each way and predicted 30%
        long (1.43 ns: 7.9%)."""
        measured = self.network_cpu_ns_per_byte * 1e-9
        return min(measured, self.stack_beta) if self.stack_beta else measured

    @property
    def process_baseline_bytes(self) -> int:
        return int(self.process_baseline_mib * 2**20)

    @property
    def memory_bytes(self) -> float:
        return self.rank_memory_gib * 2**30

    @property
    def loop_seconds(self) -> float:
        """A step's time outside its tasks (the training loop), a rank alone on its cores."""
        return self.loop_us * 1e-6

    def step_loop_seconds(self, nranks: int) -> float:
        """`loop_seconds` on `nranks` ranks: the slowest rank's, over its share of the cores
        (`core_share`)."""
        return self.loop_seconds / float(self.core_share(nranks).min(initial=1.0))

    def host(self, rank: int) -> int:
        return rank // self.ranks_per_host if self.ranks_per_host else rank

    def link(self, src: int, dst: int) -> tuple[float, float]:
        """(seconds per message, seconds per byte) from rank `src` to rank `dst`."""
        if self.intra_host is not None and self.host(src) == self.host(dst):
            latency_us, gbytes = self.intra_host
            return latency_us * 1e-6, 1.0 / (gbytes * 1e9)
        return self.alpha, self.beta

    def link_per_byte(self, nbytes: np.ndarray, within_host: bool) -> np.ndarray:
        """Seconds per byte of messages of `nbytes` on the link between hosts or within one:
        a message takes the link's latency plus its bytes at this rate. Where `bench machine`
        measured the link (`link_curves`), the rate that gives each message the one-way time of
        a measured one of its size: the points joined by straight lines, and beyond the largest
        the fitted rate (`beta`). A link whose hosts' cores move the bytes can run messages that
        stay in their caches faster than large ones (an unshaped veth's medians: 64 KiB at 1.1
        GB/s, 1 MiB at 0.56, 64 MiB at 0.45), and a rate fitted to the large ones prices a
        parameter's shards and a spatial step's halos at the wrong one (deep-mlp's sharded plan
        there: +27.1% at the fitted rate, +8.9% at the measured times). A link between hosts
        that lets a burst through (`link_burst_bytes`) is priced by its token bucket and rate
        instead: its small messages cross fast only while the bucket is full. Without points,
        the fitted rate throughout."""
        latency, per_byte = self.link(0, 0) if within_host else (self.alpha, self.beta)
        points = self.link_curves.get("intra_host" if within_host else "inter_host")
        nbytes = np.asarray(nbytes, np.float64)
        if not points or (self.link_burst_bytes and not within_host):
            return np.full(nbytes.shape, per_byte)
        sizes, seconds = np.array(points, np.float64).T
        one_way = np.interp(nbytes, sizes, seconds) + np.maximum(nbytes - sizes[-1], 0.0) * per_byte
        return np.maximum(one_way - latency, 0.0) / np.maximum(nbytes, 1.0)

    def stack_per_byte(self, nbytes: np.ndarray) -> np.ndarray:
        """Seconds per byte a host's network stack takes for messages of `nbytes` between
        hosts, where it serves both directions (`stack_beta`; else 0): half an exchange's
        seconds per byte each way at that size, where `bench machine` timed exchanges
        (`link_curves["duplex"]`, joined by straight lines, beyond the largest the fitted duplex
        rate), so that an exchange of any measured size takes its measured time; never more than
        the link's own (`link_per_byte`: one way runs at the link's rate). Without those points
        `stack_beta` at the link's rate for the size, as for the large messages: on an unshaped
        veth whose exchanges ran at 0.41-0.43 GB/s each way from 1 to 256 MiB, that priced
        deep-mlp's 8 MiB gathers at 0.54, the one-way curve being faster there."""
        nbytes = np.asarray(nbytes, np.float64)
        if not self.stack_beta:
            return np.zeros(nbytes.shape)
        link = self.link_per_byte(nbytes, False)
        points = self.link_curves.get("duplex")
        if not points:
            return self.stack_beta * (link / self.beta)
        sizes, seconds = np.array(points, np.float64).T
        beyond = np.maximum(nbytes - sizes[-1], 0.0) / (self.duplex_gbytes_per_s * 1e9)
        exchange = np.interp(nbytes, sizes, seconds) + beyond
        per_byte = np.maximum(exchange - self.alpha, 0.0) / np.maximum(nbytes, 1.0)
        return np.minimum(per_byte / 2, link)

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
        if self.message_overhead_us:
            out["message_overhead_us"] = self.message_overhead_us
        if self.link_burst_bytes:
            out["link_burst_bytes"] = self.link_burst_bytes
        if self.network_cpu_ns_per_byte:
            out["network_cpu_ns_per_byte"] = self.network_cpu_ns_per_byte
        if self.duplex_gbytes_per_s is not None:
            out["duplex_gbytes_per_s"] = self.duplex_gbytes_per_s
        if self.process_baseline_mib != DEFAULT_BASELINE_MIB:
            out["process_baseline_mib"] = self.process_baseline_mib
        if self.op_gflops:
            out["op_gflops"] = dict(self.op_gflops)
        if self.ranks_per_host is not None:
            out["ranks_per_host"] = self.ranks_per_host
        if self.intra_host is not None:
            out["intra_host"] = {
                "latency_us": self.intra_host[0],
                "gbytes_per_s": self.intra_host[1],
            }
        if self.piece_rows:
            out["pieces"] = list(self.piece_rows)
            out["compute_factor"] = self.compute_factor
        if self.loop_us:
            out["loop_us"] = self.loop_us
        if self.host_cores is not None:
            out["host_cores"] = self.host_cores
        return out | self.record


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
