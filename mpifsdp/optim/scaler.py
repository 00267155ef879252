"""Dynamic loss scaling for float16 compute (mixed precision, fsdp.fully_shard(param_dtype=...))."""

from __future__ import annotations

import logging
import math

import numpy as np

from ..autodiff.tensor import Tensor
from ..base.logs import job_warning
from .flat_optimizer import clip_scale
from .optimizers import FlatOptimizer, NonFiniteError

log = logging.getLogger(__name__)


def raise_found_first(optimizer):
    """Before a step that overflowed is skipped: what its checks found (a bad device batch, a master
    param_dtype cannot hold: often the overflow's cause) raised, as the optimizer's own step would.
    A skip would forget it with the step's gradients, and halve the scale for nothing."""
    verdict = getattr(optimizer, "verdict", None)
    if verdict is not None:
        verdict.settle()


def overflow_error(scale: float, in_a_row: int, in_all: int) -> NonFiniteError:
    """The error of an overflow the scale cannot step past (at its floor, or too many in a row)."""
    return NonFiniteError(
        f"the gradients overflow at loss scale {scale:g} ({in_a_row} steps in a row, {in_all} in all): the "
        "loss or the model itself is not finite in this precision; lower the lr, or compute in float32 "
        "or bfloat16"
    )


class LossScaler:
    """Dynamic loss scaling for float16 compute: scale the loss, unscale the gradients, skip overflows.

        scaler.scale(loss).backward()
        scaler.step(opt, max_norm=1.0)   # False when the step overflowed and was skipped
        opt.zero_grad()

    A step whose gradients overflow (a global check: every rank agrees) is skipped and the scale
    halved; after `growth_interval` good steps in a row the scale doubles. Skipping cannot go on
    unnoticed: `max_skips_in_a_row` overflowing steps in a row, or an overflow at `min_scale` (where
    halving cannot help), raise NonFiniteError on every rank.
    """

    def __init__(
        self,
        init_scale: float = 2.0**15,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        max_skips_in_a_row: int = 20,
    ):
        if not (0 < min_scale <= init_scale < math.inf) or growth_interval < 1 or max_skips_in_a_row < 1:
            raise ValueError(
                "LossScaler needs 0 < min_scale <= init_scale (finite), growth_interval >= 1 and "
                f"max_skips_in_a_row >= 1; got min_scale={min_scale}, init_scale={init_scale}, "
                f"growth_interval={growth_interval}, max_skips_in_a_row={max_skips_in_a_row}"
            )
        self._scale_arrays: dict = {}  # (module, dtype) -> the scale as a 0-d array of that dtype
        self.held_by = None  # a CUDA graph's DeviceStep that moves the scale (optim/device_step.py)
        self.scale_value = float(init_scale)
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.max_skips_in_a_row = max_skips_in_a_row
        self.good_steps = 0
        self.skipped_steps = 0
        self.skips_in_a_row = 0
        self.last_grad_norm = math.nan  # the last step's global norm, unscaled (what clipping saw)

    STATE = ("scale_value", "good_steps", "skipped_steps", "skips_in_a_row")  # what state_dict() holds

    def state_dict(self) -> dict:
        """What a resumed run needs to go on as an uninterrupted one would: the scale and its counts
        (plain numbers: a checkpoint's `extra`; a graph's last step read first)."""
        if self.held_by is not None:
            self.held_by.settle()
        return {key: getattr(self, key) for key in self.STATE}

    def load_state_dict(self, state: dict):
        """Take a state_dict(); a missing or unknown key is refused by name."""
        if set(state) != set(self.STATE):
            raise ValueError(
                f"LossScaler.load_state_dict: expected the keys {sorted(self.STATE)}, got {sorted(state)}"
            )
        for key in self.STATE:  # each as the type it has (the scale's setter refreshes its device copies)
            setattr(self, key, type(getattr(self, key))(state[key]))

    def device_scales(self) -> list:
        """The scale's device copies made so far (what a graph's step writes the new scale into)."""
        return [a for (module, _), a in self._scale_arrays.items() if module != np.__name__]

    def take(self, state: dict):
        """The scale and counts a graph's step left on the device (optim/device_step.py), taken as
        they are: its device copies hold the scale already."""
        self._scale = float(state["scale"])
        self.good_steps, self.skips_in_a_row = int(state["good"]), int(state["skips_in_a_row"])
        self.skipped_steps, self.last_grad_norm = int(state["skipped"]), float(state["norm"])

    def scale(self, loss):
        """loss * the scale, a 0-d array of the loss's type on its device (as a Python number would
        be made), rewritten whenever scale_value is set: the multiply takes nothing from the host
        that changes by step, so a captured forward and backward replay with the scale of the day."""
        if not isinstance(loss, Tensor):  # an array or a number of the caller's own
            return loss * self.scale_value
        return loss * Tensor(self._scale_array(loss.xp, loss.dtype))

    def _scale_array(self, xp, dtype):
        """The scale as a 0-d array of `dtype` in xp (one per module and dtype, made at its first
        use; the scale_value setter keeps it current)."""
        key = (xp.__name__, np.dtype(dtype))
        if key not in self._scale_arrays:
            self._scale_arrays[key] = xp.full((), self.scale_value, dtype=key[1])
        return self._scale_arrays[key]

    @property
    def scale_value(self) -> float:
        return self._scale

    @scale_value.setter
    def scale_value(self, value: float):
        """A new scale: its device copies rewritten at once, before the next forward (a replayed one
        included, which does not call scale())."""
        self._scale = float(value)
        for array in self._scale_arrays.values():
            array.fill(self._scale)

    def step(self, optimizer: FlatOptimizer, max_norm: float | None = None) -> bool:
        """Unscale, check, clip (max_norm) and step. Where the optimizer folds a gradient scale into
        its update (AdamW on a GPU), the unscale and the clip travel as one factor into it: the
        norm is the scaled gradients' over the scale, and no pass over the gradients is added."""
        getattr(optimizer, "refuse_if_held", lambda: None)()  # a graph takes the steps
        folded = getattr(optimizer, "folds_grad_scale", lambda: False)()  # an optimizer of one's own: no
        if not folded:
            optimizer.scale_grads(1.0 / self.scale_value)
        norm = optimizer.grad_norm() / (self.scale_value if folded else 1.0)
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            raise_found_first(optimizer)
            if self.scale_value <= self.min_scale or self.skips_in_a_row + 1 >= self.max_skips_in_a_row:
                raise overflow_error(self.scale_value, self.skips_in_a_row + 1, self.skipped_steps + 1)
            self.skipped_steps += 1
            self.skips_in_a_row += 1
            self.good_steps = 0
            self.scale_value = max(self.min_scale, self.scale_value / 2)
            group = getattr(optimizer, "comm", None)  # the norm's ranks: all skip this step
            job_warning(group, log, "loss scale overflow: skipped the step, scale now %g", self.scale_value)
            return False
        self.skips_in_a_row = 0
        factor = 1.0 / self.scale_value if folded else 1.0
        if max_norm is not None and folded:
            factor *= clip_scale(max_norm, norm)
        elif max_norm is not None:
            optimizer.clip_grad_norm(max_norm, norm=norm)
        optimizer.set_grad_norm(norm)  # one global norm a step
        if folded:
            optimizer.step(grad_scale=factor)
        else:
            optimizer.step()
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale_value *= 2
        return True
