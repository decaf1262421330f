"""How ranks exchange arrays: the interface the rank executor needs, and an in-process transport.

The rank executor posts non-blocking sends and receives of contiguous NumPy arrays, tagged, and
polls them; `wait` is the only place a rank blocks, and it is where the stall watchdog lives: past
`stall_timeout` seconds it raises `StallError` naming the ranks still owed a message and what the
rank was doing. Every send goes through `Transport.isend`, which counts the bytes it hands over;
that count is the `bytes_sent` of the training log.

Two transports implement this: `runtime.mpi_transport.MPITransport` (mpi4py, the only module that
imports it) and `ThreadTransport` below, R ranks as threads of one process exchanging through
mailboxes, which runs the very same rank programs without MPI (the equivalence tests run every
strategy through it quickly; the MPI tests then launch `mpiexec`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import numpy as np

from legion_nn.errors import LegionNNError

#: tags below this are the control plane (strategy, checkpoints, log records); data tags above
CONTROL_TAGS = 1000


class StallError(LegionNNError):
    """A rank waited longer than the stall timeout for messages from other ranks."""


class PeerLost(LegionNNError):
    """Communication with another rank failed: it died, or its connection did."""

    def __init__(self, rank: int, peer: int, what: str, error: BaseException) -> None:
        self.peer = peer
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        super().__init__(f"rank {rank}: {what}: lost rank {peer} ({first})")


class Request(Protocol):
    def test(self) -> bool: ...


class Transport(Protocol):
    rank: int
    size: int
    bytes_sent: int

    def isend(self, array: np.ndarray, dst: int, tag: int) -> Request: ...

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Request: ...

    def send_object(self, value: Any, dst: int, tag: int) -> Request: ...

    def recv_object(self, src: int, tag: int) -> ObjectRequest: ...

    def data_tag(self, seq: int) -> int: ...

    def computing(self) -> AbstractContextManager[None]:
        """Around a rank's work in a task (its kernels and its passes over its buffers): where
        the transport must be driven to move messages, it drives them meanwhile."""
        ...


class ObjectRequest(Protocol):
    value: Any

    def test(self) -> bool: ...


#: how often the MPI transport's progress thread calls into MPI while the rank computes, by
#: default (`runtime.mpi_transport`; each call moves what the sockets' buffers take, which the
#: step simulators price: `runtime.step.links.Links.held`)
PROGRESS_INTERVAL_US = 10_000


def progress_interval() -> float:
    """Seconds between the progress thread's calls (`LEGION_NN_PROGRESS_US`; 0: no thread)."""
    text = os.environ.get("LEGION_NN_PROGRESS_US", "")
    return (int(text) if text.isdigit() else PROGRESS_INTERVAL_US) * 1e-6


#: how long `wait` polls, yielding the core between polls, before it starts sleeping
YIELDING_WAIT_S = 0.005


def wait(
    pending: Sequence[tuple[Request, int]],
    what: str,
    rank: int,
    stall_timeout: float,
    progress: Callable[[], None] | None = None,
) -> None:
    """Wait for every (request, peer rank); past `stall_timeout` s, name the peers still owed.

    `progress`, when given, is called at every poll: the caller's other work in flight (the
    rounds of background collectives) moves on while this rank waits."""
    remaining = list(pending)
    start = time.monotonic()
    pause = 0.0
    while remaining:
        if progress is not None:
            progress()
        remaining = [(req, peer) for req, peer in remaining if not done(req, peer, what, rank)]
        if not remaining:
            return
        waited = time.monotonic() - start
        if waited > stall_timeout:
            peers = sorted({peer for _, peer in remaining})
            raise StallError(
                f"rank {rank}: {what} has waited {waited:.0f} s for rank"
                f"{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}"
            )
        if waited < YIELDING_WAIT_S:
            # Most waits are short (a peer finishing the same task): yielding keeps this rank
            # ready to go on at once, where a sleep of even 50 us would be overslept at each of
            # a step's dozens of synchronisations, and lets time-shared peers run.
            os.sched_yield()
            continue
        # Then back off to 1 ms: a long wait must not spin a core another rank needs.
        pause = min(max(pause * 2, 1e-5), 1e-3)
        time.sleep(pause)


def done(request: Request, peer: int, what: str, rank: int) -> bool:
    """Whether `request` has completed; a failure of the transport names the peer (`PeerLost`)."""
    try:
        return request.test()
    except (GroupAborted, PeerLost):
        raise
    except Exception as exc:
        raise PeerLost(rank, peer, what, exc) from exc


def wait_object(request: ObjectRequest, peer: int, what: str, rank: int, timeout: float) -> Any:
    wait([(request, peer)], what, rank, timeout)
    return request.value


# The in-process transport.


class _Done:
    def test(self) -> bool:
        return True


class GroupAborted(LegionNNError):
    """Another rank of an in-process group failed."""


class _Mailbox:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: dict[tuple[int, int, int], deque] = defaultdict(deque)
        self.aborted = False

    def put(self, key: tuple[int, int, int], value: Any) -> None:
        with self.lock:
            self.queues[key].append(value)

    def take(self, key: tuple[int, int, int]) -> tuple[bool, Any]:
        with self.lock:
            queue = self.queues.get(key)
            if not queue:
                return False, None
            return True, queue.popleft()


class _ThreadRecv:
    def __init__(self, box: _Mailbox, key: tuple[int, int, int], array: np.ndarray | None):
        self.box, self.key, self.array = box, key, array
        self.value: Any = None
        self.done = False

    def test(self) -> bool:
        if self.box.aborted:
            raise GroupAborted("another rank of the group failed")
        if not self.done:
            found, value = self.box.take(self.key)
            if found:
                if self.array is not None:
                    if value.shape != self.array.shape:
                        raise ValueError(
                            f"message {self.key} has shape {value.shape}, "
                            f"expected {self.array.shape}"
                        )
                    self.array[...] = value
                self.value = value
                self.done = True
        return self.done


class ThreadTransport:
    """Rank `rank` of `size` ranks living in threads of this process."""

    def __init__(self, box: _Mailbox, rank: int, size: int) -> None:
        self.box, self.rank, self.size = box, rank, size
        self.bytes_sent = 0

    @classmethod
    def group(cls, size: int) -> list[ThreadTransport]:
        box = _Mailbox()
        return [cls(box, rank, size) for rank in range(size)]

    def isend(self, array: np.ndarray, dst: int, tag: int) -> Request:
        self.bytes_sent += array.nbytes
        self.box.put((self.rank, dst, tag), np.array(array, copy=True))
        return _Done()

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Request:
        return _ThreadRecv(self.box, (src, self.rank, tag), array)

    def send_object(self, value: Any, dst: int, tag: int) -> Request:
        self.box.put((self.rank, dst, tag), value)
        return _Done()

    def recv_object(self, src: int, tag: int) -> ObjectRequest:
        return _ThreadRecv(self.box, (src, self.rank, tag), None)

    def computing(self) -> AbstractContextManager[None]:
        return nullcontext()  # a mailbox needs no driving

    def data_tag(self, seq: int) -> int:
        return CONTROL_TAGS + seq

    def abort(self) -> None:
        """Make every rank of the group fail its next wait (one rank has failed)."""
        self.box.aborted = True


def run_threads(size: int, body: Callable[[ThreadTransport], Any]) -> list[Any]:
    """Run `body(transport)` for each of `size` in-process ranks; the first failure is raised.

    A failing rank aborts the group, so the others fail their next wait instead of hanging."""
    transports = ThreadTransport.group(size)
    results: list[Any] = [None] * size
    errors: list[tuple[int, BaseException]] = []

    def target(transport: ThreadTransport) -> None:
        try:
            results[transport.rank] = body(transport)
        except BaseException as exc:  # noqa: BLE001  (handed to the caller below)
            errors.append((transport.rank, exc))
            transport.abort()

    threads = [threading.Thread(target=target, args=(t,), daemon=True) for t in transports]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = [exc for _, exc in errors if not isinstance(exc, GroupAborted)]
    if first or errors:
        raise (first or [errors[0][1]])[0]
    return results
