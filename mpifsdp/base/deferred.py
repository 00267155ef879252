"""Input checks a GPU answers later: a batch already on the device is checked there, and the verdict
travels with the next value the host reads anyway (the optimizer's step verdict, a loss), instead
of a host sync of its own in the forward (five a step with a device batch before). A check that
failed raises its own error then, naming the bad value; until then the device's indexing wraps, so
nothing outside an array is touched.
"""

from __future__ import annotations

import numpy as np

from .backend import array_module_of, host_values

LIMIT = 64  # checks pending at most: past it they are read at once (a forward-only loop reads nothing)
LATER = " (the batch was on the device: checked there, and read with the step's verdict or a loss)"
_pending: list = []  # (0-d device bool: the check failed, its error's type, its message())


def defer(failed, error: type, message):
    """Check later: `failed` a 0-d device bool; error(message()) is raised once it is read True
    (message() may read the device for the details: it runs only for a failed check)."""
    _pending.append((failed, error, message))
    if len(_pending) > LIMIT:
        raise_failed(*read_pending(host_values))


def check(failed, error: type, message):
    """Raise error(message()) where `failed` holds: at once for a host value, at the next read for
    a device one (defer)."""
    found = problem(failed, error, message)
    if found is not None:
        raise error(found)


def problem(failed, error: type, message) -> str | None:
    """message() where the host value `failed` holds, else None; a device value's check deferred
    (None now: error(message()) is raised at the next read)."""
    if array_module_of(failed) is not np:
        defer(failed, error, message)
        return None
    return message() if failed else None


def mark() -> int:
    """Where the pending checks stand now: since(mark()) later gives the checks deferred in between."""
    return len(_pending)


def since(position: int) -> list:
    """The checks deferred since mark() gave `position` (still pending: a captured pass's, which a
    graph's replays defer again)."""
    return list(_pending[position:])


def take() -> list:
    """The pending checks, taken: whoever takes them reads their flags (stacked) and raises the
    first failure, or hands it on (FlatOptimizer: every rank learns of it)."""
    taken = list(_pending)
    _pending.clear()
    return taken


def stacked(checks: list):
    """The checks' flags as one device array (one read for all)."""
    return array_module_of(checks[0][0]).stack([failed for failed, *_ in checks])


def read_pending(read) -> tuple[list, object]:
    """(the pending checks, their flags' values on the host) through read(array, purpose)."""
    checks = take()
    return checks, (read(stacked(checks), "an input check") if checks else [])


def first_failure(checks: list, values):
    """A function raising the first failed check's error, or None."""
    for (_, error, message), value in zip(checks, values):
        if bool(value):
            return lambda: _raise(error, message)
    return None


def raise_failed(checks: list, values):
    """Raise the first failed check's error, if any."""
    fail = first_failure(checks, values)
    if fail is not None:
        fail()


def _raise(error: type, message):
    raise error(message() + LATER)


__all__ = [
    "check",
    "defer",
    "first_failure",
    "mark",
    "raise_failed",
    "read_pending",
    "since",
    "stacked",
    "take",
]
