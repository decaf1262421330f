"""The machine a plan is costed on (`Machine`): its ranks' throughput, links, memory and cores,
and how the cost model and the step simulator read them (a message's time by its size, the stack
a host's cores drive, ranks sharing a host's cores).

Its file (`--machine F`, what `legion-nn bench machine` writes) is read and validated by
`partitioner.machine_file`, which documents its keys. The default machine: 100 GFLOP/s per rank,
a 100 Gb/s link (12.5 GB/s), 2 µs latency, 16 GiB per rank, memory traffic not priced and no
per-task overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: the keys every machine file gives
KEYS = ("rank_gflops", "link_gbytes_per_s", "latency_us", "rank_memory_gib")
#: the runtime's passes over its buffers (`Machine.buffer_seconds_per_byte`), each with the bytes
#: of memory traffic it makes per byte of data: a copy, an add into another buffer, a zeroing
BUFFER_PASSES = {"copy": 2, "add": 3, "zero": 1}
#: a rank's resident set before its buffers, measured under `mpiexec -n 2 legion-nn train`
DEFAULT_BASELINE_MIB = 200.0
#: how far below the one-way rate a link's measured duplex rate may be and the link still be
#: full duplex: the two are fitted from separate ping-pongs, and on tbf-shaped links (full
#: duplex by construction) they differ by up to 1% (1 Gbit/s: 0.1195 and 0.1191 GB/s on an AMD
#: EPYC VM, 0.118-0.119 and 0.119 on an Intel Xeon one); a software link whose hosts' cores
#: move both directions measures 15-25% below (veth: 0.55 against 0.65 GB/s; with offloads 1.2
#: against 1.5). Taken as half duplex, a link 0.4% below made every exchange round between
#: two hosts take half as long again (`runtime.step.simulator`'s stack)
FULL_DUPLEX_WITHIN = 0.05


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
    #: GB/s at most a message between hosts moves while the rank it goes to runs a kernel
    #: (None: as fast as its link): MPI takes a message in over TCP only when its rank calls
    #: into MPI, and while a rank computes only its progress thread does, every
    #: `mpi_transport.PROGRESS_INTERVAL_US`, each call reading what the socket's buffer holds
    computing_gbytes_per_s: float | None = None
    #: GB/s at most a message between hosts moves while the rank it leaves runs a kernel (None:
    #: as fast as its link; where the host's core moves the bytes, the kernel waits instead)
    computing_send_gbytes_per_s: float | None = None
    #: GB/s of data the runtime's own passes over buffers beyond the cache move, by kind
    #: (`BUFFER_PASSES`: a copy, an add into another buffer, a zeroing), as `bench machine` timed its
    #: NumPy passes; a kind not given is priced as memory traffic (`buffer_seconds_per_byte`)
    buffer_gbytes_per_s: dict[str, float] = field(default_factory=dict)
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
    #: per pair of `machine_file.LINK_PAIRS` measured, the one-way seconds of messages by
    #: their bytes, in ascending bytes (`pingpong`): what a message of each size takes
    #: (`link_per_byte`, `stack_per_byte`)
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
    def computing_bytes_per_s(self) -> float:
        """`computing_gbytes_per_s` in bytes a second; 0 where a message is not held back."""
        rate = self.computing_gbytes_per_s
        return rate * 1e9 if rate is not None else 0.0

    @property
    def computing_send_bytes_per_s(self) -> float:
        """`computing_send_gbytes_per_s` in bytes a second; 0 where not held back."""
        rate = self.computing_send_gbytes_per_s
        return rate * 1e9 if rate is not None else 0.0

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

    def buffer_seconds_per_byte(self, kind: str) -> float:
        """Seconds per byte of data of the runtime's pass `kind` (one of `BUFFER_PASSES`): as
        measured, else the memory traffic it makes (a copy reads and writes each byte, an add
        reads two and writes one, a zeroing writes one; 0 where memory is not priced)."""
        if kind in self.buffer_gbytes_per_s:
            return 1.0 / (self.buffer_gbytes_per_s[kind] * 1e9)
        return BUFFER_PASSES[kind] * self.seconds_per_memory_byte

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
        between hosts: `network_cpu_ns_per_byte`, measured beside a one-way stream (per byte
        crossing while the kernel ran), but never
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
    def buffer_capacity(self) -> float:
        """What a rank's buffers may take: its memory less the process's own
        (`process_baseline_bytes`), which the runtime's peak adds to them."""
        return self.memory_bytes - self.process_baseline_bytes

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
        if self.computing_gbytes_per_s is not None:
            out["computing_gbytes_per_s"] = self.computing_gbytes_per_s
        if self.computing_send_gbytes_per_s is not None:
            out["computing_send_gbytes_per_s"] = self.computing_send_gbytes_per_s
        if self.buffer_gbytes_per_s:
            out["buffer_gbytes_per_s"] = dict(self.buffer_gbytes_per_s)
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
