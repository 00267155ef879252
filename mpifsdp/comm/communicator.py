"""Comm: every collective mpifsdp issues, over an MPI communicator, checked, watched and counted.

Knows nothing of units or autodiff: callers pass a unit name and a phase only for the ledger.
By default it works on a Clone of COMM_WORLD (as mpi4jax does), so our collectives can never match
a user's own messages; pass any communicator to embed mpifsdp in a code that already uses MPI.

[Note: same collectives everywhere] (docs/design.md, invariant 5) No other module of the package
calls an MPI collective (tests/unit/comm/test_comm.py greps for it; transport.py moves the bytes of the large
ones). So every collective, from a unit's gather to a checkpoint's barrier, is announced to the
schedule (its fingerprint enters the per-step check), completes under the watchdog, and is
counted in the ledger.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time

import numpy as np

from ..base import backend, logs
from ..base.accounting import HOST_SYNCS, CommLedger
from ..base.backend import array_module_of, bytes_digest, parse_device, rank_device
from ..base.checks import env_flag
from ..base.threads import set_threads
from . import launcher, presence
from .schedule import Schedule, ScheduleError, describe, digest
from .transport import MPITransport, choose_transport


class CollectiveError(RuntimeError):
    """Raised on every rank when a check that must agree across ranks failed on one or more of them."""


def _mpi():
    from mpi4py import MPI

    return MPI


class Comm:
    """Collectives on flat, contiguous arrays (all_gather, reduce_scatter, all_reduce, broadcast),
    on small Python objects (broadcast_object, allgather_object), barrier, and collective checks."""

    stands_in = False  # whether its peers are stand-ins (comm/phantom.py): nothing to checkpoint

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
        bind_gpu: bool = True,
        one_rank_shortcuts: bool | None = None,
    ):
        """threads: passed to mpifsdp.set_threads with this node's rank count: "auto" (the node's
        cores shared by its ranks, unless OMP_NUM_THREADS or similar is set), an int, or None to leave
        the process's threads alone (an embedding code that sets its own; set_threads may be called
        at any time).
        debug / timeout / abort_on_timeout: the schedule checks and the watchdog (schedule.py);
        None takes MPIFSDP_DEBUG and MPIFSDP_TIMEOUT from the environment.
        device: "cpu" or "cuda" (this rank takes GPU local_rank mod GPUs); transport: how device
        arrays move, "nccl", "cuda-aware-mpi" or "host" (see transport.py; None chooses);
        bind_gpu=False keeps `device` as given (a sub-communicator of a Comm already bound: split).
        one_rank_shortcuts: whether one rank on a GPU skips its gathers and reductions (its full
        parameters are its cast shard; see `one_rank`); False (or MPIFSDP_ONE_RANK_SHORTCUTS=0) runs
        them, as N ranks do: the transport's own collectives, captured in a CUDA graph too.
        MPIFSDP_RANKS_PER_NODE=K pretends that every K consecutive ranks form a node (tests of
        hybrid sharding on one machine)."""
        MPI = _mpi()
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if not isinstance(base, MPI.Comm):
            raise TypeError(f"Comm(mpi_comm=...) takes an mpi4py communicator, not {base!r}")
        self.rank, self.size = base.Get_rank(), base.Get_size()
        self.library = launcher.library(MPI)  # which MPI: "MPICH Version: 5.0.2", "Open MPI v4.1.4"
        if mpi_comm is None:  # the job's world: is it the job the launcher started?
            logs.label(self.rank, self.size)
            launcher.log_library(self.rank, self.library)
            problem = launcher.launcher_problem(self.rank, self.size)
            if problem:
                raise RuntimeError(problem)
        self.ledger = CommLedger()
        if one_rank_shortcuts is None:
            one_rank_shortcuts = env_flag("MPIFSDP_ONE_RANK_SHORTCUTS", True)
        self.one_rank_shortcuts = bool(one_rank_shortcuts)
        self._in_flight = None  # the newest device collective waited for on the GPU only (wait, settle)
        self._started: dict = {}  # id(request) -> (unit, phase): whose wait it is (ledger.waits)
        self._stalls: list = []  # ((unit, phase), before, after): the compute stream's timed waits
        self.time_waits = False  # on a GPU: time how long the compute stream waits for each collective
        self._captured: list | None = None  # device collectives noted while a CUDA graph captures
        self.schedule = Schedule(
            self.rank, base.Abort, debug, timeout, abort_on_timeout, mpi_error=MPI.Exception
        )
        self.mpi = self._clone(base) if clone else base
        # every rank of it makes this Comm: the side channel (collective over it) is opened once
        presence.open_channel(self.mpi, self.schedule.where, self.schedule.timeout)
        self.node_rank, self.node_size, self.node_id = self._node_ranks()
        self.threads = set_threads(threads, self.node_size)
        self.device = rank_device(device, bind_gpu, self.node_rank)
        self.transport = choose_transport(
            self.mpi, parse_device(self.device)[0], transport, self.node_size, wait=self.schedule.wait
        )
        self._host_transport = MPITransport(self.mpi)  # host memory's (_carrier)

    def __repr__(self):
        return f"Comm(rank={self.rank}, size={self.size})"

    @property
    def one_rank(self) -> bool:
        """Whether a collective of this Comm may be skipped as a copy of what this rank holds: one
        rank, and its shortcuts on (a Unit on a GPU then sends its cast shard as its full parameters
        and keeps its full gradient as its shard: shard/unit.py)."""
        return self.size == 1 and self.one_rank_shortcuts

    def made_shard(self, unit, arrays: dict):
        """`unit` made this rank's shard of `arrays` (the full values every rank passed): nothing to do
        here; a Comm that stands in for other ranks keeps theirs (comm/phantom.py)."""

    def _clone(self, base):
        """A communicator of our own (MPI's Idup, waited under the watchdog: a Comm() that some ranks
        never make is reported by name, where a Clone would hang for ever)."""
        self.schedule.announce(
            "", "setup", "Comm() (every rank of the communicator must make it)", 1, np.dtype(np.int64)
        )
        mine, request = base.Idup()
        self.schedule.wait(request)
        return mine

    def _node_ranks(self) -> tuple[int, int, int]:
        """(this rank's index, number of ranks, lowest rank) on its node: for BLAS threads, GPU choice
        and hybrid sharding's groups."""
        pretend = os.environ.get("MPIFSDP_RANKS_PER_NODE")
        if pretend:  # nodes of K consecutive world ranks; a Comm over some of them sees its own share
            world = _mpi().COMM_WORLD
            if not pretend.strip().isdigit() or int(pretend) < 1 or world.Get_size() % int(pretend):
                raise ValueError(
                    f"MPIFSDP_RANKS_PER_NODE={pretend!r} must be an integer >= 1 dividing the "
                    f"{world.Get_size()} ranks of the job"
                )
            nodes = self.mpi.allgather(world.Get_rank() // int(pretend))  # setup: before any schedule
            mine = [r for r, node in enumerate(nodes) if node == nodes[self.rank]]
            return mine.index(self.rank), len(mine), mine[0]
        node = self.mpi.Split_type(_mpi().COMM_TYPE_SHARED)
        rank, size = node.Get_rank(), node.Get_size()
        lowest = node.allreduce(self.rank, op=_mpi().MIN)
        node.Free()
        return rank, size, lowest

    def split(self, color: int, key: int | None = None) -> Comm:
        """A Comm over the ranks that pass the same `color` (ordered by key, default this rank),
        with this Comm's checks, watchdog and device; collective over this Comm (compared first)."""
        self._announce("", "setup", "split", 1, np.dtype(np.int64))
        sub = self.mpi.Split(color, self.rank if key is None else key)
        return Comm(
            sub,
            clone=False,
            threads=None,
            debug=self.schedule.debug,
            timeout=self.schedule.timeout,
            abort_on_timeout=self.schedule.abort_on_timeout,
            device=self.device,
            bind_gpu=False,
            one_rank_shortcuts=self.one_rank_shortcuts,
            transport=self.transport.name,  # the user's choice, or the one this Comm's ranks agreed on
        )

    # -- the schedule: every collective is announced, and checked ----------------------------------
    def _announce(self, unit: str, phase: str, op: str, count: int, dtype, *, hot: bool = False):
        """Record the collective in the schedule, and compare its fingerprint across ranks before it
        runs: always, except for the hot path (a unit's gathers and reductions, covered by the
        per-step hash), which debug mode compares too. So ranks in different collectives (a save on
        rank 0 alone, an evaluation one rank skipped) are named on every rank before a byte of the
        other collective is read: every compared collective starts with the same small exchange."""
        fp = self.schedule.announce(unit, phase, op, count, dtype)
        if self.schedule.debug or not hot:
            self._compare(digest(fp), "before " + describe(fp))

    def check_schedule(self, *, phase: str = "backward", when: str = "at the end of a step"):
        """Compare every rank's position and rolling hash of collectives: one allgather of two ints
        (itself announced first, so the hash it compares includes it)."""
        self._announce("", phase, "schedule_check", 2 * self.size, np.dtype(np.int64), hot=True)
        self._compare(self.schedule.position()[1], when)
        self.ledger.record("", phase, "schedule_check", 2 * (self.size - 1), 8)

    def _compare(self, value: int, when: str):
        seq = self.schedule.position()[0]
        self.check_positions(self._exchange_ints(seq, value), when)

    def check_positions(self, positions: np.ndarray, when: str):
        """Given every rank's (collectives issued, hash) as exchanged by all of them, raise
        ScheduleError on every rank if they differ. Every rank saw the same mismatch, so every rank
        joins the exchange of details, then continues from rank 0's position (so a caught
        ScheduleError does not fail every later check of this Comm)."""
        if len(set(map(tuple, positions.tolist()))) == 1:
            return
        reports = self._exchange_objects(self.schedule.recent_steps())[0]
        self.schedule.resume_from(*positions[0].tolist())
        raise self.schedule.mismatch(reports, when)

    # -- the raw exchanges (watched, not announced: they carry the schedule's own checks) ----------
    def _exchange_ints(self, *values: int) -> np.ndarray:
        mine = np.array(values, dtype=np.int64)
        everyone = np.empty(self.size * mine.size, dtype=np.int64)
        self.schedule.wait(self.mpi.Iallgather(mine, everyone))
        return everyone.reshape(-1, mine.size)

    def _exchange_objects(self, obj) -> tuple[list, int]:
        """Every rank's pickled `obj`, and the bytes this rank received."""
        raw = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = self._exchange_ints(raw.size)[:, 0]
        if (sizes <= 0).any() or int(sizes.max()) > 2**31:  # not lengths: another rank's collective
            raise ScheduleError(
                f"an exchange of objects received impossible lengths {sizes.tolist()}: the ranks are in "
                "different collectives (one ran a forward, backward or reduction the others did not); "
                "MPIFSDP_DEBUG=1 names the first collective where they differ"
            )
        everyone = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.schedule.wait(self.mpi.Iallgatherv(raw, (everyone, sizes)))
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        objects = [pickle.loads(everyone[a:b].tobytes()) for a, b in zip(bounds[:-1], bounds[1:])]
        return objects, everyone.size - raw.size

    # -- collectives on flat arrays ----------------------------------------------------------------
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
        # a unit's gathers and reductions in forward and backward are the hot path (the per-step hash
        # covers them); the same collectives elsewhere (full_state_dict, a user's gather) are compared
        self._announce(unit, phase, op, full.size, full.dtype, hot=phase in ("forward", "backward"))
        request = launch()
        self._count(unit, phase, op, full.size, full.dtype, (self.size - 1) * shard.size, shard.itemsize)
        self._note_start(request, unit, phase)
        return request

    def _note_start(self, request, unit: str, phase: str):
        """Whose request this is, for the exposed time its wait counts (ledger.waits)."""
        if len(self._started) > 4096:  # requests completed without a wait (a failed step's): forgotten
            self._started.clear()
        self._started[id(request)] = (unit, phase)

    def _count(self, unit: str, phase: str, op: str, count: int, dtype, elements: int, itemsize: int):
        """A collective started: counted in the ledger (and noted, while a graph captures)."""
        self.ledger.record(unit, phase, op, elements, itemsize)
        if self._captured is not None:
            self._captured.append((unit, phase, op, count, dtype, elements, itemsize))

    @contextlib.contextmanager
    def capturing(self):
        """Inside: the collectives started are noted as well as run (a CUDA graph's capture, whose
        replays run them again with no Python: fsdp/graphed.py); yields the list of them."""
        self._captured = []
        try:
            yield self._captured
        finally:
            self._captured = None

    def replayed(self, collectives: list):
        """A graph ran `collectives` again (as capturing() noted them): in the schedule and the
        ledger as if started again."""
        for unit, phase, op, count, dtype, elements, itemsize in collectives:
            self.schedule.announce(unit, phase, op, count, dtype)
            self.ledger.record(unit, phase, op, elements, itemsize)

    def await_current(self):
        """The next settle or read waits (under the watchdog) for all work queued so far on the
        current stream: a replayed graph, its collectives in it."""
        self._in_flight = (self.transport.request_after_current(), self.schedule.current)

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
        """Complete a request from iall_gather / ireduce_scatter / iall_reduce, under the watchdog;
        the time blocked here is counted (ledger.wait_s). A GPU stream's request (NCCL) is ordered
        on the device instead: the compute stream waits for it, the host does not (it goes on
        queueing the next units' kernels), and `settle` checks that it completed. With time_waits set,
        two events on the compute stream time how long it stalled there (counted once done)."""
        where = self._started.pop(id(request), ("", "other"))
        if hasattr(request, "order_after"):
            timed = self.time_waits and self._captured is None  # no timing events inside a graph
            before = backend.record_event() if timed else None
            request.order_after()
            if timed:
                self._stalls.append((where, before, backend.record_event()))
            self._in_flight = (request, self.schedule.current)  # one stream: the newest completes last
            return
        start = time.perf_counter()
        self.schedule.wait(request)
        blocked = time.perf_counter() - start
        self.ledger.wait_s += blocked
        self.ledger.waits[where] += blocked

    def settle(self, purpose: str = "the collectives of a step"):
        """Wait (under the watchdog) until the device collectives already waited for have completed:
        at the end of backward and in the optimizer's step, one host sync each, counted in HOST_SYNCS."""
        if self._in_flight is None:
            return
        (request, fingerprint), self._in_flight = self._in_flight, None
        HOST_SYNCS.count(purpose)
        start = time.perf_counter()
        self.schedule.wait(request, current=fingerprint)
        self.ledger.wait_s += time.perf_counter() - start
        self.count_stalls()

    def count_stalls(self):
        """The compute stream's timed waits whose events are done, into ledger.waits (the rest at a
        later settle or read, or a call after the device is synchronized: the host never waits for
        them)."""
        pending = []
        for where, before, after in self._stalls:
            if backend.event_done(after):
                self.ledger.waits[where] += backend.elapsed_s(before, after)
            else:
                pending.append((where, before, after))
        self._stalls = pending

    def read(self, arrays: list, purpose: str) -> list:
        """Small arrays' values on the host. On a GPU one host sync (counted in HOST_SYNCS) under the
        watchdog: the copies are queued behind everything on the stream, the collectives it waits
        for among them, so they settle those too, and a stalled one is named (as settle names it)."""
        if all(array_module_of(a) is np for a in arrays):
            return [np.asarray(a) for a in arrays]
        copies = [backend.DeviceRead(a) for a in arrays]  # the last one's event comes after all
        fingerprint = self.schedule.current if self._in_flight is None else self._in_flight[1]
        self._in_flight = None
        HOST_SYNCS.count(purpose)
        start = time.perf_counter()
        self.schedule.wait(copies[-1], current=fingerprint)
        self.ledger.wait_s += time.perf_counter() - start
        self.count_stalls()
        return [copy.host for copy in copies]

    def all_gather(self, shard, full, *, unit: str = "", phase: str = "other"):
        self.wait(self.iall_gather(shard, full, unit=unit, phase=phase))

    def reduce_scatter(self, full, shard, *, unit: str = "", phase: str = "other"):
        """A sum: callers divide by size for a mean."""
        self.wait(self.ireduce_scatter(full, shard, unit=unit, phase=phase))

    def iall_reduce(self, array, *, unit: str = "", phase: str = "other", hot: bool = False):
        """Start the in-place sum over ranks of a contiguous array; returns a request (see wait).
        hot=True: a unit's per-step traffic (HSDP's gradient shards), not compared before it runs."""
        return self._start_all_reduce(
            lambda: self._carrier(array).iall_reduce(array), array, unit, phase, hot
        )

    def _carrier(self, array):
        """What moves `array` in an all-reduce or a broadcast: MPI itself for host memory (a norm, a
        count), whatever the transport; the transport for device memory, which MPI may not read (it
        need not be CUDA-aware)."""
        return self._host_transport if array_module_of(array) is np else self.transport

    def _start_all_reduce(self, launch, array, unit: str, phase: str, hot: bool = False):
        """An in-place all-reduce of `array`, announced, started by launch() and counted."""
        self._announce(unit, phase, "all_reduce", array.size, array.dtype, hot=hot)
        request = launch()
        elements = 2 * (self.size - 1) * array.size // self.size
        self._count(unit, phase, "all_reduce", array.size, array.dtype, elements, array.itemsize)
        self._note_start(request, unit, phase)
        return request

    def all_reduce(self, array, *, unit: str = "", phase: str = "other"):
        """In-place sum over ranks."""
        self.wait(self.iall_reduce(array, unit=unit, phase=phase))

    def all_reduce_on_device(self, array, *, what: str, phase: str = "other"):
        """`array` (a small device array) summed over ranks in place, ordered on the device: the
        host does not wait (NCCL). None, nothing done, where the transport cannot (MPI: the caller
        reads the value back and reduces it on the host)."""
        if not self.transport.device_ordered or self._carrier(array) is self._host_transport:
            return None
        self.wait(self._start_all_reduce(lambda: self.transport.iall_reduce(array), array, what, phase))
        return array

    def all_reduce_scalar(self, value: float, *, phase: str = "other", what: str = "a scalar") -> float:
        """The sum over ranks of one float. `what` names its purpose in the collective's fingerprint, so
        two ranks reducing different quantities (a gradient norm here, a loss there) are caught."""
        buf = np.array([value], dtype=np.float64)
        self.all_reduce(buf, unit=what, phase=phase)
        return float(buf[0])

    def broadcast(self, array, root: int = 0, *, unit: str = "", phase: str = "other", hot: bool = False):
        self._announce(unit, phase, "broadcast", array.size, array.dtype, hot=hot)
        self.wait(self._carrier(array).ibroadcast(array, root))
        self.ledger.record(unit, phase, "broadcast", array.size if self.rank != root else 0, array.itemsize)

    def gather_ints(self, *values: int, phase: str = "other", op: str = "gather_ints") -> np.ndarray:
        """Every rank's small tuple of integers, as a (size, len(values)) array."""
        self._announce("", phase, op, self.size * len(values), np.dtype(np.int64))
        everyone = self._exchange_ints(*values)
        self.ledger.record("", phase, op, (self.size - 1) * len(values), everyone.itemsize)
        return everyone

    def barrier(self, *, phase: str = "other"):
        """Return once every rank has arrived (e.g. every rank's file is on disk)."""
        self._announce("", phase, "barrier", 0, np.dtype(np.uint8))
        self.wait(self.mpi.Ibarrier())
        self.ledger.record("", phase, "barrier", 0, 1)

    # -- small Python objects (pickled): names, file records, reports ------------------------------
    def broadcast_object(self, obj=None, root: int = 0, *, phase: str = "other"):
        """`obj` of rank `root`, on every rank (its length first, then its bytes)."""
        raw = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if self.rank == root else None
        length = np.array([0 if raw is None else raw.size], dtype=np.int64)
        self.broadcast(length, root, phase=phase)  # compared: the bytes that follow pair with it
        buf = raw.copy() if raw is not None else np.empty(int(length[0]), dtype=np.uint8)
        self.broadcast(buf, root, phase=phase, hot=True)
        return pickle.loads(buf.tobytes())

    def allgather_object(self, obj, *, phase: str = "other") -> list:
        """Every rank's `obj` (pickled), in rank order; for small metadata such as layouts and reports."""
        self._announce("", phase, "allgather_object", self.size, np.dtype(np.uint8))
        everyone, received = self._exchange_objects(obj)
        received += 8 * (self.size - 1)  # the other ranks' lengths, exchanged first
        self.ledger.record("", phase, "allgather_object", received, 1)  # counted in bytes
        return everyone

    # -- collective checks -------------------------------------------------------------------------
    def require_same(self, array, what: str, remedy: str, *, phase: str = "other"):
        """Collective: a ValueError on every rank unless `array` holds the same bits on every rank.

        For values every rank must agree on exactly (the same code on the same inputs gives the same
        bits): an optimizer's iterate, an edit written back. A hash of the bytes, taken a piece at a
        time (no host copy of a large device array), exchanged once; NaN is a value like any other."""
        flat = array.reshape(-1)
        pieces = (flat[lo : lo + (1 << 20)] for lo in range(0, flat.size, 1 << 20))
        digests = self.allgather_object(bytes_digest(pieces), phase=phase)
        off = [r for r, d in enumerate(digests) if d != digests[0]]
        if off:
            raise ValueError(
                f"{what} differ between ranks (ranks {off} differ from rank 0, bit for bit): {remedy}"
            )

    def raise_if_any(self, error: str | None, what: str, error_type=CollectiveError):
        """Collective check: if any rank reports an error, raise on every rank with all messages.

        [Note: same collectives everywhere] A check that can fail on one rank must not raise there
        alone: the other ranks would block in their next collective. So each rank contributes its
        verdict and every rank raises the same error (docs/design.md, invariant 5).
        """
        errors = self.allgather_object(error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            lines = "\n".join(f"  rank {r}: {e}" for r, e in failed)
            raise error_type(f"{what} failed on {len(failed)} of {self.size} ranks:\n{lines}")

    def run_everywhere(
        self, action, what: str, catch=(OSError, ValueError), error_type=CollectiveError, root=None
    ):
        """Run `action()` on every rank (or on rank `root` only) and agree: if it raised one of `catch`
        on any rank, every rank raises `error_type` naming each rank's error; else returns this rank's
        result (None where it did not run)."""
        result, error = None, None
        try:
            if root is None or root == self.rank:
                result = action()
        except catch as exc:
            error = str(exc) or type(exc).__name__
        self.raise_if_any(error, what, error_type)
        return result


__all__ = ["Comm", "CollectiveError", "ScheduleError"]
