"""The step's verdict: the checks a step defers on a device, and their one read.

On a GPU nothing a step checks is read back when it is made: a gather's cast flags an overflow of
param_dtype in a device flag (shard/unit.py), a device batch's input check leaves a device boolean
(base/deferred.py), and a collective the device waits for completes in its own time. The optimizer's
step reads them all at once, with the gradient norm where it reads that (one host sync: the step's
verdict), and the ranks then agree on what was found, since each rank checked only its own shard and
batch. On the CPU every check raised when it was made, and there is nothing to read.
"""

from __future__ import annotations

import numpy as np

from ..base import deferred
from ..base.backend import array_module_of, host_values


class StepVerdict:
    """What this step's device checks found, read once (`read_with`, `settle`) and raised on every
    rank (`settle`); forgotten with the step's gradients (`forget`)."""

    def __init__(self, groups: list, comm):
        self.groups, self.comm = groups, comm
        self.forget()

    def forget(self):
        self.overflowed = None  # the first group whose gather overflowed param_dtype
        self.input_failed = None  # a device batch's failed input check: raises when called
        self.flags_read = False  # something was read: the ranks' findings must agree

    def read_with(self, extra: list, purpose: str) -> list:
        """`extra` (small device arrays: the gradient norm's sums) read on the host together with the
        pending checks, in one read; their values returned, the checks' noted."""
        flags, checks = self.take_pending()
        read = self._read([*extra, *verdict_arrays(flags, checks)], purpose)
        self.note(flags, checks, read[len(extra) :])
        return read[: len(extra)]

    def settle(self):
        """The step's device checks: the collectives waited for on the device completed (under the
        watchdog), the pending checks read (where read_with did not), the ranks agreed, and what was
        found raised, on every rank alike."""
        if self.comm is not None and hasattr(self.comm, "settle"):
            self.comm.settle()
        flags, checks = self.take_pending()
        if flags or checks:
            self.note(flags, checks, self._read(verdict_arrays(flags, checks), "the step's verdict"))
        self.raise_found(agree=self.flags_read)

    def raise_found(self, agree: bool = True):
        """Raise what the read found, on every rank alike (agree: the ranks exchange their findings
        first, a collective every rank makes), and forget it."""
        overflowed, failed = self.overflowed, self.input_failed
        self.forget()  # taken: an exchange that fails below leaves nothing stale for the next step
        if agree:
            overflowed, failed = self.agreed(overflowed, failed)
        if failed is not None:
            failed()
        if overflowed is not None:
            overflowed.raise_unrepresentable()

    def agreed(self, overflowed, failed):
        """(the first group any rank's flags named, the input check to raise) (collective): a GPU's
        gathers check each rank's own shard as they cast it, and a device batch is checked on its
        rank, so one rank may hold the overflow or the bad batch the others must raise too."""
        if self.comm is None or self.comm.size == 1:
            return overflowed, failed
        mine = len(self.groups) if overflowed is None else self.groups.index(overflowed)
        everyone = self.comm.gather_ints(
            mine, int(failed is not None), phase="optimizer", op="overflow_verdict"
        )
        first, bad = int(everyone[:, 0].min()), [r for r, hit in enumerate(everyone[:, 1]) if hit]
        if bad and failed is None:
            failed = lambda: _refuse_batch_of(bad)  # noqa: E731
        return (self.groups[first] if first < len(self.groups) else None), failed

    def take_pending(self) -> tuple[list, list]:
        """((group, (device flag, token)) of each group whose gathers were checked on a device, the
        deferred input checks), taken: each is read once."""
        flags = [(group, getattr(group, "take_overflow_flag", lambda: None)()) for group in self.groups]
        return [(group, taken) for group, taken in flags if taken is not None], deferred.take()

    def note(self, flags: list, checks: list, read: list):
        """What the read found of the overflow flags and the deferred input checks."""
        if flags:
            self._note_overflow(flags, read[0])
        if checks:
            self.flags_read = True
            self.input_failed = self.input_failed or deferred.first_failure(checks, read[-1])

    def _note_overflow(self, flags: list, values):
        """The first group whose flag holds its token (its gathers overflowed) is raised at settle;
        the flags found set are cleared (a launch each, on an overflow only), so the next gathers'
        checks start afresh."""
        self.flags_read = True
        hit = [
            (group, flag)
            for (group, (flag, token)), value in zip(flags, values)
            if int(np.ravel(value)[0]) == token
        ]
        for _, flag in hit:
            flag.fill(0)
        if hit and self.overflowed is None:
            self.overflowed = hit[0][0]

    def _read(self, arrays: list, purpose: str) -> list:
        """Small device arrays' values on the host: through the comm in one host sync that also settles
        its collectives, under the watchdog (Comm.read); without one, a read each."""
        if self.comm is not None and hasattr(self.comm, "read"):
            return self.comm.read(arrays, purpose)
        return [host_values(a, purpose) for a in arrays]


def verdict_arrays(flags: list, checks: list) -> list:
    """What the step's verdict reads besides the norm: the groups' overflow flags, the deferred
    input checks' flags (base/deferred.py), each stacked, where there are any."""
    return ([_stacked(flags)] if flags else []) + ([deferred.stacked(checks)] if checks else [])


def _stacked(flags: list):
    """The groups' device flags side by side: one copy, read with the step's verdict."""
    return array_module_of(flags[0][1][0]).stack([flag for _, (flag, _) in flags])


def _refuse_batch_of(ranks: list):
    raise ValueError(
        f"the batch of rank(s) {ranks} failed an input check on the device (their own errors name the "
        "value): every rank stops here"
    )
