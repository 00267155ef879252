"""The whole step on the device, for a CUDA graph that holds it (fsdp/graphed.py): DeviceStep.

Why: a graph of the forward and backward alone leaves the optimizer's step to the host, and that
step reads the gradient norm before it can decide anything (a host sync a step, the GPU idle while
Python decides, then the step's launches one by one). Here the decision moves to the device: the
norm's sums, their sum over the ranks, the verdict (finite? clip? the loss scale's skip, halving and
growth; a failed input check or gather cast), the step counts and AdamW's hyperparameters (the lr
from a device buffer the host writes when it changes, the bias corrections from each group's step)
are kernels the graph replays, and AdamW's update reads its row and a skip flag from them.

The host reads the state once a step, one step late (`settle`, before the next replay: the GPU
has finished by then or nearly), mirrors it into the optimizer and the scaler (step counts, scale,
skips: what checkpoints save) and raises what eager training would have raised, on every rank. Late
costs nothing: a step that must stop (a failed check, a norm not finite with nonfinite="raise", the
scale's overflow limits) notes the stop on the device and its own update does not run; the host
raises at its next read and refuses every call after it, so the parameters stay those before the
bad step, as eagerly.

The state is one float64 vector, PLACES by name (the kernels' S_* defines), then each stepped
group's step before the graph's first (its own bias corrections, as FlatOptimizer keeps them).
"""

from __future__ import annotations

import logging
import math

import numpy as np

from ..base import backend
from ..base.logs import job_warning
from .device import on_device
from .flat_optimizer import NonFiniteError, clip_scale
from .optimizers import AdamW
from .verdict import _verdict_arrays

log = logging.getLogger(__name__)

PLACES = (
    "scale",  # the loss scale (1 without a scaler)
    "good",  # the scaler's good steps in a row
    "skips_in_a_row",
    "skipped",  # skipped steps: the scaler's, or the optimizer's without one
    "taken",  # updates since the capture
    "norm",  # this step's global gradient norm (unscaled)
    "factor",  # what the gradients were multiplied by (unscale and clip)
    "stop",  # STOPS: why the job must stop (0: it goes on)
    "lr",
    "max_norm",  # 0: no clipping
    "growth",
    "min_scale",
    "max_skips",
    "scaled",  # 1 with a LossScaler
    "raise",  # 1: a norm not finite stops the job (nonfinite="raise", no scaler)
    "beta1",
    "beta2",
    "eps",
    "weight_decay",
    "groups",  # the first group's step before the graph; one place a group from here
)
STOPS = ("none", "refused", "nonfinite", "scale")  # the kernels' STOP_* by their place here


class DeviceStep:
    """An AdamW step (with a LossScaler and clipping where given) decided and run on the device by
    the kernels a graph replays (module docstring): `queue` inside the capture, `fill` after it,
    `settle` once a step before the next replay, `write_lr` where the lr changed."""

    def __init__(self, optimizer, scaler=None, max_norm=None):
        self.optimizer, self.scaler, self.max_norm = optimizer, scaler, max_norm
        if max_norm is not None:
            clip_scale(max_norm, 0.0)  # refused here where it is not a finite number > 0
        self.kernels = None  # the device's (optim/device.py "whole_step"), once prepared
        self.state = self.stepped = None  # the device state vector; the groups the graph steps
        self._read = None  # (steps, skipped) as the host last mirrored them
        self._base = None  # the host's counts at the capture: (step_count, group steps)
        self._checks = ([], [])  # the overflow flags and input checks the captured step reads
        self._tables = None  # the kernels' tables (ready before the capture, written after it)
        self._flags = []  # the checks' flags stacked, as the graph leaves them
        self._lr = None  # the lr last written to the device
        self._pending = False  # a replay queued whose state the host has not read
        self._stopped = None  # what a step that stopped the job raised: every later call refused

    def refusal(self, units) -> str | None:
        """Why this optimizer's step cannot be held in a graph, or None."""
        opt = self.optimizer
        if type(opt)._update is not AdamW._update or not opt.folds_grad_scale():
            return f"the whole step runs AdamW's update kernel; {type(opt).__name__} has its own update"
        if [id(g) for g in opt.groups] != [id(u) for u in units]:
            return "the optimizer must step exactly the model's trainable units: AdamW(model)"
        if on_device("whole_step", opt.groups[0].flat_param()) is None:
            return "this device has no kernels for the step's verdict"
        return None

    def eager(self):
        """The step as eager training runs it (the graph's first call: every kernel built and checked,
        the moments allocated), then zero_grad."""
        opt, scaler = self.optimizer, self.scaler
        if scaler is not None:
            scaler.step(opt, max_norm=self.max_norm)
        else:
            if self.max_norm is not None:
                opt.clip_grad_norm(self.max_norm)
            opt.step()
        opt.zero_grad()

    def reference_norm(self) -> float:
        """The eager norm of the gradients the reference passes left, unscaled (what the device's
        verdict must find for the same passes); the reference's checks settled (a bad batch raises
        here, before any capture)."""
        opt = self.optimizer
        norm = opt.grad_norm("the gradient norm of a graph's reference pass")
        opt.verdict.settle()
        return norm / (self.scaler.scale_value if self.scaler is not None else 1.0)

    def prepare(self):
        """Before the capture: the state vector on the device, from the host's counts and settings."""
        opt, xp = self.optimizer, self.optimizer.groups[0].xp
        self.stepped = [i for i, group in enumerate(opt.groups) if group.flat_grad() is not None]
        for i in self.stepped:  # the moments (zeros until a first update) where the graph addresses them
            opt._state_at(i, allocate=True)
        self.kernels = on_device("whole_step", opt.groups[0].flat_param())()
        self._tables = self.kernels.ready(self._updates())
        self.state = xp.asarray(self._initial_state())
        self._base = (opt.step_count, [opt._steps[i] for i in self.stepped])
        self._read = (0, self._skipped_now())
        self._lr = opt.lr

    def _initial_state(self) -> np.ndarray:
        opt, scaler = self.optimizer, self.scaler
        values = dict(
            scale=scaler.scale_value if scaler else 1.0,
            good=scaler.good_steps if scaler else 0,
            skips_in_a_row=scaler.skips_in_a_row if scaler else 0,
            skipped=self._skipped_now(),
            lr=opt.lr,
            max_norm=self.max_norm or 0.0,
            growth=scaler.growth_interval if scaler else 1,
            min_scale=scaler.min_scale if scaler else 1.0,
            max_skips=scaler.max_skips_in_a_row if scaler else 1,
            scaled=float(scaler is not None),
            beta1=opt.beta1,
            beta2=opt.beta2,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            **{"raise": float(opt.nonfinite == "raise")},
        )
        state = np.zeros(len(PLACES) - 1 + len(self.stepped), dtype=np.float64)
        for name, value in values.items():
            state[PLACES.index(name)] = value
        state[PLACES.index("groups") :] = [opt._steps[i] for i in self.stepped]
        return state

    def _skipped_now(self) -> int:
        return (self.scaler or self.optimizer).skipped_steps

    def queue(self):
        """Inside the capture, after the passes: the step's checks taken (the graph writes their
        flags), then the norm, its sum over the ranks, the verdict, the scale's device copies and the
        update queued. Returns fill(): the kernels' tables written once the capture knows where the
        gradients live."""
        opt = self.optimizer
        self._checks = flags, checks = opt.verdict._pending()
        self._flags = _verdict_arrays(flags, checks)  # stacked in the graph: each replay's, read as they are
        scales = list(self.scaler._scale_arrays.values()) if self.scaler is not None else []
        return self.kernels.queue(self._tables, self.state, self._updates(), flags, checks, opt.comm, scales)

    def _updates(self) -> list:
        """(p, g, m, v, decay segments) of each group the graph steps, as they are now."""
        opt = self.optimizer
        return [
            (g.flat_param(), g.flat_grad(), *(opt._state_at(i, False)[k] for k in opt.STATE), opt.decayed(i))
            for i, g in ((i, opt.groups[i]) for i in self.stepped)
        ]

    def write_lr(self):
        """The optimizer's lr into the device state where it changed (one small copy, before a
        replay): the graph's updates read it there."""
        lr = self.optimizer.lr
        if lr == self._lr:
            return
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(
                f"{type(self.optimizer).__name__}.lr is {lr}: it must be a finite number >= 0 (check the "
                "lr schedule)"
            )
        place = PLACES.index("lr")
        backend.write_into(self.state[place : place + 1], np.array([lr]))
        self._lr = lr

    def launched(self):
        """A replay was queued: the next settle reads its state."""
        self._pending = True

    def settle(self) -> dict | None:
        """Read the last replayed step's state (one host sync, with its checks' flags), mirror it into
        the optimizer and the scaler, and raise what eager training would have raised, on every rank.
        Returns the state by PLACES' names; None where no replay was queued since the last read."""
        self._refuse_if_stopped()
        if not self._pending:
            return None
        self._pending = False
        flags, checks = self._checks
        read = self.optimizer.comm.read([self.state, *self._flags], "a graphed step's verdict")
        state = dict(zip(PLACES[:-1], read[0][: len(PLACES) - 1]))
        self._mirror(state, read[0][len(PLACES) - 1 :])
        stop = STOPS[int(state["stop"])]
        if stop != "none":
            try:
                self._stop(stop, state, flags, checks, read[1:])
            except Exception as exc:
                self._stopped = f"{type(exc).__name__}: {exc}"
                raise
        return state

    def _refuse_if_stopped(self):
        """After a step that stopped the job (its error raised once), every call: the graph would
        update on from parameters the stop meant to keep."""
        if self._stopped is not None:
            raise RuntimeError(
                f"GraphedPasses: this job stopped at an earlier step ({self._stopped}); nothing was updated "
                "since. Resume from the last checkpoint"
            )

    def _mirror(self, state: dict, group_steps):
        """The host's counts as the device left them (what checkpoints and reports read)."""
        opt, scaler = self.optimizer, self.scaler
        taken, skipped = int(state["taken"]), int(state["skipped"])
        opt.step_count = self._base[0] + taken
        for i, steps in zip(self.stepped, group_steps):
            opt._steps[i] = int(steps) + taken
        if scaler is not None:
            scaler._scale = float(state["scale"])  # the device copies hold it already
            scaler.good_steps, scaler.skips_in_a_row = int(state["good"]), int(state["skips_in_a_row"])
            scaler.skipped_steps, scaler.last_grad_norm = skipped, float(state["norm"])
        else:
            opt.skipped_steps = skipped
        for _ in range(skipped - self._read[1]):  # the skips since the last read, said as eagerly
            job_warning(opt.comm, log, "skipped a step: gradient norm %s (read a step late)", state["norm"])
        self._read = (taken, skipped)

    def _stop(self, stop: str, state: dict, flags, checks, read):
        """Raise, on every rank, the error of the step that stopped (its update did not run)."""
        verdict = self.optimizer.verdict
        if stop == "refused":
            verdict._note(flags, checks, read)
            overflowed, failed = verdict.agreed(verdict.overflowed, verdict.input_failed)
            verdict.forget()
            if failed is not None:
                failed()
            if overflowed is not None:
                overflowed.raise_unrepresentable()
            raise RuntimeError("a graphed step's check failed on another rank: every rank stops here")
        step = self._base[0] + int(state["taken"]) + 1
        if stop == "nonfinite":
            raise NonFiniteError(
                f"the gradient norm is {state['norm']} at step {step}: a NaN or Inf reached the gradients "
                "(on at least one rank); the graph's update did not run. "
                f"{type(self.optimizer).__name__}(nonfinite='skip') drops such steps instead."
            )
        raise NonFiniteError(
            f"the gradients overflow at loss scale {state['scale']:g} ({int(state['skips_in_a_row']) + 1} "
            f"steps in a row, {int(state['skipped']) + 1} in all): the loss or the model itself is not "
            "finite in this precision; lower the lr, or compute in float32 or bfloat16"
        )


__all__ = ["PLACES", "STOPS", "DeviceStep"]
