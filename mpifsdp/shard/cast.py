"""How a unit's gathers cast its shard to param_dtype and check the cast: one object per unit, chosen
by the shard's device when the unit is made (`casts_for`), so the Unit's own code has no device branch.

The CPU's (HostCasts): a gather casts the shard where param_dtype differs and checks the gathered
values at once, raising on every rank alike (they all see the same values); nothing is kept or
deferred, and a one-rank gather and reduce-scatter still run (their ledger and schedule as at any N).

A GPU's (DeviceCasts) holds the state a host sync per gather would otherwise cost: one kernel casts
the shard and flags an overflow in a device int32 (read with the step's verdict: optim/verdict.py),
a forward's checked cast is kept for its backward's gather, the optimizer's update kernel may write
the next one (target, written), one rank sends its cast as its full parameters and reduces nothing,
and 16-bit parameters' gradients are gathered in float32 (the GEMMs write it at no cost).
"""

from __future__ import annotations

import numpy as np

from ..base import kernels

# What a device check writes into a unit's overflow flag: a constant, so no launch of a forward or a
# backward takes a value from the host that changes by step (a CUDA graph would replay it stale);
# the verdict that finds a flag set clears it (optim/verdict.py StepVerdict).
OVERFLOWED = 1


class HostCasts:
    """The CPU's casts: made and checked at each gather, nothing kept."""

    one_rank_skips = False  # one rank's gather and reduce-scatter are skipped (sent as they are)
    computes_bfloat16 = False  # NumPy has no bfloat16 arithmetic of its own

    # The fields a CUDA graph's replay restores (Unit.HOST_STATE): the device's state, None here.
    FIELDS = ("_overflow", "_checked", "_cast_current", "_kept_cast")

    def __init__(self):
        self._overflow = None  # a device int32 a gather that overflows param_dtype sets to OVERFLOWED
        self._checked = False  # a gather was checked since the verdict last took the flag
        self._kept_cast = None  # the checked param_dtype shard a forward's gather kept
        self._cast_current = False  # the kept cast is the shard's, written by the optimizer

    def grad_dtype(self, param_dtype):
        """What the full gradient is gathered in: param_dtype."""
        return np.dtype(param_dtype)

    def cast_checked(self, shard, param_dtype, take, give):
        """(the shard's cast, checked) made by a kernel that also checks it, or None: the unit casts."""
        return None

    def check(self, full, unit):
        """The gathered values checked: an overflow of param_dtype raises (the same on every rank)."""
        if not bool(np.isfinite(full).all()):
            unit.raise_unrepresentable()

    def take_kept(self, use_kept: bool, give):
        """The cast a forward's gather kept, to send instead of casting again; None (none kept)."""
        return None

    def keep(self, send):
        """Keep the cast this gather sends for the next one (use_kept)."""

    @property
    def kept(self):
        return self._kept_cast

    def target(self):
        """(buffer, device flag, OVERFLOWED): where an optimizer's update kernel may write the next
        gather's cast; None here."""
        return None

    def written(self):
        """The optimizer wrote the updated shard's cast into target()'s buffer and flagged it."""
        self._cast_current = self._checked = True

    def afresh(self):
        """The next gather casts the shard again: the shard was handed out, or a graph captures."""
        self._cast_current = False

    def take_flag(self):
        """(device flag, OVERFLOWED) of the gathers checked since the last call, or None."""
        if not self._checked:
            return None
        self._checked = False
        return self._overflow, OVERFLOWED

    def fields(self) -> dict:
        return {name: getattr(self, name) for name in self.FIELDS}

    def restore(self, fields: dict):
        for name, value in fields.items():
            setattr(self, name, value)


class DeviceCasts(HostCasts):
    """A GPU's casts: a kernel casts and flags, a forward's cast is kept, the optimizer writes the next."""

    one_rank_skips = True
    computes_bfloat16 = True

    def __init__(self, xp):
        super().__init__()
        self.xp = xp

    def grad_dtype(self, param_dtype):
        """float32 for 16-bit parameters: the VJPs' GEMMs (cuBLAS gemmEx) and kernels write float32
        there at no cost, so the gradient needs no cast launch before a float32 reduce-scatter (and
        no 16-bit rounding, nor a float16 sum across micro-batches); a 16-bit reduce_dtype is cast
        to once, there."""
        if np.dtype(param_dtype).itemsize == 2:
            return np.dtype(kernels.accumulator(param_dtype))
        return np.dtype(param_dtype)

    def flag(self):
        """The one-element int32 device flag this unit's checks set to OVERFLOWED."""
        if self._overflow is None:
            self._overflow = self.xp.zeros(1, dtype=np.int32)
        return self._overflow

    def cast_checked(self, shard, param_dtype, take, give):
        """One kernel casts float32 masters and sets the overflow flag: this rank's shard checked,
        not the gathered whole (each rank checks its own; the optimizer's verdict brings the ranks'
        flags together)."""
        if shard.dtype == param_dtype:
            return None
        copy = take(shard.size)
        if kernels.cast_flag_nonfinite(shard, copy, self.flag(), OVERFLOWED):
            self._checked = True
            return copy
        give(copy)  # no kernel: the unit casts, and checks once gathered
        return None

    def check(self, full, unit):
        """The verdict stays on the device until the step's (take_flag): a host sync per gather would
        stall the host's queue 49 times a step. One int32 flag, set by one kernel per gather."""
        flag = self.flag()
        if not kernels.flag_nonfinite(full, flag, OVERFLOWED):
            bad = ~self.xp.isfinite(full).all()
            flag[...] = self.xp.where(bad, OVERFLOWED, flag)
        self._checked = True

    def take_kept(self, use_kept: bool, give):
        """The kept cast where use_kept or the optimizer wrote it since (written); a stale one given
        back (None then)."""
        kept, self._kept_cast = self._kept_cast, None
        if kept is not None and not (use_kept or self._cast_current):
            give(kept)
            kept, self._cast_current = None, False
        return kept

    def keep(self, send):
        self._kept_cast = send

    def target(self):
        if self._kept_cast is None:
            return None
        return self._kept_cast, self.flag(), OVERFLOWED


def casts_for(xp) -> HostCasts:
    """The casts of a unit whose shard lives in xp's arrays: the one place a unit's device is asked."""
    return HostCasts() if xp is np else DeviceCasts(xp)
