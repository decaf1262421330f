"""One rank of a command run under `mpiexec`: the steps every such rank takes, around its work.

A rank forks its watcher first (`runtime.supervisor`: a rank that dies is named, and the MPI
library's shared segments are unlinked whatever happens), spreads the host's cores among the
host's ranks, opens the MPI transport and unlinks the segments once every rank has mapped them.
Then it runs the command's `body`. Whatever the body raises ends the whole job with one line
naming the rank (a rank that lost a peer first waits a moment, so that the lost rank's watcher,
woken by the same death, has said which rank it was), and exit status 1.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

#: how long a rank that lost a peer waits before it reports and ends the job, so that the
#: lost rank's watcher (`runtime.supervisor`), woken by the same death, has written its line
PEER_LOST_GRACE_S = 1.0


def run_rank(command: str, status, body: Callable) -> int:
    """Run `body(transport)` as this rank of the job (`status`: `runtime.supervisor.Status`
    from `start_watcher`); returns the process's exit status."""
    from runtime.kernels.denormals import flushed_job

    with flushed_job():  # from before the rank's threads are set
        return _run_rank(command, status, body)


def _run_rank(command: str, status, body: Callable) -> int:
    from legion_nn.errors import LegionNNError
    from runtime.launch import ranks_on_this_host, share_cores
    from runtime.mpi_transport import MPITransport, idle_barrier
    from runtime.supervisor import release_segments
    from runtime.transport import PeerLost

    share_cores(ranks_on_this_host())
    transport = MPITransport()
    status.set_rank(transport.rank)
    idle_barrier()  # every rank has mapped MPI's shared memory: nothing opens it by name again
    release_segments()
    try:
        body(transport)
    except BaseException as exc:  # noqa: BLE001  (one line naming the rank, then the job ends)
        if isinstance(exc, PeerLost):
            time.sleep(PEER_LOST_GRACE_S)  # the launcher may well end this rank meanwhile
        if isinstance(exc, KeyboardInterrupt):
            message = f"rank {transport.rank}: interrupted"
        elif isinstance(exc, LegionNNError) and str(exc).startswith("rank "):
            message = str(exc)
        else:
            first = (str(exc).strip().splitlines() or [""])[0]
            message = f"rank {transport.rank}: {type(exc).__name__}: {first}"
        print(f"legion-nn {command}: {message}", file=sys.stderr, flush=True)
        if transport.size > 1:
            transport.abort(1)
        return 1
    transport.finalize()
    return 0


def report_setup_error(command: str, exc: BaseException) -> int:
    """A bad argument or file found by every rank alike, before MPI: rank 0 says it once."""
    from runtime.launch import rank_from_env

    if not rank_from_env():
        text = f"{exc.filename or ''}: {exc.strerror or exc}" if isinstance(exc, OSError) else exc
        print(f"legion-nn {command}: {text}", file=sys.stderr, flush=True)
    return 2
