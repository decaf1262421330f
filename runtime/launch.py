"""What the launcher tells a process: whether `mpiexec`/`mpirun` started it, its rank, its
host's ranks, and the cores it may use. Read from the environment, without importing mpi4py, so
that a plain `legion-nn train` never initialises MPI, and a rank can be handed to its watcher
(`runtime.supervisor`) before MPI starts.
"""

from __future__ import annotations

import os

from legion_nn.cores import host_cores

#: environment variables that launchers set to the job's rank count and this process's rank
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
#: every variable above: without them a child process is no rank of the job
LAUNCHER_VARIABLES = frozenset(
    (*_SIZE_VARIABLES, *_RANK_VARIABLES, *_LOCAL_RANK_VARIABLES, "OMPI_COMM_WORLD_LOCAL_SIZE")
)


def share_cores(ranks_on_host: int) -> int:
    """Give this rank its share of the host's cores, for Numba's and BLAS's thread pools.

    Without it every rank starts one thread per core and R ranks on a host run R× too many."""
    import numba
    from threadpoolctl import threadpool_limits

    threads = max(1, host_cores() // max(ranks_on_host, 1))
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    threadpool_limits(limits=threads)
    return threads


def ranks_on_this_host() -> int:
    value = os.environ.get("MPI_LOCALNRANKS", "") or os.environ.get(
        "OMPI_COMM_WORLD_LOCAL_SIZE", ""
    )
    return int(value) if value.isdigit() else (world_size_from_env() or 1)


def world_size_from_env() -> int | None:
    """The rank count when `mpiexec`/`mpirun` started this process, else None."""
    return _first_number(_SIZE_VARIABLES)


def rank_from_env() -> int | None:
    return _first_number(_RANK_VARIABLES)


def local_rank_from_env() -> int | None:
    """This rank's index among the ranks on its host, where the launcher says."""
    return _first_number(_LOCAL_RANK_VARIABLES)


def _first_number(names: tuple[str, ...]) -> int | None:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None
