"""Unit: one flat-sharded parameter group. The framework-agnostic core of mpifsdp.

A Unit takes named arrays, lays them end to end (FlatLayout) and keeps only this rank's slice:
`shard` and `grad_shard` persist; `full` and `full_grad` exist only while the unit is unsharded.
Nothing here knows about autodiff, so a NumPy/CuPy code with hand-written gradients can use it:

    unit = Unit("model", {"w": w0, "b": b0}, comm)
    with unit.unsharded() as p:                   # Allgather -> views of the full parameters
        grads = my_gradients(p["w"], p["b"], my_batch)
    unit.reduce_grad(grads)                        # Reduce_scatter (mean over ranks) -> grad_shard
    opt = AdamW([unit], lr=1e-2); opt.step()       # local update of this rank's shard

The gathers and reduce-scatters can also run nonblocking (start_unshard, start_reduce_grad) so
that FSDP overlaps them with compute; `full` and `full_grad` come from a BufferPool, so no large
buffer is allocated per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np

from ..base.accounting import MemoryLedger
from ..base.backend import array_module_of, device_kind, to_numpy
from ..base.checks import check_summable, finfo, float_dtype, is_bfloat16
from .cast import casts_for
from .exact import ExactSum, PendingSum
from .flat import UnshardedParams, agreed_layout, require_same_edit
from .gather import Gathered, moved
from .pool import BufferPool


@dataclasses.dataclass
class _Reduction:
    """A gradient reduction in flight: the reduce-scatter inside the group (source still held), then,
    with HSDP, the all-reduce of `receive` across the groups (source None)."""

    request: object
    receive: object
    source: object
    divisor: float
    phase: str


class Unit:
    """One flat-sharded parameter group: this rank's shard, its gradient, gathers and reductions."""

    def __init__(
        self,
        name: str,
        named_arrays,
        comm,
        *,
        dtype=None,
        ledger: MemoryLedger | None = None,
        pool: BufferPool | None = None,
        param_dtype=None,
        reduce_dtype=None,
        sync_values: bool = False,
        trainable: bool = True,
        replicas=None,
        deterministic: bool = False,
    ):
        """replicas: hybrid sharding (HSDP). `comm` is then this rank's shard group and `replicas` the
        ranks holding the same shard in the other groups: each gradient shard, once reduce-scattered
        inside the group, is all-reduced across them (the mean over every rank of both).
        trainable=False: frozen parameters, gathered for compute but never given a gradient, reduced
        or stepped (no grad_shard: 4 bytes per shard element in fp32 instead of 16 with AdamW).
        param_dtype: the dtype parameters are gathered and computed in (e.g. float16), while the shard,
        its gradient and the optimizer state stay in the arrays' dtype (fp32 masters); reduce_dtype: the
        dtype gradients are reduce-scattered in (default param_dtype).
        sync_values: take rank 0's values (a broadcast per array); by default every rank must pass the
        same values, which is checked (a hash per rank, in the layout check's one exchange).
        deterministic: an optimizer's gradient norm over this unit is summed exactly (the same bits at
        any N; gradients summed with add_chunk_grad / reduce_chunk_grads)."""
        named_arrays = list(named_arrays.items() if isinstance(named_arrays, dict) else named_arrays)
        self.name, self.comm, self.replicas = name, comm, replicas
        self.deterministic = bool(deterministic)
        self.ledger = ledger if ledger is not None else MemoryLedger()
        if replicas is not None:  # the same layout and values in every group too
            agreed_layout(name, named_arrays, replicas, dtype, check_values=not sync_values)
        self.layout = agreed_layout(name, named_arrays, comm, dtype, check_values=not sync_values)
        if sync_values:  # across groups first, then inside: every rank ends with world rank 0's values
            for level in (replicas, comm) if replicas is not None else (comm,):
                named_arrays = [(n, self._from_rank_0(a, level)) for n, a in named_arrays]
        self.pool = pool if pool is not None else BufferPool()
        self.xp = array_module_of(named_arrays[0][1])  # the layout check refused empty units
        self.device = device_kind(named_arrays[0][1])  # 'cpu' or 'cuda'
        self.casts = casts_for(self.xp)  # how its gathers cast and check (the device's: shard/cast.py)
        self.offload = None  # (fully_shard's Offload, the job's Comm): where an optimizer keeps its states
        self.param_dtype, self.reduce_dtype = self._precisions(param_dtype, reduce_dtype, trainable)
        self.full_grad_dtype = self.casts.grad_dtype(self.param_dtype)
        n = self.layout.shard_numel
        # [Note: padding] shard positions past the last tensor start at zero, and every update keeps
        # them there (the padded gradient is zero, so AdamW moves nothing): docs/design.md, invariant 2.
        self._shard = self.xp.zeros(n, dtype=self.layout.dtype)
        arrays = dict(named_arrays)
        self.layout.fill_shard(self._shard, arrays, comm.rank, self.xp)
        comm.made_shard(self, arrays)  # a phantom keeps its peers' slices (comm/phantom.py)
        self.trainable = trainable
        self._grad = self.xp.zeros(n, dtype=self.layout.dtype) if trainable else None
        self._grad_zeroed_lazily = False  # zero_grad's fill, left to the first reader (see grad_shard)
        self.has_grad = False
        self.ledger.alloc("param_shard", self._shard.nbytes)
        if trainable:
            self.ledger.alloc("grad_shard", self._grad.nbytes)
        self.full = None  # gathered parameters, while unsharded (or gathering)
        self.gathered = Gathered.SHARDED  # the gather state (shard/gather.py: its moves checked)
        self.full_grad = None  # gradient accumulator, between zero_full_grad and the reduce-scatter
        self._gathering = None  # (request, send buffer) of an unshard in flight
        self._reducing: _Reduction | None = None  # a reduction in flight
        self._exact: ExactSum | None = None  # chunks added, not yet reduced (deterministic mode)
        self._pending_sum: PendingSum | None = None  # their reduction in flight

    def _from_rank_0(self, array, comm):
        """Rank 0's values of `array`, on every rank of `comm` (a broadcast, under the watchdog)."""
        out = array_module_of(array).array(array, copy=True, order="C")
        comm.broadcast(out.reshape(-1), root=0, unit=self.name, phase="setup")
        return out

    def __repr__(self):
        frozen = "" if self.trainable else ", frozen"
        return f"Unit({self.name!r}, {self.layout.describe()}, {self.state}{frozen})"

    def _require_trainable(self, what: str):
        if not self.trainable:
            raise RuntimeError(
                f"unit {self.name!r} is frozen (trainable=False): it has no gradients to {what}"
            )

    @property
    def state(self) -> str:
        return self.gathered.value

    def _move(self, to: Gathered):
        self.gathered = moved(self.name, self.gathered, to)

    def _precisions(self, param_dtype, reduce_dtype, trainable: bool):
        """(param_dtype, reduce_dtype), checked: floating; bfloat16 only on a GPU, and reduced there
        only over NCCL (the same refusal on every rank, before any collective)."""
        param_dtype = float_dtype("param_dtype", param_dtype or self.layout.dtype)
        reduce_dtype = float_dtype("reduce_dtype", reduce_dtype or param_dtype)
        bfloat16 = is_bfloat16(param_dtype) or is_bfloat16(reduce_dtype)
        if bfloat16 and not self.casts.computes_bfloat16:
            raise ValueError(
                f"unit {self.name!r}: bfloat16 computes on a GPU only (NumPy has no bfloat16 arithmetic "
                "of its own: ml_dtypes' matmul returns float32); on the CPU give float16 or float32"
            )
        if trainable:
            for level in (self.comm, self.replicas) if self.replicas is not None else (self.comm,):
                check_summable(level.transport.name, reduce_dtype, "reduce_dtype")
        return param_dtype, reduce_dtype

    @property
    def shard(self):
        """This rank's slice of the parameters (in the arrays' dtype: the masters). Whoever takes it
        may write it, so the param_dtype cast an optimizer wrote with its last update is no longer
        trusted to be its cast: the next gather casts afresh (cast_written)."""
        self.casts.afresh()
        return self._shard

    def cast_target(self):
        """(buffer, device flag, OVERFLOWED): where an optimizer's update kernel may write the new shard's
        param_dtype cast and flag its overflow (the kept cast's buffer), so that the next forward's
        gather sends it with no cast launch of its own; None where there is none (the CPU, no kept
        cast). Then cast_written() says it was written."""
        return self.casts.target()

    def cast_written(self):
        """The optimizer wrote the updated shard's cast into cast_target()'s buffer and flagged its
        overflow there: the next gathers send it (until `shard` is handed out again), and the step's
        verdict reads its flag."""
        self.casts.written()

    def _take(self, category: str, dtype, numel: int | None = None, zero: bool = False):
        buf = self.pool.take(numel or self.layout.padded_numel, dtype, self.xp, zero=zero)
        self.ledger.alloc(category, buf.nbytes)
        return buf

    def _cast(self, category: str, array, dtype):
        """`array` itself, or a pooled copy in `dtype` (mixed precision)."""
        if array.dtype == dtype:
            return array
        copy = self._take(category, dtype, numel=array.size)
        with np.errstate(over="ignore"):  # an overflow is named once gathered: _check_representable
            copy[...] = array
        return copy

    def _give(self, category: str, buf):
        self.ledger.free(category, buf.nbytes)
        self.pool.give(buf)

    # -- parameters ---------------------------------------------------------------------------------
    def start_unshard(self, phase: str = "forward", keep_cast: bool = False, use_kept: bool = False):
        """Begin gathering the full parameters without waiting (a no-op unless sharded): this rank's
        shard (or its param_dtype cast: `_to_send`) into a pooled full buffer, by one Iallgather."""
        if self.full is not None:
            return
        send, checked = self._to_send(keep_cast, use_kept)
        if self._gathers_nothing(send):
            self._move(Gathered.UNSHARDED)
            self.full = send  # the whole cast: one rank's gather would copy it (bench/HISTORY.md)
            if not checked:
                self._check_representable(self.full)
            return
        full = self._take("gathered_params", self.param_dtype)
        try:
            request = self.comm.iall_gather(send, full, unit=self.name, phase=phase)
        except BaseException:  # refused before it started: still sharded, the buffer back
            self._give("gathered_params", full)
            raise
        self._move(Gathered.GATHERING)
        self.full, self._gathering = full, (request, send, checked)

    def _to_send(self, keep_cast: bool, use_kept: bool):
        """(what this gather sends, whether it is checked already): the shard, or its param_dtype cast.

        Mixed precision on a GPU: keep_cast=True (a forward whose backward gathers again, FSDP's
        lifecycle) keeps the param_dtype copy of the shard this gather sends, checked; the next
        gather with use_kept=True sends it instead of casting and checking again (a launch a
        unit). The shard must not change in between: the optimizer steps after the backward. Any
        other gather casts afresh and drops a kept copy, unless the optimizer wrote it with its
        update since (cast_target: it is then the new shard's cast, checked by that kernel)."""
        kept = self.casts.take_kept(use_kept, lambda buf: self._give("gathered_params", buf))
        send, checked = (kept, True) if kept is not None else self._cast_for_gather()
        if keep_cast and send is not self._shard:
            self.casts.keep(send)
        return send, checked

    def _gathers_nothing(self, send) -> bool:
        """Whether the gather of `send` is `send` itself: one rank on a GPU, sending its pooled
        param_dtype cast (no collective is launched; the CPU keeps its one-rank gather, its ledger
        and schedule as at any N)."""
        return self.comm.one_rank and self.casts.one_rank_skips and send is not self._shard

    def _cast_for_gather(self):
        """(what a gather sends: the shard, or its pooled param_dtype cast; whether that cast is
        checked already: a device's kernel checks as it casts, shard/cast.py)."""
        take = lambda numel: self._take("gathered_params", self.param_dtype, numel=numel)  # noqa: E731
        copy = self.casts.cast_checked(self._shard, self.param_dtype, take, self._give_gathered)
        if copy is not None:
            return copy, True
        return self._cast("gathered_params", self._shard, self.param_dtype), False

    def _give_gathered(self, buf):
        self._give("gathered_params", buf)

    def unshard(self, phase: str = "forward", keep_cast: bool = False, use_kept: bool = False) -> dict:
        """Gather the full parameters (or finish a started gather); returns name -> view into `full`."""
        self.start_unshard(phase, keep_cast, use_kept)
        self._finish_gather()
        return self.layout.views(self.full)

    def _finish_gather(self):
        if self._gathering is not None:
            request, send, checked = self._gathering
            self._gathering = None
            self._move(Gathered.UNSHARDED)
            self.comm.wait(request)
            if send is not self._shard:
                if send is not self.casts.kept:
                    self._give("gathered_params", send)
                if not checked:  # a kept cast's values, or one a kernel made, were checked then
                    self._check_representable(self.full)

    def _gather_into(self, full, phase: str):
        """Blocking: `full` = every rank's shard, in param_dtype (a buffer of the caller's)."""
        send = self._cast("gathered_params", self._shard, self.param_dtype)
        try:
            self.comm.all_gather(send, full, unit=self.name, phase=phase)
        finally:
            if send is not self._shard:
                self._give("gathered_params", send)
        if send is not self._shard:
            self._check_representable(full)

    def _check_representable(self, full):
        """Masters cast to a narrower param_dtype overflow to Inf once they outgrow it: every rank sees
        the same gathered values, so every rank raises alike (no collective needed); on a GPU the
        verdict waits on the device for the step's (shard/cast.py)."""
        self.casts.check(full, self)

    def take_overflow_flag(self):
        """(device flag, OVERFLOWED) of the gathers checked since the last call, or None (none checked
        on a device): they overflowed param_dtype if the flag holds OVERFLOWED, and whoever reads it
        so clears it. The optimizer reads every unit's flag at once."""
        return self.casts.take_flag()

    def raise_unrepresentable(self):
        raise FloatingPointError(
            f"unit {self.name!r}: parameter values no longer fit {self.param_dtype} (largest "
            f"|master| {float(abs(self._shard).max()):.3g} here, {self.param_dtype} holds up to "
            f"{float(finfo(self.param_dtype).max):.3g}); lower the lr or the weight scale, or use "
            "a wider param_dtype"
        )

    def reshard(self):
        """Drop the full parameters (idempotent). Views handed out earlier must not be used after."""
        self._finish_gather()  # a buffer MPI is still writing cannot go back to the pool
        if self.full is not None:
            if self.full is not self.casts.kept:  # one rank's kept cast is its full parameters too
                self._give("gathered_params", self.full)
            self.full = None
            self._move(Gathered.SHARDED)

    @contextlib.contextmanager
    def unsharded(self, phase: str = "other", writeback: bool = False):
        """`with unit.unsharded() as params:` the full parameters inside the block, only the shard after.

        The arrays are read-only (an in-place edit would be lost) views of a buffer of their own, not
        of the pool: an array kept after the block keeps the values it had, never another unit's;
        `params` itself refuses access after the block. writeback=True makes them writable and copies
        this rank's slice of the edited values back into its shard at the end (e.g. a projection onto
        constraints; edits that are not bitwise equal on every rank raise on every rank).
        (FSDP's own path, `unshard`, uses the pool.)"""
        if writeback and self.param_dtype != self.layout.dtype:
            raise ValueError(f"unit {self.name!r}: writeback needs param_dtype == the shards' dtype")
        full = self.xp.empty(self.layout.padded_numel, dtype=self.param_dtype)
        self.ledger.alloc("gathered_params", full.nbytes)
        params = None
        try:
            self._gather_into(full, phase)
            views = self.layout.views(full)
            for v in views.values():
                v.flags.writeable = writeback
            params = UnshardedParams(self.name, views)
            yield params
            if writeback:  # ranks that edited differently would keep a mixture of their edits
                require_same_edit(self.name, full, self.comm)
                lo, hi = self.layout.shard_range(self.comm.rank)
                self.shard[...] = full[lo:hi]
        finally:
            if params is not None:
                params.close()
            full.flags.writeable = False  # the buffer is the kept arrays' own now: read-only
            self.ledger.free("gathered_params", full.nbytes)

    # -- gradients ----------------------------------------------------------------------------------
    def holds_full_grad(self) -> bool:
        """Whether a full gradient is held: between zero_full_grad and the reduce-scatter, and across
        backwards while gradient sync is off (the sum of earlier micro-batches)."""
        return self.full_grad is not None

    def zero_full_grad(self, unfilled: bool = False) -> dict:
        """A zeroed flat `full_grad` (idempotent); returns name -> view to accumulate into.
        unfilled=True (a fresh buffer only): just the padding zeroed, the caller writes every view
        before reading it (a fill less: FSDP's backward, see lifecycle.py)."""
        self._require_trainable("accumulate")
        if self.full_grad is None:
            if self._grad_is_whole():
                self.full_grad, self._grad_zeroed_lazily = self._grad, False
                if not unfilled:
                    self.full_grad.fill(0)
            else:
                self.full_grad = self._take("gathered_grads", self.full_grad_dtype, zero=not unfilled)
            if unfilled and self.layout.padded_numel > self.layout.numel:
                self.full_grad[self.layout.numel :] = 0  # [Note: padding]: reduced as zeros
        return self.layout.views(self.full_grad)

    def _grad_is_whole(self) -> bool:
        """Whether the full gradient can be the gradient shard itself: one rank on a GPU (no replicas),
        a shard holding no gradient, all of one dtype. Its reduction is then nothing (one rank's
        reduce-scatter copies, bench/HISTORY.md) and no buffer is taken; the CPU keeps its one-rank
        collectives, ledger and schedule as at any N (shard/cast.py one_rank_skips)."""
        one = self.comm.one_rank and self.replicas is None and self.casts.one_rank_skips
        dtypes = {np.dtype(self.full_grad_dtype), np.dtype(self.reduce_dtype), self._grad.dtype}
        return one and not self.has_grad and len(dtypes) == 1

    def drop_full_grad(self):
        """Discard `full_grad` without reducing it (a backward that failed part-way)."""
        if self.full_grad is self._grad:  # written over a shard that held no gradient: zero again
            self._grad_zeroed_lazily = True
        elif self.full_grad is not None:
            self._give("gathered_grads", self.full_grad)
        self.full_grad = None

    def start_reduce_grad(
        self, grads: dict | None = None, phase: str = "backward", *, weight=None, reduce: str = "mean"
    ):
        """Begin the reduce-scatter of `full_grad` (or of the given name -> array grads).

        reduce="mean": the ranks' gradients averaged with equal weights, or, given `weight` (e.g.
        this rank's number of samples), weighted by it: sum_r (weight_r / sum_s weight_s) * g_r, the
        global mean when each rank's gradient is its own samples' mean. reduce="sum": the plain sum
        over ranks (weighted: sum_r weight_r * g_r). A weight costs one small exchange of every rank's
        weight (see `agreed_weights`); the runtime's own calls give none."""
        self._check_reduce(reduce)
        weights = None if weight is None else self.agreed_weights(weight, phase)
        self._start_reduce(grads, phase, weights, reduce)

    def _check_reduce(self, reduce: str):
        """What both reduce_grad and start_reduce_grad refuse before any exchange."""
        self._require_trainable("reduce")
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")

    def agreed_weights(self, weight, phase: str = "backward") -> list[float] | None:
        """Collective: every rank's weight (None where every rank gave none), checked on every rank.

        One exchange of (weight, problem) pairs, so that a bad weight on one rank (NaN, inf, negative,
        not a number), or a weight on some ranks and none on others (a scalar exchange would pair with
        a reduce-scatter), raises the same ValueError on every rank instead of stalling the others."""
        problem = None
        if weight is not None:  # a number, or a 0-d array (a CuPy count): not a string, not a bool
            number = float(weight) if hasattr(weight, "__float__") and not isinstance(weight, bool) else -1.0
            problem = None if math.isfinite(number) and number >= 0 else f"weight {weight!r}"
            weight = None if problem else number
        everyone = self.comm.allgather_object((weight, problem), phase=phase)
        bad = [f"rank {r}: {why}" for r, (_, why) in enumerate(everyone) if why]
        given = [r for r, (w, why) in enumerate(everyone) if w is not None or why]
        if bad:
            raise ValueError(f"unit {self.name!r}: weight must be a finite number >= 0 ({'; '.join(bad)})")
        if given and len(given) < len(everyone):
            raise ValueError(
                f"unit {self.name!r}: ranks {given} gave a weight and the others none: give every rank "
                "its weight (0 where it had no samples), or none"
            )
        return [w for w, _ in everyone] if given else None

    def _weighted_mean_scale(self, weights: list[float], phase: str) -> float:
        """This rank's weight over the weights' sum (over the replicas too): each gradient is scaled
        before the reduce-scatter, so no weight and no product overflows."""
        try:
            total = math.fsum(weights)
            if self.replicas is not None:
                groups = self.replicas.allgather_object(total, phase=phase)
                total = math.fsum(groups)
        except OverflowError:
            total = math.inf
        if total == 0 or not math.isfinite(total):  # the same sum on every rank: all of them raise
            raise ValueError(
                f"unit {self.name!r}: the weights sum to {total:g} over the ranks: "
                + (
                    "no rank had samples, there is no mean to take; skip this step, or give weights > 0"
                    if total == 0
                    else "scale them down (a count, not a huge number)"
                )
            )
        return weights[self.comm.rank] / total

    def _start_reduce(self, grads, phase: str, weights: list[float] | None, reduce: str):
        if grads is not None:
            self._load_grads(grads)
        elif self.full_grad is None:
            raise RuntimeError(
                f"unit {self.name!r}: reduce_grad() without gradients: pass them, or zero_full_grad() first"
            )
        divisor = self.comm.size * (self.replicas.size if self.replicas else 1) if reduce == "mean" else 1
        scale = None
        if weights is not None:
            scale = self._weighted_mean_scale(weights, phase) if reduce == "mean" else weights[self.comm.rank]
            divisor = 1
        self.finish_reduce_grad()  # at most one reduce-scatter of a unit in flight
        if self.full_grad is self._grad:  # one rank: the sum over ranks is its own gradient, in place
            if scale is not None:
                _scale(self._grad, scale)
            self.full_grad, self.has_grad = None, True
            return
        source = self._cast("gathered_grads", self.full_grad, self.reduce_dtype)
        if source is not self.full_grad:
            self._give("gathered_grads", self.full_grad)
        self.full_grad = None
        # A zero grad_shard (after zero_grad) of the reduce dtype receives the sum directly; otherwise a
        # temporary does, so gradients accumulate across backward calls until zeroed.
        receive = self._grad
        if self.has_grad or self.reduce_dtype != self._grad.dtype:
            receive = self._take("gathered_grads", self.reduce_dtype, numel=self.layout.shard_numel)
        else:
            self._grad_zeroed_lazily = False  # the sum is written over it
        if scale is not None:
            _scale(source, scale)
        request = self.comm.ireduce_scatter(source, receive, unit=self.name, phase=phase)
        self._reducing = _Reduction(request, receive, source, divisor, phase)

    def advance_reduce_grad(self):
        """HSDP: once the reduce-scatter inside the group is done, start the all-reduce of the
        gradient shard across the groups without waiting for it (the sharded model calls this when the
        next unit's reduce-scatter starts, so it overlaps that unit's backward). A no-op otherwise."""
        r = self._reducing
        if r is None or self.replicas is None or r.source is None:
            return
        self.comm.wait(r.request)
        self._give("gathered_grads", r.source)
        r.source = None  # across the groups now: the group's sums, summed over the groups
        r.request = self.replicas.iall_reduce(r.receive, unit=self.name, phase=r.phase, hot=True)

    def finish_reduce_grad(self):
        """Complete a started reduce-scatter and add the mean into grad_shard (no-op if none).

        [Note: gradient averaging] (docs/design.md, invariant 3) Reduce-scatter sums over ranks;
        dividing by N gives the gradient of the global-batch mean when every rank's loss is its share
        of that mean (equal batches; losses that divide by the global count, ops.mean_over_ranks).
        """
        if self._pending_sum is not None:  # deterministic mode's integer sums
            return self._finish_chunk_sum()
        self.advance_reduce_grad()  # HSDP: the reduce-scatter done, the all-reduce across groups started
        r = self._reducing
        if r is None:
            return
        self._reducing = None
        (self.comm if r.source is not None else self.replicas).wait(r.request)
        if r.source is not None:
            self._give("gathered_grads", r.source)
        if r.divisor != 1:
            r.receive /= r.divisor
        if r.receive is not self._grad:
            grad = self.grad_shard  # zeroed first where zero_grad left that to a reader
            grad += r.receive
            self._give("gathered_grads", r.receive)
        self.has_grad = True

    def reduce_grad(self, grads: dict | None = None, phase: str = "backward", *, weight=None, reduce="mean"):
        """Reduce-scatter the gradients now: grad_shard += the mean (or, weighted, the weighted mean;
        or the sum) over ranks, of this rank's slice. See start_reduce_grad. Every rank must give a
        weight, or none: checked on every rank first (`agreed_weights`, one small exchange)."""
        self._check_reduce(reduce)
        self._start_reduce(grads, phase, self.agreed_weights(weight, phase), reduce)
        self.finish_reduce_grad()

    # -- deterministic mode: chunks summed exactly (shard/exact.py) --------------------------------
    def add_chunk_grad(self, grads: dict | None = None, weight: int = 1):
        """Add one chunk's gradient (`full_grad`, or the given name -> arrays) times `weight` to this
        unit's exact sum, and drop it. Local. weight: an integer >= 0 that the same chunk has at any
        N (its count of targets or of samples). reduce_chunk_grads then gives the same bits whichever
        rank added which chunk."""
        if not isinstance(weight, (int, np.integer)) or isinstance(weight, bool) or weight < 0:
            raise ValueError(f"unit {self.name!r}: a chunk's weight is an integer >= 0, got {weight!r}")
        self._require_trainable("accumulate")
        if grads is not None:
            self._load_grads(grads)
        elif self.full_grad is None:
            raise RuntimeError(f"unit {self.name!r}: add_chunk_grad() without gradients: pass them")
        if self._exact is None:
            self._exact = self._exact_sum(self.full_grad.dtype)
        self._exact.add(self.full_grad, int(weight))
        self.drop_full_grad()

    def reduce_chunk_grads(self, phase: str = "backward") -> int:
        """Collective: grad_shard += (sum over every rank's chunks of weight * gradient) / (sum of the
        weights), summed as integers, so the result has the same bits at any world size (and, with
        HSDP, any group shape). Returns the summed weight. No chunk anywhere: nothing changes."""
        self.start_reduce_chunk_grads(phase)
        return self.finish_reduce_grad()

    def start_reduce_chunk_grads(self, phase: str = "backward"):
        """reduce_chunk_grads, started (the levels agreed, the integer reduce-scatters in flight);
        finish_reduce_grad completes it, as it does a started reduce_grad."""
        self._require_trainable("reduce")
        self.finish_reduce_grad()  # one reduction of a unit in flight
        if self._exact is None:  # no chunk here: the dtype the others' chunks have
            self._exact = self._exact_sum(self.full_grad_dtype)
        self._pending_sum = self._exact.start_reduce_scatter(
            self.comm, self.layout.shard_numel, self.replicas, unit=self.name, phase=phase
        )

    def _exact_sum(self, dtype) -> ExactSum:
        """An exact sum whose int64 vectors come from this unit's pool, counted as exact_sums."""
        buffers = (
            lambda n: self._take("exact_sums", np.int64, numel=n),
            lambda v: self._give("exact_sums", v),
        )
        return ExactSum(self.layout.padded_numel, self.xp, dtype, buffers)

    def _finish_chunk_sum(self) -> int:
        pending, self._pending_sum = self._pending_sum, None
        unfilled, self._grad_zeroed_lazily = self._grad_zeroed_lazily, False  # written over: no fill
        weight = pending.add_mean_into(self._grad, unfilled)
        if weight > 0:
            self.has_grad = True
        return weight

    def _load_grads(self, grads: dict):
        views = self.zero_full_grad()
        missing = set(self.layout.names) - set(grads)
        if missing:
            raise KeyError(f"unit {self.name!r}: reduce_grad is missing gradients for {sorted(missing)}")
        for name, g in grads.items():
            if name not in views:
                raise KeyError(f"unit {self.name!r} has no tensor {name!r}")
            if not hasattr(g, "shape"):  # a list, a scalar, None: say so, not an AttributeError
                raise TypeError(
                    f"unit {self.name!r}: gradient {name!r} is {type(g).__name__}, not an array; give an "
                    f"array of shape {views[name].shape} (zeros where the tensor gets no gradient)"
                )
            if tuple(g.shape) != views[name].shape:
                raise ValueError(
                    f"unit {self.name!r}: gradient {name!r} has shape {tuple(g.shape)}, "
                    f"expected {views[name].shape}"
                )
            views[name][...] = g

    # -- the flat-group protocol of optim.AdamW ---------------------------------------------------
    @property
    def numel(self) -> int:
        return self.layout.shard_numel

    def decay_segments(self, decays) -> list[tuple[int, int]]:
        """This shard's ranges of the tensors for which decays(name, shape) is true (AdamW's filter)."""
        return self.layout.decay_segments(self.comm.rank, decays)

    def flat_param(self):
        return self.shard

    def flat_grad(self):
        if self.full_grad is not None:  # an optimizer step now would miss these gradients
            raise RuntimeError(
                f"unit {self.name!r} holds gradients that were never reduced (backward ran with gradient "
                "sync off: no_sync()); run the last micro-batch's backward with sync on before step(), "
                "or zero_grad() to drop them"
            )
        if self._exact is not None and self._exact.chunks:  # the next step would include them
            raise RuntimeError(
                f"unit {self.name!r} holds the gradients of {self._exact.chunks} chunk(s) never reduced (a "
                "chunks() loop left before its last chunk's backward); finish the batch's chunks before "
                "step(), or zero_grad() to drop them"
            )
        return self.grad_shard if self.has_grad else None

    @property
    def grad_shard(self):
        """This rank's slice of the gradient (None for a frozen unit). zero_grad leaves the zeroing to
        the first reader, and a reduce-scatter into a zeroed shard writes over it: a step that
        reduces, steps and zeroes fills nothing (on a GPU, one launch a unit less)."""
        if self._grad_zeroed_lazily:
            self._grad[...] = 0
            self._grad_zeroed_lazily = False
        return self._grad

    def zero_grad(self):
        """Forget every gradient: the shard's, a full one kept unreduced (no_sync) and chunks added but
        not reduced (deterministic mode)."""
        self.drop_full_grad()
        if self._exact is not None:
            self._exact.release()
        self._exact = None
        self._grad_zeroed_lazily = self.trainable
        self.has_grad = False

    # -- a CUDA graph's replays (fsdp/graphed.py) ----------------------------------------------------
    # what a pass reads and leaves on the host: a graph replays one pass's launches with no Python, so
    # it is right only from the state it was captured in, and must leave the host as that pass did
    # (and its casts' fields: shard/cast.py HostCasts.FIELDS)
    HOST_STATE = tuple(
        "has_grad _grad_zeroed_lazily _shard _grad full gathered full_grad _gathering _reducing _exact "
        "_pending_sum".split()
    )

    def cast_afresh(self):
        """The next gather casts the shard again rather than send a cast an optimizer wrote: a graph
        captured so casts at every replay, whatever was written in between."""
        self.casts.afresh()

    def host_state(self) -> dict:
        """The HOST_STATE fields and the casts' by name (arrays by identity: a graph reads and writes
        fixed addresses)."""
        return {name: getattr(self, name) for name in self.HOST_STATE} | self.casts.fields()

    def restore_host_state(self, state: dict):
        own = {name: value for name, value in state.items() if name in self.HOST_STATE}
        for name, value in own.items():
            setattr(self, name, value)
        self.casts.restore({name: value for name, value in state.items() if name not in own})

    # -- consolidation (tests, export) ------------------------------------------------------------
    def gather(self, shard_like) -> dict:
        """Full name -> array of any shard-shaped vector (parameters, grads, moments): a new buffer."""
        if self.comm.stands_in:  # the other ranks' slices would be stand-ins, returned as values
            raise ValueError(
                f"unit {self.name!r}: {self.comm!r} stands in for its peers, so a gathered vector would hold "
                "stand-ins in their slices: read this rank's own (unit.shard, its slice of the layout)"
            )
        full = self.xp.empty(self.layout.padded_numel, dtype=shard_like.dtype)
        self.comm.all_gather(shard_like, full, unit=self.name, phase="other")
        return self.layout.views(full)


def gathered_params(units) -> dict:
    """Host copies of every parameter of `units`, by tensor name (collective: call on every rank).

    Full arrays of their own, not views into a buffer that is reused; tensor names must be unique
    across the units."""
    out, owner = {}, {}
    for unit in units:
        for name, value in unit.gather(unit.shard).items():
            if name in out:
                raise ValueError(
                    f"tensor {name!r} is in units {owner[name]!r} and {unit.name!r}: name them uniquely"
                )
            out[name], owner[name] = to_numpy(value).copy(), unit.name
    return out


def _scale(gradient, weight: float):
    """gradient *= weight, where a weight of 0 (a rank without samples) contributes zeros: its
    gradient of nothing may hold a NaN (a mean over no rows), and 0 * NaN would make every rank's NaN."""
    if weight == 0:
        gradient.fill(0)
    else:
        gradient *= weight
