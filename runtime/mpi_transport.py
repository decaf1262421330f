"""The MPI transport: the rank executor's transport over mpi4py, and the job-wide abort.

This is the only module of legion-nn that imports mpi4py (a test keeps it so). Importing it
initialises MPI, so it is imported only by a process that `mpiexec` started.

Arrays go point to point with `Isend`/`Irecv` on the NumPy buffers themselves (no pickling);
control values (the chosen strategy, log records, checkpoint blocks, trace events) with the
pickle-based `isend`/`irecv`. Every call is non-blocking: the rank executor polls, so that its
stall watchdog can name the ranks it waits for.

MPI moves a large message only while its sender calls into MPI. Over TCP between hosts, measured
on the emulated cluster (250 Mbit/s): a 4 MiB send posted before 0.3 s of compute reached its
receiver 386 ms after it was posted, against 138 ms with the sender polling meanwhile; a rank
spends most of a step in kernels, so a halo or a gradient posted before one would wait for its
end. So while the rank computes or passes over its buffers (`computing`), a thread calls
`Iprobe` every `LEGION_NN_PROGRESS_US` (default `transport.PROGRESS_INTERVAL_US`; 0 turns it
off) on a communicator of its own (the kernels and NumPy's passes release the GIL). MPICH's own
progress thread (`MPIR_CVAR_ASYNC_PROGRESS`) spins without pause: with one core per host it made
seed-lcn-small's steps 2.5-4x slower. Measured on 2 emulated hosts at 3 Gbit/s, seed-lcn at
batch 16 (median of 4 steps, s): data-parallel 5.36 without the thread, 4.79 / 4.97 / 4.76
polling every 0.5 / 2 / 10 ms; model-parallel 0.74 without, 1.03 / 0.74 / 0.62.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from mpi4py import MPI

from runtime.transport import CONTROL_TAGS, progress_interval, wait


class _Request:
    __slots__ = ("request",)

    def __init__(self, request: MPI.Request) -> None:
        self.request = request

    def test(self) -> bool:
        return bool(self.request.Test())


class _ObjectSend:
    __slots__ = ("request",)

    def __init__(self, request: MPI.Request) -> None:
        self.request = request

    def test(self) -> bool:
        done, _ = self.request.test()
        return bool(done)


class _ObjectRecv:
    """A pickled value of any size: matched by a probe, then received whole.

    (`comm.irecv` without a buffer would cap the message at 32 KiB.)"""

    __slots__ = ("comm", "done", "src", "tag", "value")

    def __init__(self, comm: MPI.Comm, src: int, tag: int) -> None:
        self.comm, self.src, self.tag = comm, src, tag
        self.value: Any = None
        self.done = False

    def test(self) -> bool:
        if not self.done:
            message = self.comm.improbe(self.src, self.tag)
            if message is not None:
                self.value, self.done = message.recv(), True
        return self.done


class _ProgressThread(threading.Thread):
    """Calls into MPI while `active` is set, so that posted messages move during kernels."""

    def __init__(self, comm: MPI.Comm, interval: float) -> None:
        super().__init__(name="legion-nn-mpi-progress", daemon=True)
        self.comm = comm
        self.interval = interval
        self.active = threading.Event()
        self.stopped = False

    def run(self) -> None:
        while not self.stopped:
            if self.active.wait(0.1) and not self.stopped:
                self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)  # nothing is ever sent on it
                time.sleep(self.interval)

    def stop(self) -> None:
        self.stopped = True
        self.active.set()
        self.join()


#: how long a rank that aborts the job waits first, so that its output reaches the launcher
ABORT_GRACE_S = 0.2


class MPITransport:
    def __init__(self) -> None:
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.bytes_sent = 0
        tag_ub = self.comm.Get_attr(MPI.TAG_UB)
        self._tags = int(tag_ub) - CONTROL_TAGS
        self._object_sends: list[_ObjectSend] = []
        self._progress: _ProgressThread | None = None
        if self.size > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE and progress_interval() > 0:
            self._progress = _ProgressThread(self.comm.Dup(), progress_interval())
            self._progress.start()

    @contextmanager
    def computing(self) -> Iterator[None]:
        """The rank runs kernels or its own passes over memory: messages in flight move on
        meanwhile."""
        if self._progress is None:
            yield
            return
        self._progress.active.set()
        try:
            yield
        finally:
            self._progress.active.clear()

    def isend(self, array: np.ndarray, dst: int, tag: int) -> _Request:
        self.bytes_sent += array.nbytes
        return _Request(self.comm.Isend(array, dst, tag))

    def irecv(self, array: np.ndarray, src: int, tag: int) -> _Request:
        return _Request(self.comm.Irecv(array, src, tag))

    def send_object(self, value: Any, dst: int, tag: int) -> _ObjectSend:
        request = _ObjectSend(self.comm.isend(value, dst, tag))
        # MPI wants every request completed before it finalises; callers drop these.
        self._object_sends = [r for r in self._object_sends if not r.test()] + [request]
        return request

    def recv_object(self, src: int, tag: int) -> _ObjectRecv:
        return _ObjectRecv(self.comm, src, tag)

    def data_tag(self, seq: int) -> int:
        # Both ends post a pair's messages in the same order, so tags that wrap around on very
        # large plans still match correctly (MPI keeps a pair's messages in order).
        return CONTROL_TAGS + seq % self._tags

    def abort(self, code: int = 1) -> None:
        """End every rank of the job, once this rank's last lines have had time to leave.

        Hydra's proxy kills the job as soon as the abort reaches it, and what the rank wrote
        just before (flushed, but still in the pipe to the proxy) can be lost with it: the
        stall test's one line was missing, MPICH's own abort message too, in 1 of 4 runs
        right after another aborted job, and in none of 8 with this grace."""
        time.sleep(ABORT_GRACE_S)
        self.comm.Abort(code)

    def stop_progress(self) -> None:
        """End the progress thread (a transport used for one job of several in a process)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress.comm.Free()
            self._progress = None

    def finalize(self) -> None:
        self.stop_progress()
        for request in self._object_sends:
            request.request.wait()
        if not MPI.Is_finalized():
            MPI.Finalize()


def pingpong(
    sizes=(8, 1024, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20), repeat: int = 20
) -> dict[str, float]:
    """Latency and bandwidth between ranks 0 and 1: the latency is the smallest message's
    one-way time, the seconds per byte the slope of the one-way time over messages of 1 MiB
    and more (what gradients and activations are; small messages run from cache)."""
    times = link_times(0, 1, sizes, repeat)
    result = fit_link(list(zip(sizes, times))) if times is not None else (0.0, 0.0)
    return {"latency_s": result[0], "seconds_per_byte": result[1]}


#: the messages whose times a link's rate is fitted over (`fit_link`): smaller ones are latency
SLOPE_FROM_BYTES = 1 << 20


def fit_link(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency s, seconds per byte) of one-way times at sizes: the smallest message's time,
    and the slope over messages of `SLOPE_FROM_BYTES` and more (least squares)."""
    large = [(size, t) for size, t in points if size >= SLOPE_FROM_BYTES]
    if len(large) >= 2:
        slope = float(np.polyfit(*np.array(large, float).T, 1)[0])
    else:
        slope = (points[-1][1] - points[0][1]) / max(points[-1][0] - points[0][0], 1)
    return max(float(points[0][1]), 1e-7), max(slope, 1e-13)


#: how far apart the savings of messages larger than a link's burst may be, the largest over
#: the least, for the link to be read as a token bucket (a bucket saves each the same bytes)
BUCKET_SPREAD = 1.5


def fit_burst(points: list[tuple[int, float]], latency: float, per_byte: float) -> float:
    """Bytes a link lets through at once when idle: the most any measured message saved against
    latency plus its bytes at the rate, in bytes at the rate. A token bucket of B bytes (a
    shaper's burst, a NIC's or a switch's buffer) saves min(size, B) of them: all of a message
    up to B, and the same B of every larger one. A link without one saves none (noise aside: a
    saving is counted only where it exceeds a tenth of the message's time).

    Where the messages the rate is fitted on (`SLOPE_FROM_BYTES` and up) that saved less than
    themselves saved amounts more than `BUCKET_SPREAD` apart, the link is not a bucket but a
    rate that changes with the size, and none is counted: an unshaped veth, whose host's core
    copies the bytes, ran 1 and 4 MiB at 1.25 GB/s and 64 MiB at 0.55 GB/s, savings of 0.6, 2.4
    and 4.6 MB against the large messages' rate, which read as a 4.5 MB bucket let a small
    network's messages cross the simulated link free (tbf's savings: 240-247 KB at every size
    from 1 to 64 MiB)."""
    saved = [
        (size, (latency + size * per_byte - t) / per_byte)
        for size, t in points
        if latency + size * per_byte - t > 0.1 * t
    ]
    # beyond the bucket: the messages the rate is fitted on, each larger than its saving (a
    # small message's saving is within its latency's noise)
    beyond = [
        bytes_saved
        for size, bytes_saved in saved
        if size >= SLOPE_FROM_BYTES and bytes_saved < 0.9 * size
    ]
    if beyond and max(beyond) > BUCKET_SPREAD * min(beyond):
        return 0.0
    return max((bytes_saved for _, bytes_saved in saved), default=0.0)


def link_times(a: int, b: int, sizes, repeat: int = 20, duplex: bool = False) -> list[float] | None:
    """Collective over the world: ranks `a` and `b` time a message of each size one way (half
    a ping-pong's round trip; with `duplex`, both send at once and each exchange counts), the
    median of `repeat`; the times on rank `a`, None elsewhere. The other ranks wait, sleeping.

    The median, not the best: a step's messages cross at the link's typical time. A link whose
    hosts' cores move the bytes (an unshaped veth) varies from one message to the next with
    what else the cores do, and its best of 20 ran 1-4 MiB at 1.1-1.5 GB/s where a
    sharded plan's 8 MiB gathers crossed at under 0.5 in the step; a shaped link's times barely
    vary, and its median is its best.

    Each message is moved as a step moves its messages: posted without blocking and waited
    for by the runtime's own `transport.wait`, which polls, yielding the core and then sleeping
    up to a millisecond, where a blocking MPI call spins in MPI's progress engine. Timed by
    blocking calls, an unshaped veth's exchanges ran at 0.42 GB/s each way, where seed-lcn's
    all-reduce of 283 MB halves ran at 0.35 in its data-parallel step."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    peer = b if rank == a else a

    def moved(*requests: MPI.Request) -> None:
        pending = [(_Request(request), peer) for request in requests]
        wait(pending, "a timed message between two ranks", rank, LINK_TIMES_STALL_S)

    times = []
    for size in sizes:
        out = np.ones(size, np.uint8)  # written, so its pages are in before the clock starts
        into = np.ones(size, np.uint8)
        idle_barrier()
        taken = []
        for _ in range(repeat if size <= 4 << 20 else max(3, repeat // 4)):
            start = MPI.Wtime()
            if rank in (a, b) and duplex:
                moved(comm.Isend(out, peer, 0), comm.Irecv(into, peer, 0))
                taken.append(MPI.Wtime() - start)
            elif rank == a:
                moved(comm.Isend(out, b, 0))
                moved(comm.Irecv(into, b, 0))
                taken.append((MPI.Wtime() - start) / 2)
            elif rank == b:
                moved(comm.Irecv(into, a, 0))
                moved(comm.Isend(out, a, 0))
        times.append(float(np.median(taken)) if taken else float("inf"))
    return times if rank == a else None


#: how long a timed message may take before `link_times` names the rank it waits for
LINK_TIMES_STALL_S = 600.0


def idle_barrier(poll_s: float = 0.001) -> None:
    """A barrier that sleeps while it waits, so a waiting rank leaves its host's cores to the
    ranks measuring (MPI's own barrier spins)."""
    request = MPI.COMM_WORLD.Ibarrier()
    while not request.Test():
        time.sleep(poll_s)


def broadcast(value: Any) -> Any:
    """Rank 0's `value`, on every rank."""
    return MPI.COMM_WORLD.bcast(value, root=0)


def allgather(value: Any) -> list[Any]:
    return MPI.COMM_WORLD.allgather(value)


def world() -> tuple[int, int]:
    """(this rank, the rank count)."""
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:] != ["pingpong"]:
        sys.exit("usage: mpiexec -n 2 python -m runtime.mpi_transport pingpong")
    result = pingpong()
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps(result))
