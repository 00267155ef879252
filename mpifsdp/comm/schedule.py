"""Hang-proofing for collectives: fingerprints, the schedule checks, a watchdog.

[Note: same collectives everywhere] (docs/design.md, invariant 5) Comm announces every collective
here first with its fingerprint (sequence number, unit, phase, op, element count, dtype), folded into
a rolling hash. Every collective but the hot path (a unit's gathers and reductions in forward and
backward) has its fingerprint compared across ranks before it runs; the hot path is covered by the
hash, compared (with the sequence number) at the start of every forward (with the batch-size check),
the start and end of every backward and in every optimizer step, with one tiny nonblocking
allgather (Comm.check_schedule); debug mode (MPIFSDP_DEBUG=1 or Comm(debug=True)) compares the hot
path's fingerprints too. A mismatch raises ScheduleError on every rank naming what each rank was
about to do. Every wait is watched: a collective that does not complete within the timeout
(MPIFSDP_TIMEOUT seconds, default 300) reports where this rank is stuck, and the roll call of
presence.py says which ranks wait where and which did not answer, then the job is aborted, so
`mpiexec` exits non-zero instead of hanging. While it waits, a rank also learns there that another
rank has left the job (presence.py) and ends it at once.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import deque

from ..base.checks import env_flag, env_seconds
from . import presence

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 300.0
# A wait tests without sleeping this long first: a sleep costs many times a small collective whose
# ranks arrive together (bench/HISTORY.md).
SPIN_S = 2e-4
_OP_WORDS = {
    "all_gather": "gather",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
    "gather_ints": "exchange of integers",
    "batch_size_check": "batch-size check",
    "barrier": "barrier",
    "broadcast": "broadcast",
    "allgather_object": "exchange of objects",
    "valid_target_count": "count of valid targets",
    "schedule_check": "schedule check",
    "split": "split of the communicator",
}


class ScheduleError(RuntimeError):
    """Ranks were about to issue different collectives (a hang or a silent wrong answer otherwise)."""


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the watchdog's timeout."""


def describe(fp) -> str:
    seq, unit, phase, op, count, dtype = fp
    if op in ("all_gather", "reduce_scatter"):
        where = f" of unit '{unit}'" if unit else ""
    else:
        where = f" of {unit}" if unit else ""  # what a scalar reduction or a broadcast carries
    return f"{phase} {_OP_WORDS.get(op, op)}{where} ({count} x {dtype}, collective #{seq})"


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    """str(dtype), cached: NumPy builds the name anew on every call (once per collective)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def digest(*parts) -> int:
    raw = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") & (2**62 - 1)


class Schedule:
    """This rank's record of the collectives it issued: fingerprints, rolling hash, the watchdog.

    It issues no collective itself: Comm exchanges the (position, hash) pairs it produces and hands
    the other ranks' recent fingerprints back to `mismatch` for the report."""

    def __init__(
        self,
        rank: int,
        abort,
        debug: bool | None = None,
        timeout: float | None = None,
        abort_on_timeout: bool = True,
        mpi_error=(),
    ):
        self.rank = rank
        self._abort = abort  # ends the job (MPI_Abort) when the watchdog fires
        self._mpi_error = mpi_error  # the MPI binding's exception class (Comm passes it)
        if debug not in (None, True, False):  # a string such as "no" would be truthy
            raise ValueError(f"Comm(debug={debug!r}): give True, False, or None (MPIFSDP_DEBUG decides)")
        self.debug = env_flag("MPIFSDP_DEBUG") if debug is None else debug
        if timeout is None:
            timeout = env_seconds("MPIFSDP_TIMEOUT", DEFAULT_TIMEOUT, "the watchdog's timeout")
        self.timeout = timeout
        if not (isinstance(self.timeout, (int, float)) and 0 < self.timeout < math.inf):
            raise ValueError(f"Comm(timeout={timeout!r}): give the watchdog's timeout in seconds, > 0")
        self.abort_on_timeout = abort_on_timeout
        self.seq = 0
        self.hash = 0
        self.recent: deque = deque(maxlen=6)
        self.current = None  # the fingerprint of the collective in flight, for the watchdog's report

    def announce(self, unit: str, phase: str, op: str, count: int, dtype) -> tuple:
        """Record the next collective; returns its fingerprint."""
        fp = (self.seq, unit, phase, op, int(count), _dtype_name(dtype))
        self.seq += 1
        self.hash = digest(self.hash, fp)
        self.recent.append(fp)
        self.current = fp
        return fp

    def position(self) -> tuple[int, int]:
        """(collectives issued so far, rolling hash of their fingerprints): equal on every rank."""
        return self.seq, self.hash

    def resume_from(self, seq: int, hash_: int):
        """Continue counting from another rank's position (after a mismatch every rank has reported)."""
        self.seq, self.hash = seq, hash_

    def recent_steps(self) -> list[str]:
        return [describe(fp) for fp in self.recent]

    @staticmethod
    def mismatch(reports: list[list[str]], when: str) -> ScheduleError:
        """The error every rank raises, from every rank's `recent_steps()`."""
        lines = "\n".join(f"  rank {r}: {' -> '.join(steps[-3:])}" for r, steps in enumerate(reports))
        return ScheduleError(
            f"ranks disagree on the sequence of collectives ({when}); "
            f"each rank's last collectives:\n{lines}\n"
            "Every rank must run the same units in the same order: look for data-dependent branches, "
            "uneven batches, or sets iterated in different orders."
        )

    def wait(self, request, current=None):
        """Request.Wait() under the watchdog: polls with Test so a stall can be reported. current:
        the fingerprint of the collective waited for, when it is not the latest announced (Comm.settle)."""
        if current is not None:
            latest, self.current = self.current, current
            try:
                return self.wait(request)
            finally:
                self.current = latest
        presence.waiting_in(self.where)  # the Comm a report names: this one, the latest to wait
        if self._test(request):
            return
        start = time.monotonic()
        deadline, spin_until = start + self.timeout, start + SPIN_S
        delay = 2e-5
        while not self._test(request):
            if time.monotonic() < spin_until:  # the other ranks are usually microseconds behind
                continue
            if time.monotonic() > deadline:
                self._stalled()
            presence.check(request)  # a rank that left, or a roll call
            time.sleep(delay)
            delay = min(2 * delay, 2e-4)

    def _test(self, request) -> bool:
        """request.Test(), with an MPI error in it said in our words. Ranks in different collectives
        make MPICH wait (the watchdog then reports) but Open MPI fail at once, with MPI_ERR_TRUNCATE
        when the sizes differ: the same mistake, so the same ScheduleError."""
        try:
            return request.Test()
        except self._mpi_error as exc:
            where, history = self._whereabouts()
            raise ScheduleError(
                f"rank {self.rank}: MPI failed in {where} ({exc}); before it: {history}. The ranks are most "
                "likely in different collectives (one ran a forward, backward or reduction the others did "
                "not); MPIFSDP_DEBUG=1 names the first collective where they differ."
            ) from exc

    def where(self) -> str:
        """The collective this rank is in (or its last one), in words."""
        return self._whereabouts()[0]

    def _whereabouts(self) -> tuple[str, str]:
        """The collective this rank is in, and the three before it, for a report."""
        where = describe(self.current) if self.current else "a collective"
        return where, "; ".join(describe(fp) for fp in list(self.recent)[:-1][-3:]) or "none"

    def _stalled(self):
        where, history = self._whereabouts()
        message = (
            f"mpifsdp watchdog: rank {self.rank} waited {self.timeout:.1f} s in {where}. "
            f"Before it: {history}. {presence.roll_call()} "
            "Raise MPIFSDP_TIMEOUT if a collective can legitimately take this long."
        )
        if not self.abort_on_timeout:
            raise CollectiveTimeout(message)
        presence.report_and_abort(message, self._abort, 3)
