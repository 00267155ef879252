"""CPU threads per rank: BLAS gets this rank's share of the node's cores, unless the user chose.

Ranks on one node share its cores. Left alone, every rank's BLAS starts one thread per core and
N ranks oversubscribe the node N times over. So, unless OMP_NUM_THREADS (or a BLAS-specific
variable) is set, each rank gets cores_per_node // ranks_per_node threads, or the cores the launcher
bound it to (srun --cpus-per-task, mpiexec -bind-to) when that set is smaller.
"""

from __future__ import annotations

import contextlib
import logging
import os

from .checks import is_count

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


def set_threads(threads: int | str | None = "auto", ranks_on_node: int = 1) -> int | None:
    """Set this process's BLAS (and elementwise) threads and log the choice; returns the count, or None
    when left alone. Comm() calls it with threads="auto" unless given threads=None.

    threads: "auto" (this rank's share of the node's cores, unless a *_NUM_THREADS variable is set),
    an int, or None (leave them). ranks_on_node: how many ranks share this node's cores
    (Comm.node_size counts them).
    """
    if threads is None:
        return None
    if threads != "auto" and not is_count(threads, 1):
        raise ValueError(f"set_threads: threads={threads!r}: give 'auto', an integer >= 1, or None")
    if threads == "auto":
        chosen = [v for v in USER_VARIABLES if os.environ.get(v)]
        bad = [
            f"{v}={os.environ[v]!r}"
            for v in chosen
            if not os.environ[v].strip().isdigit() or not int(os.environ[v])
        ]
        if bad:  # BLAS would ignore it, or take 0 as "all cores": the user's limit would not hold
            raise ValueError(
                f"set_threads: {', '.join(bad)} is not a thread count >= 1: give one, or unset it"
            )
        if chosen:
            log.info("BLAS threads left as set by %s=%s", chosen[0], os.environ[chosen[0]])
            return None
        threads = threads_per_rank(ranks_on_node)
    from threadpoolctl import threadpool_limits

    threadpool_limits(int(threads), user_api="blas")
    set_elementwise_threads(int(threads))
    log.info("BLAS threads per rank: %d (%d usable cores)", threads, usable_cores())
    return int(threads)


# -- elementwise work split across this rank's threads ---------------------------------------------
# NumPy runs each elementwise op on one thread, so between GEMMs the other BLAS threads of a rank sit
# idle. A row-wise kernel split into one block per thread runs in parallel: NumPy releases the GIL
# inside its loops. Blocks are few and large on purpose: small blocks lose to GIL hand-offs, one
# block per thread wins (bench/HISTORY.md).

MIN_PARALLEL_ELEMENTS = 1 << 18  # below this, splitting costs more than it gains
_workers: int | None = None
_executor = None
_controller = None  # threadpoolctl's view of the loaded BLAS, made once


def set_elementwise_threads(n: int):
    global _workers, _executor
    _workers = max(1, int(n))
    if _executor is not None:
        _executor.shutdown()
        _executor = None


def elementwise_threads() -> int:
    """Threads for split elementwise kernels: this rank's BLAS threads (1 where unknown)."""
    global _workers
    if _workers is None:
        from threadpoolctl import threadpool_info

        blas = [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]
        _workers = max(1, min(blas, default=1))
    return _workers


def row_blocks(n_rows: int, row_elements: int, align: int = 1) -> list[tuple[int, int]]:
    """[lo, hi) blocks of rows: one per thread for large arrays, a single block otherwise; their
    bounds at multiples of `align` rows (a caller's fixed groups of rows stay whole)."""
    groups = -(-n_rows // align)
    parts = min(elementwise_threads(), groups, max(1, n_rows * row_elements // MIN_PARALLEL_ELEMENTS))
    bounds = [min(n_rows, align * (groups * i // parts)) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def for_row_blocks(n_rows: int, row_elements: int, work, calls_blas: bool = False, align: int = 1) -> int:
    """Call work(i, lo, hi) for each block of rows, in parallel on this rank's threads.

    calls_blas: work runs GEMMs of its own (attention's heads); BLAS then runs one thread per call,
    the blocks in parallel or a single block alone, so the GEMMs' bits do not depend on how many
    blocks there are (deterministic mode pins BLAS for its chunks' other GEMMs). align: the blocks'
    bounds at multiples of it (row_blocks). Returns the number of blocks.
    """
    global _executor
    blocks = row_blocks(n_rows, row_elements, align)
    with one_blas_thread() if calls_blas else contextlib.nullcontext():
        if len(blocks) == 1:
            work(0, *blocks[0])
            return 1
        if _executor is None:
            from concurrent.futures import ThreadPoolExecutor

            _executor = ThreadPoolExecutor(elementwise_threads(), thread_name_prefix="mpifsdp-elementwise")
        futures = [_executor.submit(work, i, lo, hi) for i, (lo, hi) in enumerate(blocks)]
        for f in futures:
            f.result()  # re-raises a block's exception here
        return len(blocks)


@contextlib.contextmanager
def one_blas_thread():
    """BLAS on one thread inside: GEMMs called from several threads at once, each also starting BLAS's
    own threads, oversubscribe the cores (blocked attention ran several times slower so:
    bench/HISTORY.md)."""
    global _controller
    if _controller is None:
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    with _controller.limit(limits=1, user_api="blas"):
        yield


@contextlib.contextmanager
def blas_pinned(threads: int = 1):
    """BLAS at `threads` inside the block, whatever the process's setting: deterministic mode's chunks
    (OpenBLAS's Haswell and Zen kernels give other bits at 2 threads than at 1, measured; ours split
    rows and do not)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(int(threads), user_api="blas"):
        yield
