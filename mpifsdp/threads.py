"""CPU threads per rank: BLAS gets this rank's share of the node's cores, unless the user chose.

Ranks on one node share its cores. Left alone, every rank's BLAS starts one thread per core and
N ranks oversubscribe the node N times over. So, unless OMP_NUM_THREADS (or a BLAS-specific
variable) is set, each rank gets cores_per_node // ranks_per_node threads, or the cores the launcher
bound it to (srun --cpus-per-task, mpiexec -bind-to) when that set is smaller.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

USER_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")


def usable_cores() -> int:
    """Cores this process may run on (its affinity set where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(ranks_on_node: int) -> int:
    cores = usable_cores()
    if cores < (os.cpu_count() or cores):  # the launcher pinned this rank: use exactly its cores
        return cores
    return max(1, cores // max(1, ranks_on_node))


def configure_threads(mpi_comm, threads: int | str | None = "auto") -> int | None:
    """Set BLAS threads for this rank and log the choice; returns the count (None: left alone).

    threads: "auto" (this rank's share, unless a *_NUM_THREADS variable is set), an int, or None.
    Collective over `mpi_comm` when "auto" (it counts the ranks on this node).
    """
    if threads is None:
        return None
    if threads == "auto":
        node = mpi_comm.Split_type(_shared_type())
        ranks_on_node = node.Get_size()
        node.Free()
        chosen = [v for v in USER_VARIABLES if os.environ.get(v)]
        if chosen:
            log.info("BLAS threads left as set by %s=%s", chosen[0], os.environ[chosen[0]])
            return None
        threads = threads_per_rank(ranks_on_node)
    from threadpoolctl import threadpool_limits

    threadpool_limits(int(threads), user_api="blas")
    log.info("BLAS threads per rank: %d (%d usable cores)", threads, usable_cores())
    return int(threads)


def _shared_type():
    from mpi4py import MPI

    return MPI.COMM_TYPE_SHARED
