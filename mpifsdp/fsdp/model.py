"""ShardedModel: the per-step schedule across the units fully_shard made (build.py makes them).

Each unit module's forward runs inside its UnitLifecycle (lifecycle.py): unshard (Allgather) -> bind
parameter views -> forward (its nodes recorded under the unit's autodiff scope) -> reshard (free).
Backward, through the scope: pre_backward gathers again and points every parameter's .grad at a view
of one flat full_grad; the VJPs accumulate into it; post_backward reduce-scatters it into the grad
shard and frees both. Parameters no unit module owns form the root unit.

The ShardedModel is the outermost scope of every step: it checks the inputs and ends the forward; at
the end of backward it sweeps units backward never reached, finishes the reduce-scatters and compares
the ranks' schedules. Overlap (as FSDP2): while unit k computes, the gathers of the next `prefetch`
units are in flight (forward: the order units ran in the previous forward, registration order at
first; backward: the reverse of this forward's order), and each unit's reduce-scatter runs while the
next unit's backward computes. Every rank issues the same collectives in the same order
(docs/design.md, invariant 5): the schedule depends only on the model's structure, never on data.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque

import numpy as np

from .. import ops
from ..autodiff.tape import grad_enabled, scope
from ..autodiff.tensor import Tensor
from ..base.accounting import MemoryLedger
from ..base.backend import host_value
from ..base.checks import is_count
from ..comm.communicator import CollectiveError, Comm
from ..comm.schedule import digest
from ..nn.module import settings_changes
from ..shard.pool import BufferPool
from ..shard.unit import Unit
from .deterministic import ChunkedBatch, ChunkState
from .lifecycle import Stage, UnitLifecycle, casts_kept


class ShardedModel:
    """All units of one sharded model, and what a step does across them (see the module docstring).

    Its collections change only through its own methods: `ran` (a unit's forward finished),
    `prefetch_after` (a unit asks for the gathers after it), `reducing` (a reduce-scatter started).
    """

    def __init__(
        self, model, comm: Comm, prefetch: int, max_reducing: int = 1, levels=(None, None), chunks=(None, 1)
    ):
        """chunks: (chunk_size, chunk_threads) of deterministic mode (fsdp/deterministic.py), training
        through chunks() of chunk_size samples, their GEMMs on chunk_threads BLAS threads; chunk_size
        None: the normal mode."""
        chunk_size, chunk_threads = chunks
        if not is_count(prefetch):
            raise ValueError(f"prefetch must be an integer >= 0 (units gathered ahead), got {prefetch!r}")
        if chunk_size is not None and not is_count(chunk_size, 1):
            raise ValueError(f"chunk_size must be an integer >= 1 (samples per chunk), got {chunk_size!r}")
        if not is_count(chunk_threads, 1):
            raise ValueError(f"chunk_threads must be an integer >= 1 (BLAS threads), got {chunk_threads!r}")
        self.deterministic, self.chunk_size = chunk_size is not None, chunk_size
        self.chunk_threads = chunk_threads
        self.chunk_state = ChunkState()
        self.comm = comm  # every rank: input checks, valid-target counts, the schedule check
        # HSDP: (this rank's shard group, its replicas across groups); (comm, None) for plain FSDP
        self.shard_comm, self.replicas = levels[0] or comm, levels[1]
        self.ledger = MemoryLedger()
        self.pool = BufferPool()
        self.prefetch_depth = prefetch
        self._model = weakref.ref(model)  # its check_inputs runs at each forward's start
        self._units: list[UnitLifecycle] = []  # the unit modules', in registration order
        self._root: UnitLifecycle | None = None  # the parameters no unit module owns, if any
        self._max_reducing = max_reducing  # reduce-scatters left in flight while backward goes on
        self._ran: list = []  # units (not the root) in the order this forward ran them
        self._forward_order: list = []  # ... as the previous forward ran them (drives prefetch)
        self._backward_order: list = []  # the reverse of the last forward with grad
        self._reduces: deque = deque()  # units whose reduce-scatter is in flight
        self.lifecycles: tuple = ()  # every unit's, the root's last
        self.requires_gradient_sync = True  # False: backward keeps full gradients (no_sync)
        self._settings_known = None  # (settings_changes() when read, model.settings(), its digest)

    def add(self, lifecycle: UnitLifecycle, root: bool = False):
        if root:
            self._root = lifecycle
        else:
            self._units.append(lifecycle)
        self.lifecycles = (*self._units, *([self._root] if self._root else []))  # the root's last

    @property
    def units(self) -> list[Unit]:
        return [unit for lc in self.lifecycles for unit in lc.units]

    @property
    def trainable_units(self) -> list[Unit]:
        """The units an optimizer steps (frozen ones have no gradients)."""
        return [unit for unit in self.units if unit.trainable]

    # -- forward: the model's forward wrapper -------------------------------------------------------
    def chunks(self, *arrays) -> ChunkedBatch:
        """Deterministic mode: `for chunk in sharded.chunks(x, y): model(*chunk).backward()` runs this
        rank's chunks of its batch; see fsdp/deterministic.py. Collective (a count check)."""
        if not self.deterministic:
            raise RuntimeError("chunks() is the deterministic mode's: fully_shard(..., deterministic=True)")
        return ChunkedBatch(self, arrays)

    def model_modules(self):
        return self._model().named_modules()

    def run_model(self, forward, *args, **kwargs):
        if self.deterministic and grad_enabled() and self.chunk_state.index is None:
            raise RuntimeError(
                "deterministic mode trains chunk by chunk: `for chunk in sharded_model(model).chunks(x, y): "
                "model(*chunk).backward()` (a forward with gradients outside chunks() would sum floats)"
            )
        if self.chunk_state.index is not None:
            self.chunk_state.weight = next((int(a.shape[0]) for a in args if getattr(a, "ndim", 0) > 0), 1)
            out = self._run_model(forward, *args, **kwargs)
            if isinstance(out, Tensor) and out.data.size == 1:
                self.chunk_state.losses.append(
                    (self.chunk_state.index, self.chunk_state.weight, float(out.data.reshape(())))
                )
            return out
        return self._run_model(forward, *args, **kwargs)

    def _run_model(self, forward, *args, **kwargs):
        self.check_inputs(args, kwargs)
        for lc in self.lifecycles:  # a pass that raised part-way left these mid-stage
            if lc.stage in (Stage.FORWARD, Stage.BACKWARD):
                lc.abandon()
        self._ran = []
        self._start_gathers(self._order("forward")[: self.prefetch_depth], "forward")
        with_grad = grad_enabled()
        try:
            with ops.mean_over_ranks(self.count_share), scope(self):
                if self._root is None:
                    return forward(*args, **kwargs)
                return self._root.run_forward(forward, *args, **kwargs)
        finally:
            self._forward_order = self._ran
            if with_grad:
                self._backward_order = list(reversed(self._ran))
            self._release_gathered()

    def ran(self, lifecycle: UnitLifecycle):
        if lifecycle is not self._root:
            self._ran.append(lifecycle)

    def check_inputs(self, args, kwargs):
        """Refuse bad input and unequal batches on every rank (collective; one tiny allgather).

        Each rank contributes its batch size, whether model.check_inputs found a problem (if any rank
        did, every rank raises with each rank's message) and its schedule position (collectives
        issued and their hash: a rank that ran an extra forward or backward is caught here).
        [Note: gradient averaging] Reduce-scatter then /N averages ranks' gradients with equal weight;
        with unequal batches that is not the gradient of the global mean (docs/design.md, invariant 3),
        so an uneven last batch is an error here rather than a silently wrong update. Without
        gradients (an evaluation under no_grad) there is nothing to average: an uneven batch is fine,
        and the loss is still the global mean (it divides by the global count of valid targets).
        """
        model = self._model()
        try:  # a check that fails on one rank must still reach the exchange below
            problem = model.check_inputs(*args, **kwargs)
        except Exception as exc:
            problem = f"check_inputs raised {type(exc).__name__}: {exc}"
        n = next((int(a.shape[0]) for a in args if getattr(a, "ndim", 0) > 0), -1)
        seq, digest = self.comm.schedule.position()  # so forward, too, starts from a checked schedule
        settings = self._settings(model)
        mine = (n, int(bool(problem)), int(grad_enabled()), self._settings_known[2], seq, digest)
        verdicts = self.comm.gather_ints(*mine, phase="forward", op="batch_size_check")
        self.comm.check_positions(verdicts[:, 4:], "at the start of a forward")
        if verdicts[:, 1].any():
            self.comm.raise_if_any(problem and f"{type(model).__name__}: {problem}", "checking the inputs")
        if len(set(verdicts[:, 2].tolist())) > 1:
            without = [r for r, g in enumerate(verdicts[:, 2].tolist()) if not g]
            raise CollectiveError(
                f"ranks {without} run this forward under no_grad() and the others with gradients: every "
                "rank must run the same kind of forward (their backward would issue different collectives)"
            )
        if len(set(verdicts[:, 3].tolist())) > 1:
            self._refuse_settings(settings)
        sizes = verdicts[:, 0].tolist()
        if len(set(sizes)) > 1 and grad_enabled():
            raise CollectiveError(
                f"ranks hold different batch sizes {dict(enumerate(sizes))}: averaging their gradients would "
                "weight samples unequally. Give every rank the same number of samples (drop or pad the "
                "last batch; data.rank_slice splits a global batch evenly), or evaluate under no_grad()."
            )

    def _settings(self, model) -> dict:
        """model.settings() and its digest, walked again only after a module's setting was assigned."""
        if self._settings_known is None or self._settings_known[0] != settings_changes():
            settings = model.settings()
            self._settings_known = (settings_changes(), settings, digest(settings))
        return self._settings_known[1]

    def _refuse_settings(self, settings: dict):
        """Ranks whose modules compute with different settings (train/eval, a dropout rate, heads):
        their gradients would average different functions. Collective: every rank saw the digests."""
        everyone = self.comm.allgather_object(settings, phase="forward")
        differ = {}  # (setting, its values by rank) -> the modules where ranks differ so
        for name in sorted(set().union(*everyone)):
            for key in sorted(set().union(*(r.get(name, {}) for r in everyone))):
                values = {rank: r.get(name, {}).get(key) for rank, r in enumerate(everyone)}
                if len(set(map(repr, values.values()))) > 1:
                    differ.setdefault((key, repr(values)), []).append(name or type(self._model()).__name__)
        said = [
            f"{key} {values} in {len(where)} modules ({', '.join(where[:2])}, ...)"
            if len(where) > 2
            else f"{key} {values} in {' and '.join(where)}"
            for (key, values), where in differ.items()
        ]
        raise CollectiveError(
            f"ranks run the model with different settings, by rank: {'; '.join(said)}. Each rank would "
            "compute another function: call train()/eval() and change settings on every rank alike."
        )

    def count_share(self, local: int) -> float:
        """The count this rank's mean-reduced loss divides by: valid targets summed over ranks / N.

        [Note: gradient averaging] (docs/design.md, invariant 3) With it, the mean of the ranks' losses
        and of their gradients (reduce-scatter, then 1/N) is the global batch's mean even when ranks
        hold different numbers of valid (not ignored) targets. Equal counts give exactly the local one.
        """
        if self.chunk_state.index is not None:  # deterministic mode: weighed by the exact sum instead
            return self.chunk_state.count(local)
        if not isinstance(local, int):  # a device batch's count: summed on the device where it can
            what = "the count of valid targets"
            summed = self.comm.all_reduce_on_device(
                local.astype(np.float64).reshape(1), what=what, phase="forward"
            )
            if summed is not None:
                return summed.reshape(()) / self.comm.size
            local = int(host_value(local, what))
        counts = self.comm.gather_ints(local, phase="forward", op="valid_target_count")[:, 0]
        return int(counts.sum()) / self.comm.size

    # -- prefetch ---------------------------------------------------------------------------------
    def prefetch_after(self, lifecycle: UnitLifecycle, direction: str):
        """Start the gathers of the `prefetch` units after `lifecycle` in this pass's order."""
        order = self._order(direction)
        if lifecycle in order:
            i = order.index(lifecycle) + 1
            self._start_gathers(order[i : i + self.prefetch_depth], direction)

    def _order(self, direction: str) -> list:
        if direction == "backward":
            return self._backward_order
        return self._forward_order or self._units

    def _start_gathers(self, lifecycles, direction: str):
        for lc in lifecycles:
            keep, kept = casts_kept(direction, lc.reshard_after_forward)
            for unit in lc.units:
                unit.start_unshard(direction, keep_cast=keep, use_kept=kept)
        if direction == "backward" and lifecycles:  # the next unit's gradient, for the one running
            lifecycles[0].bind_grads_ahead()

    def _release_gathered(self):
        """Reshard units gathered ahead that will not run now (a changed order, or the pass ended);
        units kept from forward to backward (reshard_after_forward=False) stay until their backward."""
        for lc in self.lifecycles:
            if not (lc.stage is Stage.AWAITING_BACKWARD and not lc.reshard_after_forward):
                for unit in lc.units:
                    unit.reshard()

    # -- gradient accumulation --------------------------------------------------------------------
    def set_requires_gradient_sync(self, sync: bool):
        """False: each backward adds into every unit's full (unsharded) gradient and reduces nothing;
        the first backward with True reduce-scatters the sum. Fewer collectives over k micro-batches
        (one reduce-scatter instead of k), at the price of holding every unit's full gradient
        (P * itemsize bytes per rank) between them. docs/training.md compares both ways."""
        self.requires_gradient_sync = bool(sync)

    @contextlib.contextmanager
    def no_sync(self):
        """`with sharded.no_sync():` backward passes inside keep their gradients unreduced."""
        previous, self.requires_gradient_sync = self.requires_gradient_sync, False
        try:
            yield
        finally:
            self.requires_gradient_sync = previous

    # -- backward: the outermost scope ------------------------------------------------------------
    def pre_backward(self):
        """Backward begins: the ranks compare their schedules first (one small exchange), so a rank
        that skipped this backward, or runs another step, is named on every rank before the units'
        gathers, which carry no fingerprint, could pair with something else."""
        self.comm.check_schedule(phase="backward", when="at the start of a backward")
        self._start_gathers(self._backward_order[: self.prefetch_depth], "backward")

    def reducing(self, unit: Unit):
        """A unit started its reduce-scatter: finish older ones beyond the number left in flight.
        With HSDP the older ones move on to their all-reduce across groups first, which then runs
        while this unit's reduce-scatter and the next unit's backward do (twice as many in flight)."""
        self._reduces.append(unit)
        older = list(self._reduces)[: -self._max_reducing]
        for waiting in older:
            waiting.advance_reduce_grad()
        self._finish_reduces(keep=self._max_reducing * (2 if self.replicas is not None else 1))

    def _finish_reduces(self, keep: int):
        while len(self._reduces) > keep:
            self._reduces.popleft().finish_reduce_grad()

    def post_backward(self):
        """The end of backward: every unit reduced, nothing gathered, the ranks' schedules compared.
        On a GPU the host does not wait here for the backward's collectives: the optimizer's one read
        of the step's verdict comes after them on the stream and waits for them, under the watchdog
        (Comm.read); code reading gradients itself calls Comm.settle() first."""
        self._sweep_unreached()
        self._finish_reduces(keep=0)
        self._release_gathered()
        for level in self.levels():  # every rank issued the same collectives this step, on each level
            level.check_schedule()

    def backward_failed(self):
        """Backward raised part-way (tape.backward tells the scopes it cut short): finish every
        collective in flight (MPI must not write into buffers that may be freed), reshard every unit
        and send every unit not IDLE back there (UnitLifecycle.abandon)."""
        self._finish_reduces(keep=0)
        for lc in self.lifecycles:
            if lc.stage is Stage.IDLE:
                for unit in lc.units:
                    unit.reshard()
            else:
                lc.abandon()

    def _sweep_unreached(self):
        """[Note: post-backward always runs] A unit whose forward ran with grad but whose outputs did
        not reach the loss has no node in the graph, so the engine never calls its hooks. Without
        this sweep it would skip its reduce-scatter, and ranks would disagree on the collective
        sequence whenever the skip is data-dependent (docs/design.md, invariant 6)."""
        for lc in self.lifecycles:
            if lc.stage is Stage.AWAITING_BACKWARD:
                lc.pre_backward()
                lc.post_backward()

    # -- what it holds ----------------------------------------------------------------------------
    def plan(self) -> dict:
        """Expected bytes per rank: persistent 16 * shard (fp32 AdamW; 4 * shard when frozen) plus what
        is gathered at once (the largest module's units)."""
        units = self.units
        itemsize = units[0].layout.dtype.itemsize

        def gathered(lc):
            return sum(u.layout.padded_numel for u in lc.units) * itemsize

        root = gathered(self._root) if self._root else 0
        others = [gathered(lc) for lc in self._units]
        return {
            "units": len(units),
            "params": sum(u.layout.numel for u in units),
            "trainable_params": sum(u.layout.numel for u in units if u.trainable),
            # parameters, gradients and two AdamW moments per trainable element; a frozen one: its value
            "persistent": itemsize * sum((4 if u.trainable else 1) * u.numel for u in units),
            "largest_unit": max(others, default=0),
            "root_unit": root,
            "prefetch": self.prefetch_depth,
        }

    def levels(self) -> list[Comm]:
        """The communicators this model's collectives run on: the world, and HSDP's two levels."""
        return [self.comm] + [c for c in (self.shard_comm, self.replicas) if c not in (None, self.comm)]

    def report(self) -> list[dict]:
        """Every rank's memory and communication ledgers (collective: call on all ranks). With HSDP,
        "comm" holds the world's collectives (checks), "comm_in_group" the gathers and reduce-scatters
        inside the shard group and "comm_across_groups" the gradient all-reduces between groups."""
        memory = {**self.ledger.report(), "pool_bytes": self.pool.nbytes}
        mine = {"rank": self.comm.rank, "memory": memory, "comm": self.comm.ledger.report()}
        if self.shard_comm is not self.comm:
            mine["comm_in_group"] = self.shard_comm.ledger.report()
        if self.replicas is not None:
            mine["comm_across_groups"] = self.replicas.ledger.report()
        return self.comm.allgather_object(mine)
