"""PhantomComm: one process runs rank k of an N-way job, its N - 1 peers stood in for.

Why: FSDP's mechanisms on a device (gather buffers of N shards, casts, the reduce-scatter's reduction,
stream ordering, the pool under gathers) only run at N > 1, and a model that needs sharding only fits
one GPU as one rank's share of it. A PhantomComm has N's shapes (every unit's shard is 1/N of it, its
gathers fill N slots, its reductions read N times the shard) with no other process and no network:
what one rank of the real job computes, stores and copies, on one device, with the one-rank shortcuts
off (they ask `size == 1`). What the links cost is the planner's to add (planning/planner.py).

Its peers are taken to run exactly what this rank runs on the same batch, which is what the
collectives assume of them: a gather fills each peer's slot with its stand-in shard; a reduce-scatter
gives N times this rank's slot (the sum of N equal gradients, so the mean is this rank's own); an
all-reduce multiplies by N; a broadcast and a barrier change nothing; every exchange of small values
returns this rank's N times. Two kinds of stand-in shard:
  peers="mine"     each peer's slot holds a copy of this rank's shard: no memory of its own, values
                   that train as no real model would (timing and memory only);
  peers="initial"  the peers' true initial slices, kept when each unit makes its shard ((N - 1) / N of
                   the model in the shards' dtype, in the memory ledger as "phantom_peers"): the first
                   step's loss, gradient and update of this rank's slice equal those of an N-rank (or
                   one-rank) job fed the same batch on every rank, without clipping, bit for bit where
                   N is a power of two (N g / N is g; at N = 3 within an ulp a gradient). From the
                   second step the peers' slices are stale (they never step).
The global gradient norm is N times this rank's share (its peers' shares are not computed), so
clipping is a stand-in too.

What rank 0 alone does in a job (StepMetrics' file, a report's printing) happens only where k is 0;
an exchange of the ranks' reports (mpifsdp.report) lists this rank's N times.

On a GPU the copies run on a stream of their own, ordered by events (device_ordered, as NCCL's), so a
CUDA graph captures them like NCCL's collectives; on the CPU they run at once. Hybrid sharding (split)
is refused: a phantom cannot know its peers' colours; so are checkpoints, a gather of any vector but the
parameters (Unit.gather, full_state_dict: the peers' slices would be stand-ins returned as values)
and a broadcast of an object only another rank computed.
"""

from __future__ import annotations

import pickle

import numpy as np

from ..base import backend
from .communicator import Comm, _mpi

PEERS = ("mine", "initial")


class Done:
    """A collective that completed when it started (the CPU's copies): an MPI-like request."""

    def Test(self):
        return True

    def Wait(self):
        pass


class PhantomTransport:
    """The data movement of N ranks' collectives, as local copies of the true sizes (see above)."""

    name = "phantom"

    def __init__(self, rank: int, size: int, device_ordered: bool):
        self.rank, self.size = rank, size
        self.device_ordered = device_ordered  # on a GPU: queued on a stream of its own, host not waiting
        self.stream = backend.collective_stream() if device_ordered else None
        self.peers = None  # the unit being gathered: its peers' stand-in shards (None: this rank's)

    def _queued(self, work):
        """Run work() after everything queued on the current stream (on the phantom's stream on a GPU:
        a request the compute stream waits for by its event), or at once on the CPU."""
        if self.stream is None:
            work()
            return Done()
        backend.stream_wait_current(self.stream)
        with self.stream:
            work()
        return backend.StreamRequest(self.stream)

    def iall_gather(self, send, recv):
        """recv's N slots: this rank's `send` in its own, each peer's stand-in in the others'."""
        slots, peers = recv.reshape(self.size, send.size), self.peers

        def work():
            for r in range(self.size):
                slots[r][...] = send if peers is None or r == self.rank else peers[r]

        return self._queued(work)

    def ireduce_scatter(self, send, recv):
        """recv = the sum of N ranks' equal slots: N times this rank's."""
        mine = send.reshape(self.size, recv.size)[self.rank]
        return self._queued(lambda: backend.array_module_of(recv).multiply(mine, self.size, out=recv))

    def iall_reduce(self, array):
        """array summed over N equal ranks, in place."""
        return self._queued(lambda: backend.array_module_of(array).multiply(array, self.size, out=array))

    def ibroadcast(self, array, root: int):
        """Every peer holds what this rank holds: nothing moves (the arrays broadcast are values every
        rank computes alike, as a unit's initial values under sync_values; an object only the root
        computes is refused: PhantomComm.broadcast_object)."""
        return Done()

    def request_after_current(self):
        """Completion of the work queued so far on the current stream (a replayed graph's)."""
        return backend.StreamRequest(backend.current_stream())


class PhantomComm(Comm):
    """Rank `rank` of a `size`-way job, run alone: a Comm with N's shapes whose peers are stand-ins
    (module docstring). Everything else is Comm's: the schedule, its checks, the ledger, the
    watchdog; the ledger counts the bytes rank `rank` of the real job would send. Checkpoints are
    refused (the peers' shards are not there), and so is an object only another rank computed."""

    stands_in = True

    def __init__(self, size: int, rank: int = 0, *, peers: str = "mine", device: str = "cpu", **kwargs):
        """size: N, the job stood in for; rank: the one this process runs; peers: "mine" or "initial"
        (module docstring); device and the other keywords as Comm's (transport: the phantom's)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"PhantomComm(size={size!r}): the job's rank count, an integer >= 1")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"PhantomComm(rank={rank!r}): this process's rank, 0 <= rank < {size}")
        if peers not in PEERS:
            raise ValueError(f"PhantomComm(peers={peers!r}): choose one of {PEERS}")
        if kwargs.get("transport") not in (None, "phantom"):
            raise ValueError("a PhantomComm's collectives are its own copies: give no transport")
        on_device = backend.parse_device(device)[0] != backend.CPU
        kwargs["transport"] = "host" if on_device else None  # made at once, then replaced by its own
        super().__init__(_mpi().COMM_SELF, device=device, **kwargs)
        self.rank, self.size, self.peers = rank, size, peers
        self.schedule.rank = rank  # reports name the rank this process stands for
        self.transport = PhantomTransport(rank, size, device_ordered=on_device)
        self._host_transport = PhantomTransport(rank, size, device_ordered=False)
        self._stand_ins: dict[str, list] = {}  # unit -> its peers' initial shards (peers="initial")

    def __repr__(self):
        return f"PhantomComm(rank={self.rank}, size={self.size}, peers={self.peers!r})"

    def made_shard(self, unit, arrays: dict):
        """peers="initial": keep every peer's slice of the unit's initial values, in its shard's dtype
        and memory, counted in its memory ledger ("phantom_peers": memory the real job's rank would
        not hold). A unit name made twice is refused: a gather would mix two models' values."""
        if self.peers != "initial":
            return
        if unit.name in self._stand_ins:
            raise ValueError(
                f"{self!r}: a unit named {unit.name!r} was made on it already; with peers='initial' "
                "one model a PhantomComm (make another PhantomComm for another model)"
            )
        shard = unit.shard
        xp = backend.array_module_of(shard)
        stand_ins = [None] * self.size
        for r in (r for r in range(self.size) if r != self.rank):
            stand_ins[r] = xp.zeros_like(shard)
            unit.layout.fill_shard(stand_ins[r], arrays, r, xp)
            unit.ledger.alloc("phantom_peers", shard.nbytes)
        self._stand_ins[unit.name] = stand_ins

    def iall_gather(self, shard, full, *, unit: str = "", phase: str = "other"):
        """A unit's parameters gathered (the only vectors a Unit gathers on a phantom: Unit.gather
        refuses): its peers' initial slices in their slots, or this rank's shard (peers="mine")."""
        self.transport.peers = self._stand_ins.get(unit)  # the unit's stand-ins, for this gather
        try:
            return super().iall_gather(shard, full, unit=unit, phase=phase)
        finally:
            self.transport.peers = None

    def broadcast_object(self, obj=None, root: int = 0, *, phase: str = "other"):
        """`obj` where this rank is `root`; what another rank alone computed cannot be stood in for."""
        if root != self.rank:
            raise ValueError(
                f"{self!r}: broadcast_object from rank {root}, which is a stand-in: only what every rank "
                "computes alike can be stood in for (run this rank as the root, or a job of real ranks)"
            )
        return super().broadcast_object(obj, root, phase=phase)

    def split(self, color: int, key: int | None = None):
        raise ValueError(
            "a PhantomComm cannot split (hybrid sharding): it cannot know its peers' colours; "
            "stand in for one shard group instead (PhantomComm(size=the group's ranks))"
        )

    def _exchange_ints(self, *values: int) -> np.ndarray:
        return np.tile(np.array(values, dtype=np.int64), (self.size, 1))

    def _exchange_objects(self, obj) -> tuple[list, int]:
        return [obj] * self.size, (self.size - 1) * len(pickle.dumps(obj))


__all__ = ["PhantomComm"]
