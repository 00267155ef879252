"""A sharded model's forward and backward replayed from one CUDA graph: GraphedPasses.

Why: Python issues a GPU step's hundreds of launches one call at a time, more host work a step than
the 370M model's whole step on the device (bench/gpu_budget.py host_ms_per_step; bench/HISTORY.md).
A graph issues the passes' launches, collectives included, as one.

    graphed = mpifsdp.GraphedPasses(model, passes)  # passes(*batch): forward and backward
    for x, y in batches:
        loss = graphed(x, y)  # what passes returned, holding this batch's values
        scaler.step(opt, max_norm=1.0)
        opt.zero_grad()

The first call runs `passes` eagerly on static device copies of the batch: every kernel is built and
checked and every lazy buffer allocated (a capture can neither compile-and-check nor read back). The
second runs them eagerly once more as a reference, captures them on a stream of their own (allocating
from a private memory pool, so nothing outside the graph ever lands where its intermediates live),
replays the graph and compares the replay with the reference: a value the capture froze that should
change shows there, and the call raises, naming what differs. Later calls copy the batch into the
static inputs and replay. After a replay the host is put where the eager passes leave it: each unit's
gradient and gather state, the input checks read with the step's verdict (base/deferred.py), the
collectives in the schedule and ledger (Comm.replayed), the request the optimizer's verdict waits for
(Comm.await_current).

Given the optimizer (`optimizer=`, with `scaler=` and `max_norm=` where the loop used them), the
graph holds the whole step: after the passes, the gradient norm, its sum over the ranks, the step's
verdict (skip, clip, the loss scale, the step counts), the loss scale's device copies and AdamW's
update are kernels in it (optim/device_step.py DeviceStep, cuda/step.py). The first call then runs
the step eagerly too; the capture's self-check replays once dry (the update skipped, nothing moved)
and compares the outputs and each gradient's sum of squares (the update scales the gradients), then
replays the step itself; each later call first reads the last step's verdict (one host sync: the
optimizer's and the scaler's counts mirrored, a stop raised), gives the device what the host
changed (the lr, a setting, a restored count), and replays.

    graphed = mpifsdp.GraphedPasses(model, passes, optimizer=opt, scaler=scaler, max_norm=1.0)
    for x, y in batches:
        loss = graphed(x, y)  # forward, backward and the step; no zero_grad
    graphed.settle()  # the last step's verdict, before a checkpoint

Refused by name: a model not on a GPU, collectives not over NCCL (MPI runs on the host: nothing a
graph can hold), deterministic mode (its exact sums agree a scale over MPI), dropout > 0 (the mask's
seed is the host's, frozen in a graph), no_sync. HSDP is captured too (its all-reduce across groups
runs on NCCL: Comm.iall_reduce hands device memory to the transport). A whole step: an optimizer
other than AdamW, or one that does not step exactly the model's trainable units.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..autodiff.tensor import Tensor
from ..base import backend, deferred
from ..base.backend import host_value
from ..base.checks import finfo
from ..cuda import cublas_api, sdpa
from ..nn.layers import Dropout
from ..optim.device_step import DeviceStep
from .build import sharded_model


class GraphedPasses:
    """A forward and backward of `model` replayed from one CUDA graph: `passes(*batch)` runs them and
    returns what the caller reads (a loss Tensor, a tuple of them, or None). The first call runs
    eagerly; the second captures, checking the replay against an eager reference pass; later calls
    copy the batch into the graph's inputs and replay. Every batch must have the first call's shapes
    and dtypes, and the optimizer's zero_grad() must run between calls. With `optimizer` (an AdamW
    of the model; `scaler`, a LossScaler; `max_norm`, the clip) the graph holds the optimizer's step
    as well, and the calls need no step and no zero_grad (settle() reads the last step's verdict
    now). Needs a GPU model whose collectives run over NCCL (docs/design.md, "CUDA graphs")."""

    def __init__(self, model, passes, *, optimizer=None, scaler=None, max_norm=None):
        self._sharded = sharded_model(model)
        self._step = None if optimizer is None else DeviceStep(optimizer, scaler, max_norm)
        problem = _refusal(model, self._sharded) or _step_refusal(self._sharded, self._step, scaler, max_norm)
        if problem:
            raise ValueError(f"GraphedPasses: {problem}")
        self._passes = passes
        self._static: list | None = None  # the batch as the graph reads it: device arrays, or frozen values
        self._graph = self._outputs = None
        self._before = self._after = None  # the units' host state a replay starts from, and leaves
        self._checks: list = []  # the input checks the captured forward deferred
        self._collectives: list = []  # per communicator, the device collectives in the graph
        self._kept: tuple = ()  # what the graph addresses that nothing else keeps: its pool, its stream, ...
        self.replays = 0  # the calls served from the graph (the capture's own check not counted)

    def __call__(self, *batch):
        if self._static is None:
            self._static = [_static_copy(value, self._sharded.units[0].xp) for value in batch]
            outputs = self._passes(*self._static)
            if self._step is not None:  # the step eagerly: its kernels built and checked, its state made
                self._step.eager()
            return outputs
        _check_like(batch, self._static)
        if self._graph is None:
            _copy_into(self._static, batch)
            return self._capture()
        return self._replay(batch)

    def settle(self) -> dict | None:
        """A whole-step graph's last step read now (it is read before the next replay anyway): the
        optimizer's and the scaler's counts and scale brought up to date (before a checkpoint, at the
        end of training), and what that step found raised. Returns its state (optim/device_step.py
        PLACES: norm, scale, factor, ...); None where nothing is left to read."""
        return None if self._step is None else self._step.settle()

    def pool_bytes(self) -> int:
        """Device bytes the graph's private pool holds (its passes' activations and temporaries),
        held for the graph's lifetime; 0 before the capture."""
        return self._kept[0].total_bytes() if self._kept else 0

    # -- the second call: capture ---------------------------------------------------------------------
    def _capture(self):
        """Run the passes eagerly (the reference), capture them, replay once and compare; a whole
        step's graph is compared in a dry replay (its update skipped, nothing moved), then run."""
        sharded, step = self._sharded, self._step
        _require_zeroed(sharded)
        for unit in sharded.units:  # the graph casts each shard for its gathers at every replay
            unit.cast_afresh()
        self._before = _host_state(sharded)
        reference = _values(self._passes(*self._static), sharded, grads=step is None)
        if step is not None:  # each gradient's sum of squares (a bad batch raises here); the state made
            reference.append(step.reference())
            step.prepare()
        _restore(sharded, self._before)  # as before the reference: the capture takes the same path
        self._record()
        self._launch(dry=step is not None)
        try:
            replayed = _values(self._outputs, sharded, grads=step is None)
            if step is not None:  # each gradient's sum (host values): an overflowed step's inf is inf
                last = len(reference) - 1
                reference[-1], sums = _finite_parts(last, reference[-1], step.checked_sums())
                replayed.append(sums)
            elements = max(getattr(a, "size", 1) for a in self._static)
            _compare(reference, replayed, _bound(elements, sharded.units))
        except RuntimeError:
            self._graph = None  # nothing updated: a later call captures again
            raise
        if step is not None:  # checked: now the step itself, its collectives counted again
            step.arm()
            for comm, collectives in zip(sharded.levels(), self._collectives):
                comm.replayed(collectives)
            self._launch()
        backend.free_cached_blocks()  # the eager passes' activations: the graph's own are in its pool
        return self._outputs

    def _record(self):
        """Capture the passes into self._graph, on a stream of their own, from a private pool."""
        xp = self._sharded.units[0].xp
        pool, stream = xp.cuda.MemoryPool(), backend.new_stream()
        with stream:  # cuBLAS's workspace for the stream, from the default pool, before it captures
            cublas_api.bind_current_stream()
        mark = deferred.mark()
        with contextlib.ExitStack() as inside:
            noted = [inside.enter_context(comm.capturing()) for comm in self._sharded.levels()]
            inside.enter_context(xp.cuda.using_allocator(pool.malloc))
            inside.enter_context(stream)
            stream.begin_capture()
            try:
                outputs = self._passes(*self._static)
                fill = self._step.queue(self._sharded.replicas) if self._step is not None else None
            except Exception as exc:
                raise RuntimeError(f"GraphedPasses: {_why(exc)}") from exc
            finally:
                graph = stream.end_capture()  # (a pass that raised leaves no graph to replay)
        if fill is not None:  # the step's tables: where the capture put the gradients
            fill()
        self._graph, self._outputs = graph, outputs
        self._after, self._checks = _host_state(self._sharded), deferred.since(mark)
        self._collectives, self._kept = noted, (pool, stream, sdpa.workspace())

    def _launch(self, dry: bool = False):
        """Replay the graph on the current stream; the optimizer's verdict waits for it. A whole
        step's graph leaves the gradients used: the host's side zeroed as zero_grad() would (dry:
        the capture's check, whose state is not the next settle's to read)."""
        self._graph.launch(backend.current_stream())
        _restore(self._sharded, self._after)
        if self._step is not None:
            self._step.optimizer.zero_grad()
            if not dry:
                self._step.launched()
        for comm in self._sharded.levels():
            comm.await_current()

    # -- later calls: replay --------------------------------------------------------------------------
    def _replay(self, batch):
        sharded = self._sharded
        if self._step is not None:  # the last step's verdict (the one host sync a step), then what
            self._step.settle()  # the host changed since (the lr, a setting, a restored count)
            self._step.sync_host()
        _require_state(sharded, self._before)
        # every rank at the same collective before the graph's (the batch's checks are in the graph)
        sharded.comm.check_schedule(phase="forward", when="before a CUDA graph's replay")
        _copy_into(self._static, batch)
        for comm, collectives in zip(sharded.levels(), self._collectives):
            comm.replayed(collectives)
        self._launch()
        self.replays += 1
        _defer_again(self._checks)
        return self._outputs


def _refusal(model, sharded) -> str | None:
    """Why this model's passes cannot be captured, or None."""
    if sharded is None:
        return f"needs a model fully_shard() was called on, got a {type(model).__name__}"
    if sharded.units[0].xp is np:
        return "CUDA graphs need a GPU: this model's shards are NumPy arrays (Comm(device='cuda'))"
    for comm in sharded.levels():
        if not comm.transport.device_ordered:
            return (
                f"collectives over {comm.transport.name!r} run through MPI on the host, which no CUDA graph "
                "can hold: use Comm(device='cuda', transport='nccl')"
            )
    if sharded.deterministic:
        return "deterministic mode agrees its fixed-point scale over MPI on the host, chunk by chunk"
    dropouts = [name or "model" for name, m in model.named_modules() if isinstance(m, Dropout) and m.p > 0]
    if dropouts:
        return (
            f"dropout {dropouts[0]!r} draws each mask from a seed the host computes per call: a graph would "
            "replay the captured mask at every step (train with dropout 0, or without the graph)"
        )
    if not sharded.requires_gradient_sync:
        return "no_sync() keeps gradients unreduced across backward passes: capture with gradient sync on"
    return None


def _step_refusal(sharded, step, scaler, max_norm) -> str | None:
    """Why the optimizer's step cannot join the graph, or None (None too without an optimizer)."""
    if step is None:
        return None if scaler is None and max_norm is None else "scaler and max_norm need optimizer= too"
    return step.refusal(sharded.trainable_units)


def _why(exc) -> str:
    """What a capture that raised met, and what to do."""
    said = f"the passes raised while captured ({type(exc).__name__}: {exc}"
    if isinstance(exc, NotImplementedError) and "cuBLAS" in str(exc):
        return (
            f"{said}). CuPy's matmul cannot be captured: attention runs batched GEMMs through it where "
            "cuDNN's fused attention does not (float32, no cuDNN, a shape it refuses). Give the model "
            "float16 or bfloat16 param_dtype with cuDNN, or run the passes without a graph"
        )
    return (
        f"{said}). Inside a CUDA graph nothing may read the device from the host (float(), .item(), a "
        "NumPy copy) or copy host arrays in: read the loss from what passes returns, after the call"
    )


def _static_copy(value, xp):
    """A batch argument as the graph reads it: an array's device copy, any other value frozen."""
    if not hasattr(value, "shape"):
        return value
    return backend.copy_to(xp, value)


def _check_like(batch, static):
    """Refuse a batch the graph was not captured for, naming the argument."""
    if len(batch) != len(static):
        raise TypeError(f"GraphedPasses: {len(batch)} arguments, the graph was captured with {len(static)}")
    for i, (value, fixed) in enumerate(zip(batch, static)):
        if hasattr(fixed, "shape"):
            if getattr(value, "shape", None) != fixed.shape or getattr(value, "dtype", None) != fixed.dtype:
                raise ValueError(
                    f"GraphedPasses: argument {i} is {_describe(value)}, the graph was captured with "
                    f"{_describe(fixed)}: a graph's shapes are fixed (pad the batch to that shape, or "
                    "build another GraphedPasses for this one)"
                )
        elif value is not fixed and value != fixed:
            raise ValueError(
                f"GraphedPasses: argument {i} is {value!r}, the graph was captured with {fixed!r}: "
                "values that are not arrays are frozen in it"
            )


def _describe(value) -> str:
    if hasattr(value, "shape"):
        return f"a {tuple(value.shape)} {value.dtype} array"
    return repr(value)


def _copy_into(static, batch):
    for fixed, value in zip(static, batch):
        if hasattr(fixed, "shape") and value is not fixed:
            backend.write_into(fixed, value)


# -- the host's side of a pass ------------------------------------------------------------------------
# the units' arrays a graph reads and writes by address, and their fields that hold a pass under way
_ADDRESSES = ("_shard", "_grad", "_overflow")
_UNDER_WAY = ("full", "full_grad", "_gathering", "_reducing", "_exact", "_pending_sum")


def _host_state(sharded) -> tuple:
    """The host's side of the pass a graph holds: each unit's fields, the buffer pool's lists, the
    bytes the memory ledger counts as held."""
    return [unit.host_state() for unit in sharded.units], sharded.pool.state(), sharded.ledger.held()


def _restore(sharded, state: tuple):
    """Put the host where the pass left it (or, before a capture, where it began): whatever eager
    pass ran between replays (an evaluation) leaves nothing the graph's buffers collide with."""
    units, pool, held = state
    for unit, fields in zip(sharded.units, units):
        unit.restore_host_state(fields)
    sharded.pool.restore(pool)
    sharded.ledger.restore_held(held)


def _defer_again(checks: list):
    """The input checks the captured pass deferred, pending again: their flags hold the replay's
    verdicts, read with the step's (or the loss's)."""
    for check in checks:
        deferred.defer(*check)


def _require_zeroed(sharded):
    """Refuse a pass the graph's backward would get wrong: it writes reduced gradients, never adds."""
    if not sharded.requires_gradient_sync:
        raise RuntimeError(
            "GraphedPasses: called inside no_sync(): a graph's backward reduce-scatters its gradients at "
            "every replay (gradient accumulation is not captured)"
        )
    for unit in sharded.units:
        if unit.has_grad or unit.full_grad is not None:
            raise RuntimeError(
                f"GraphedPasses: unit {unit.name!r} holds gradients: call the optimizer's zero_grad() "
                "after each step (a replayed backward writes the gradients, it does not add to them)"
            )


def _require_state(sharded, captured: tuple):
    """Refuse a replay the graph cannot run: gradients not zeroed, a pass under way, or a unit's
    arrays replaced since the capture (the graph would write into the old ones)."""
    _require_zeroed(sharded)
    for unit, fields in zip(sharded.units, captured[0]):
        now = unit.host_state()
        if any(now[name] is not None for name in _UNDER_WAY):
            raise RuntimeError(f"GraphedPasses: a pass of unit {unit.name!r} is still under way")
        if any(now[name] is not fields[name] for name in _ADDRESSES):
            raise RuntimeError(
                f"GraphedPasses: unit {unit.name!r}'s arrays were replaced since the capture (a checkpoint "
                "loaded into the model?): build a new GraphedPasses"
            )


# -- the self-check -----------------------------------------------------------------------------------
def _values(outputs, sharded, grads: bool = True) -> list:
    """Copies of what a pass produced: its outputs' values, then every unit's gradient shard (a
    whole step's graph scales them in its update: each one's sum of squares is compared instead)."""
    tensors = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    arrays = [t.data for t in tensors if isinstance(t, Tensor)]
    arrays += [unit.flat_grad() for unit in sharded.trainable_units] if grads else []
    return [None if a is None else a.copy() for a in arrays]


def _bound(elements: int, units) -> float:
    """How far, relative to its largest value, a replayed value may differ from the eager pass's. The
    same kernels on the same inputs differ only where atomic adds reorder a float32 sum: at most
    elements * float32's eps (an embedding's gradient rows: one term per batch element). cuDNN's
    attention backward accumulates so too, and a reordered sum then rounded to a 16-bit type can
    round the other way: one eps of that type, which flows on into every gradient computed from it,
    at most once per unit on its path (a bfloat16 24-layer GPT's last unit: bench/HISTORY.md). A
    value the capture froze that should have changed is off by far more."""
    computed_in = max(float(finfo(unit.param_dtype).eps) for unit in units)
    return elements * float(np.finfo(np.float32).eps) + len(units) * computed_in


def _compare(reference: list, replayed: list, bound: float):
    """Raise unless the replay computed what the eager passes did, within `bound` (_bound)."""
    for i, (want, got) in enumerate(zip(reference, replayed)):
        if (want is None) != (got is None):
            raise RuntimeError(f"CUDA graph self-check: value {i} is None in one of replay and eager pass")
        if want is None:
            continue
        want, got = (a.astype(np.float64) for a in (want, got))
        scale = host_value(abs(want).max(), "the graph self-check") if want.size else 0.0
        error = host_value(abs(got - want).max(), "the graph self-check") if want.size else 0.0
        if not error <= bound * max(scale, np.finfo(np.float64).tiny):
            raise RuntimeError(
                f"CUDA graph self-check: the replayed passes differ from the eager ones in value {i} (the "
                f"outputs, then each unit's gradient shard or a whole step's sums): max error {error:.3g} "
                f"against {scale:.3g}, bound {bound:.2g} relative. A value the capture froze changes "
                "between steps: train without the graph, and report this"
            )


def _finite_parts(i: int, want, got) -> tuple:
    """want and got with the values neither holds finite set to 0, once both hold the same there
    (an overflowed step's sums: inf where eager found inf, NaN where it found NaN)."""
    odd = ~(np.isfinite(want) & np.isfinite(got))
    if not np.array_equal(want[odd], got[odd], equal_nan=True):
        raise RuntimeError(
            f"CUDA graph self-check: value {i} is not finite in one of replay and eager pass where the other "
            "is: train without the graph, and report this"
        )
    return np.where(odd, 0.0, want), np.where(odd, 0.0, got)


__all__ = ["GraphedPasses"]
