"""UnitLifecycle: one unit's part of a training step, as an explicit state machine.

A unit module's forward runs inside `run_forward`; its part of backward runs between `pre_backward`
and `post_backward`, which the autodiff engine calls through the lifecycle's scope (tape.py). The Unit
(unit.py) only gathers and frees; this adds what a step needs around that: binding the gathered views
to the module's Params, pointing their .grad at the flat gradient, and the stage it is at:

    IDLE --run_forward--> FORWARD --(no grad)------------------------------------------> IDLE
                             |
                             +--(with grad)--> AWAITING_BACKWARD --pre_backward--> BACKWARD
                                                                                      |
    IDLE <------------------------------------------------------------post_backward---+

A forward may run again while AWAITING_BACKWARD (a unit used twice, a second forward before
backward); backward may reach a unit that is IDLE (a second backward through an older forward's
graph). Any other move is a bug in the runtime and raises; after an exception cut a pass short (a VJP
that raised), `abandon` is the way back to IDLE. What concerns all units at once (prefetch
order, reduce-scatters in flight, the end of a pass) is the ShardedModel's (model.py): the lifecycle
asks it to prefetch after itself, tells it the order it ran in, and hands it its reduce-scatter.
"""

from __future__ import annotations

import enum
import functools

from ..autodiff.recompute import recompute
from ..autodiff.tape import grad_enabled, scope
from ..autodiff.tensor import implementation_on
from ..nn.layers import draws_replay


class Stage(enum.Enum):
    IDLE = "idle"  # between passes: only the shard (or kept gathered: reshard_after_forward=False)
    FORWARD = "forward"  # gathered, its module's forward running
    AWAITING_BACKWARD = "awaiting backward"  # its forward ran with grad; backward has not reached it
    BACKWARD = "backward"  # gathered, its gradients accumulating into the flat full_grad


MOVES = {
    Stage.IDLE: {Stage.FORWARD, Stage.BACKWARD},
    Stage.FORWARD: {Stage.IDLE, Stage.AWAITING_BACKWARD},
    Stage.AWAITING_BACKWARD: {Stage.FORWARD, Stage.BACKWARD},
    Stage.BACKWARD: {Stage.IDLE},
}


class UnitLifecycle:
    """The Units of one module bound to its Params, moved through one step's stages.

    A module's parameters form one Unit, or two when it mixes trainable and frozen ones (fully_shard
    splits them: a flat vector is reduce-scattered whole, so a frozen tensor inside a trainable unit
    would be reduced and stepped): `unit` is the trainable one (the frozen one when every parameter is
    frozen), `frozen` the other or None. Both are gathered for forward and backward; only the
    trainable one accumulates and reduces gradients.
    """

    def __init__(
        self,
        unit,
        params,
        sharded_model,
        reshard_after_forward: bool,
        recomputes: bool = False,
        frozen=None,
    ):
        self.unit = unit
        self.params = params  # [(name in the unit, Param)]
        # frozen: (Unit, params) of the module's frozen parameters beside `unit`, or None
        self._parts = ((unit, params),) + ((frozen,) if frozen else ())
        self.units = tuple(u for u, _ in self._parts)
        self.reshard_after_forward = reshard_after_forward
        self.recomputes = recomputes  # keep only the input; backward re-runs the forward (recompute.py)
        self.stage = Stage.IDLE
        self._grads_ahead = False  # its gradient bound before its backward began (bind_grads_ahead)
        self._model = sharded_model
        self._absent = (
            f"its unit {unit.name!r} is sharded (its full values exist only inside that unit's forward "
            "and backward). Call it through the module that owns it, or wrap the code in "
            "`with unit.unsharded():`."
        )

    def __repr__(self):
        return f"UnitLifecycle({self.unit.name!r}, {self.stage.value}, {self.unit.state})"

    def _move(self, stage: Stage):
        if stage not in MOVES[self.stage]:
            raise RuntimeError(
                f"unit {self.unit.name!r} cannot go from {self.stage.value} to {stage.value} "
                "(mpifsdp's step order was broken: please report it with the traceback)"
            )
        self.stage = stage

    def _gather_and_bind(self, phase: str):
        keep, kept = casts_kept(phase, self.reshard_after_forward)
        for unit, params in self._parts:
            views = unit.unshard(phase, keep_cast=keep, use_kept=kept)
            for name, p in params:
                p.data = views[name]

    def _reshard(self):
        for unit in self.units:
            unit.reshard()

    def release(self):
        """Params without data until the next bind: a use outside forward and backward names the unit."""
        for _, params in self._parts:
            for _, p in params:
                p.release(self._absent)

    # -- forward ----------------------------------------------------------------------------------
    def run_forward(self, forward, *args, **kwargs):
        """The module's forward, with the unit gathered around it (Module's forward wrapper)."""
        with_grad = grad_enabled()
        awaits = with_grad or self.stage is Stage.AWAITING_BACKWARD
        self._move(Stage.FORWARD)
        self._gather_and_bind("forward")
        self._model.prefetch_after(self, "forward")
        try:
            with scope(self):
                if self.recomputes and with_grad:
                    run = functools.partial(forward, **kwargs)
                    return recompute(run, *args, replay=draws_replay(forward.__self__))
                return forward(*args, **kwargs)
        finally:
            self.release()
            if self.reshard_after_forward or not with_grad:
                self._reshard()
            self._model.ran(self)
            self._move(Stage.AWAITING_BACKWARD if awaits else Stage.IDLE)

    # -- backward (the engine calls these through the scope) --------------------------------------
    def pre_backward(self):
        self._move(Stage.BACKWARD)
        self._check_frozen_unchanged()
        self._gather_and_bind("backward")
        if self.unit.trainable and not self._grads_ahead:
            self._bind_grads()
        self._grads_ahead = False
        self._model.prefetch_after(self, "backward")

    def _bind_grads(self):
        fresh = not self.unit.holds_full_grad()  # else no_sync kept earlier micro-batches' sum
        grads = self.unit.zero_full_grad(unfilled=fresh)  # a fresh one: the first gradient is written
        for name, p in self.params:
            p.grad = grads[name]  # VJPs accumulate in place into the flat full_grad
            p.grad_is_zero = fresh  # until something adds: a VJP may write there instead
            p.grad_unfilled = fresh

    def bind_grads_ahead(self):
        """On a GPU, bind a fresh zeroed gradient to this unit (its backward comes next) while the
        unit before it in backward still runs: the last VJP there to use this unit's output (the next
        block's LayerNorm) then writes the column sums it forms into this unit's output bias gradient
        (tape.SumsWritten), a reduction launch less. One unit's gradient more is alive meanwhile."""
        ready = self.unit.trainable and _sums_cross_units(self.unit) and not self.unit.holds_full_grad()
        if ready and self.stage is Stage.AWAITING_BACKWARD:
            self._bind_grads()
            self._grads_ahead = True

    def _check_frozen_unchanged(self):
        """fully_shard decided from requires_grad which parameters are reduced and stepped."""
        changed = [
            p.name for unit, params in self._parts for _, p in params if p.requires_grad != unit.trainable
        ]
        if changed:
            raise RuntimeError(
                f"requires_grad of {changed} changed after fully_shard, which decided from it what is "
                "reduced and stepped: freeze or unfreeze parameters before fully_shard"
            )

    def post_backward(self):
        """Reduce-scatter the unit's gradient into its shard, or, while the sharded model's gradient
        sync is off (no_sync: accumulation over micro-batches), keep the full gradient for the next
        backward to add to; the backward with sync on reduces the sum."""
        self._move(Stage.IDLE)
        self._zero_unreached_grads()
        for _, p in self.params:
            p.grad, p.grad_is_zero, p.grad_unfilled = None, False, False
        self.release()
        if self.unit.trainable and self._model.deterministic:  # the chunk added to the exact sum
            self.unit.add_chunk_grad(weight=self._model.chunk_state.weight or 0)
            if self._model.requires_gradient_sync:
                self.unit.start_reduce_chunk_grads()
                self._model.reducing(self.unit)
        elif self.unit.trainable and self._model.requires_gradient_sync:
            self.unit.start_reduce_grad(phase="backward")
            self._model.reducing(self.unit)
        self._reshard()

    def _zero_unreached_grads(self):
        """A parameter this backward never reached (a head computed and not used) has a zero
        gradient; where the buffer was left unfilled, that is written now (a launch for it alone)."""
        for _, p in self.params:
            if p.grad_unfilled:
                p.grad[...] = 0

    def abandon(self):
        """Back to IDLE from a pass an exception cut short: parameters released, gathered buffers
        freed (after any gather in flight finished), and a gradient this backward had half-written
        dropped (a full gradient kept by no_sync from earlier micro-batches stays otherwise). The
        ranks' schedules are then compared at the next forward's start, as always."""
        for _, p in self.params:
            p.grad, p.grad_is_zero, p.grad_unfilled = None, False, False
        self.release()
        if self.stage is Stage.BACKWARD or self._grads_ahead:
            self.unit.drop_full_grad()
        self._grads_ahead = False
        self._reshard()
        self.stage = Stage.IDLE


def casts_kept(phase: str, reshard_after_forward: bool) -> tuple[bool, bool]:
    """(keep_cast, use_kept) of a unit's gather in `phase` (Unit.start_unshard): a forward with
    gradients whose unit is gathered again for backward keeps its param_dtype cast; that backward
    sends it, and keeps it for the optimizer to write the updated shard's cast into
    (Unit.cast_target: the next forward's gather sends that)."""
    forward_kept = phase == "forward" and grad_enabled() and reshard_after_forward
    return (forward_kept or phase == "backward", phase == "backward")


def _sums_cross_units(unit) -> bool:
    """Whether the LayerNorm that opens a unit's output's next use, on this unit's device, writes its
    gradient's column sums into the bias gradient of that output's producer (tape.SumsWritten: a
    GPU's implementation does; the reference does not)."""
    return implementation_on("layer_norm", unit.device).gives_column_sums
