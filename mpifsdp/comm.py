"""Comm: the collectives FSDP needs, over an MPI communicator, with exact accounting.

Knows nothing of units or autodiff: callers pass a unit name and a phase only for the ledger.
By default it works on a Clone of COMM_WORLD (as mpi4jax does), so our collectives can never match
a user's own messages; pass any communicator to embed mpifsdp in a code that already uses MPI.
"""

from __future__ import annotations

import numpy as np

from .accounting import CommLedger
from .backend import parse_device, select_gpu
from .schedule import Schedule
from .threads import configure_threads
from .transport import choose_transport


class CollectiveError(RuntimeError):
    """Raised on every rank when a check that must agree across ranks failed on one or more of them."""


def _mpi():
    from mpi4py import MPI

    return MPI


class Comm:
    """Collectives on flat, contiguous arrays: all_gather, reduce_scatter, all_reduce, broadcast."""

    def __init__(
        self,
        mpi_comm=None,
        clone: bool = True,
        threads="auto",
        debug=None,
        timeout=None,
        abort_on_timeout=True,
        device: str = "cpu",
        transport: str | None = None,
    ):
        """threads: BLAS threads per rank: "auto" (the node's cores shared by its ranks, unless
        OMP_NUM_THREADS or similar is set), an int, or None to leave BLAS alone (see threads.py).
        debug / timeout / abort_on_timeout: the schedule checks and the watchdog (schedule.py);
        None takes MPIFSDP_DEBUG and MPIFSDP_TIMEOUT from the environment.
        device: "cpu" or "cuda" (this rank takes GPU local_rank mod GPUs); transport: how device
        arrays move, "nccl", "cuda-aware-mpi" or "host" (see transport.py; None chooses)."""
        MPI = _mpi()
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.mpi = base.Clone() if clone else base
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        self.ledger = CommLedger()
        self.schedule = Schedule(self.mpi, debug, timeout, abort_on_timeout)
        self.threads = configure_threads(self.mpi, threads)
        self.device = "cpu" if parse_device(device)[0] == "cpu" else select_gpu(self.mpi)
        self.transport = choose_transport(self.mpi, parse_device(self.device)[0], transport)

    def __repr__(self):
        return f"Comm(rank={self.rank}, size={self.size})"

    def _check_shards(self, op: str, shard, full):
        """Both contiguous 1-D, same dtype, and `full` exactly N shards long; else a clear error."""
        for a in (shard, full):
            if a.ndim != 1 or not a.flags.c_contiguous:
                raise ValueError(f"{op} needs contiguous 1-D arrays, got shape {a.shape}")
        if full.size != shard.size * self.size or full.dtype != shard.dtype:
            raise ValueError(
                f"{op}: a full buffer of {full.size} {full.dtype} elements must hold exactly {self.size} "
                f"shards of {shard.size} {shard.dtype}"
            )

    def _start(self, op: str, launch, shard, full, unit: str, phase: str):
        """Check the buffers, announce the collective to the schedule, launch it, count it."""
        self._check_shards(op, shard, full)
        self.schedule.announce(unit, phase, op, full.size, full.dtype)
        request = launch()
        self.ledger.record(unit, phase, op, (self.size - 1) * shard.size, shard.itemsize)
        return request

    def iall_gather(self, shard, full, *, unit: str = "", phase: str = "other"):
        """Start full[r*n:(r+1)*n] = shard of rank r (n = shard.size) on every rank; returns a request."""
        return self._start(
            "all_gather", lambda: self.transport.iall_gather(shard, full), shard, full, unit, phase
        )

    def ireduce_scatter(self, full, shard, *, unit: str = "", phase: str = "other"):
        """Start shard = sum over ranks of full[r*n:(r+1)*n] for this rank r; returns a request."""
        launch = lambda: self.transport.ireduce_scatter(full, shard)  # noqa: E731
        return self._start("reduce_scatter", launch, shard, full, unit, phase)

    def wait(self, request):
        """Complete a request from iall_gather / ireduce_scatter, under the watchdog."""
        self.schedule.wait(request)

    def all_gather(self, shard, full, *, unit: str = "", phase: str = "other"):
        self.wait(self.iall_gather(shard, full, unit=unit, phase=phase))

    def reduce_scatter(self, full, shard, *, unit: str = "", phase: str = "other"):
        """A sum: callers divide by size for a mean."""
        self.wait(self.ireduce_scatter(full, shard, unit=unit, phase=phase))

    def all_reduce(self, array, *, unit: str = "", phase: str = "other"):
        """In-place sum over ranks."""
        self.schedule.announce(unit, phase, "all_reduce", array.size, array.dtype)
        self.wait(self.mpi.Iallreduce(_mpi().IN_PLACE, array, op=_mpi().SUM))
        self.ledger.record(
            unit, phase, "all_reduce", 2 * (self.size - 1) * array.size // self.size, array.itemsize
        )

    def all_reduce_scalar(self, value: float, *, phase: str = "other") -> float:
        buf = np.array([value], dtype=np.float64)
        self.all_reduce(buf, phase=phase)
        return float(buf[0])

    def broadcast(self, array, root: int = 0, *, unit: str = "", phase: str = "other"):
        self.schedule.announce(unit, phase, "broadcast", array.size, array.dtype)
        self.wait(self.mpi.Ibcast(array, root=root))
        self.ledger.record(unit, phase, "broadcast", array.size if self.rank != root else 0, array.itemsize)

    def gather_ints(self, *values: int, phase: str = "other", op: str = "gather_ints") -> np.ndarray:
        """Every rank's small tuple of integers, as a (size, len(values)) array; watched like a collective."""
        self.schedule.announce("", phase, op, self.size * len(values), np.dtype(np.int64))
        everyone = self.schedule.exchange_ints(*values)
        self.ledger.record("", phase, op, (self.size - 1) * len(values), everyone.itemsize)
        return everyone

    def allgather_object(self, obj) -> list:
        """Every rank's `obj` (pickled); for small metadata such as layout fingerprints and reports."""
        return self.mpi.allgather(obj)

    def raise_if_any(self, error: str | None, what: str):
        """Collective check: if any rank reports an error, raise on every rank with all messages.

        [Note: same collectives everywhere] A check that can fail on one rank must not raise there
        alone: the other ranks would block in their next collective. So each rank contributes its
        verdict and every rank raises the same CollectiveError (DESIGN invariant 5).
        """
        errors = self.allgather_object(error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            lines = "\n".join(f"  rank {r}: {e}" for r, e in failed)
            raise CollectiveError(f"{what} failed on {len(failed)} of {self.size} ranks:\n{lines}")
