"""Exact counters: bytes held by category, and collectives by unit, phase and op.

[Note: exact accounting] Every runtime buffer (shards, gathered parameters and gradients, optimizer
state) is added here when allocated and removed when freed, and every collective records its call
and bytes, so tests can hold memory and traffic to the formulas exactly (docs/design.md, invariant 7):
    persistent bytes per rank = 16 * shard_numel (fp32 params, grads, m, v)
    elements per rank per step = (N - 1) / N * 3 * padded_numel (two gathers + one reduce-scatter)
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections import defaultdict

PERSISTENT = ("param_shard", "grad_shard", "optim_state")
TRANSIENT = ("gathered_params", "gathered_grads", "checkpoint_io")


class MemoryLedger:
    """Current and peak bytes per category, and the peak of their sum. Between start_timeline() and
    stop_timeline() every change is also recorded with its time (a step's memory as a picture)."""

    def __init__(self):
        self.current = defaultdict(int)
        self.peak = defaultdict(int)
        self.peak_total = 0
        self.timeline: list | None = None
        self._t0 = 0.0
        self.on_disk = defaultdict(int)  # bytes by category kept in files, not memory (offload="disk")

    def alloc(self, category: str, nbytes: int):
        self.current[category] += nbytes
        self.peak[category] = max(self.peak[category], self.current[category])
        self.peak_total = max(self.peak_total, self.total())
        self._record(category)

    def free(self, category: str, nbytes: int):
        self.current[category] -= nbytes
        if self.current[category] < 0:
            raise AssertionError(f"memory ledger: freed more {category} bytes than were allocated")
        self._record(category)

    def held(self) -> dict:
        """The bytes each category holds now (a CUDA graph's replays put them back as its captured pass
        left them, with the buffers: fsdp/graphed.py)."""
        return dict(self.current)

    def restore_held(self, held: dict):
        self.current.clear()
        self.current.update(held)

    def start_timeline(self):
        """From now on, record [seconds since now, category, its bytes after, process RSS bytes] at
        every allocation and free, after one such entry per category for where it starts. The RSS
        holds what the ledger does not see (activations)."""
        self.timeline, self._t0 = [], time.perf_counter()
        for category in PERSISTENT + TRANSIENT:
            self._record(category)

    def stop_timeline(self) -> list:
        events, self.timeline = self.timeline or [], None
        return events

    def _record(self, category: str):
        if self.timeline is not None:
            seconds = round(time.perf_counter() - self._t0, 6)
            self.timeline.append([seconds, category, self.current[category], current_rss_bytes()])

    def total(self) -> int:
        return sum(self.current.values())

    def persistent(self) -> int:
        return sum(self.current[c] for c in PERSISTENT)

    def reset_peaks(self):
        self.peak = defaultdict(int, self.current)
        self.peak_total = self.total()

    def report(self) -> dict:
        cats = PERSISTENT + TRANSIENT
        return {
            "current": {c: self.current[c] for c in cats},
            "peak": {c: self.peak[c] for c in cats},
            "persistent": self.persistent(),
            "peak_total": self.peak_total,
            "on_disk": dict(self.on_disk),
        }


class CommLedger:
    """Calls, elements and bytes per (unit, phase, op); elements are what one rank moves (ring volume).
    `wait_s`: seconds this rank spent blocked waiting for collectives (the communication compute did
    not hide, plus the time other ranks made it wait). `waits`: the exposed seconds by (unit, phase):
    the host blocked in a unit's collective, or on a GPU (Comm.time_waits) the compute stream
    stalled waiting for it, timed by the device's events: the overlap each unit gets."""

    def __init__(self):
        self.calls = defaultdict(int)
        self.elements = defaultdict(int)
        self.bytes = defaultdict(int)
        self.wait_s = 0.0
        self.waits = defaultdict(float)

    def record(self, unit: str, phase: str, op: str, elements: int, itemsize: int):
        key = (unit, phase, op)
        self.calls[key] += 1
        self.elements[key] += elements
        self.bytes[key] += elements * itemsize

    def reset(self):
        self.calls.clear()
        self.elements.clear()
        self.bytes.clear()
        self.wait_s = 0.0
        self.waits.clear()

    def total(self, what: str = "bytes", **match) -> int:
        """Sum of calls/elements/bytes over keys matching unit=, phase=, op= where given."""
        table = getattr(self, what)
        names = ("unit", "phase", "op")
        return sum(
            v for key, v in table.items() if all(match.get(n) in (None, k) for n, k in zip(names, key))
        )

    def report(self) -> dict:
        by_phase, by_op = defaultdict(int), defaultdict(int)
        by_unit = defaultdict(int)
        for (unit, phase, op), b in self.bytes.items():
            by_phase[phase] += b
            by_op[op] += b
            by_unit[unit] += b
        return {
            "calls": self.total("calls"),
            "bytes": self.total("bytes"),
            "bytes_by_phase": dict(by_phase),
            "bytes_by_op": dict(by_op),
            "bytes_by_unit": dict(by_unit),
            "wait_s": self.wait_s,
            "exposed_s_by_unit": self.exposed_by_unit(),
        }

    def exposed_by_unit(self) -> dict:
        """{unit: exposed seconds} over phases (`waits`), the units in the order first waited on."""
        by_unit = defaultdict(float)
        for (unit, _), seconds in self.waits.items():
            by_unit[unit] += seconds
        return dict(by_unit)


class SyncLedger:
    """Every time the host waits for a GPU, by purpose (the loss for logging, the step's verdict, a
    collective's completion, ...): on a device each wait stalls the host's queue of kernels, so a
    fast step has almost none. Counted by backend.host_value (a value read back) and Comm.settle (a
    wait for collectives); NumPy arrays cost nothing and are not counted."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def count(self, purpose: str):
        self.counts[purpose] = self.counts.get(purpose, 0) + 1

    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self):
        self.counts.clear()


HOST_SYNCS = SyncLedger()  # the process's: one GPU per process


def mib(nbytes: float) -> float:
    return round(nbytes / 2**20, 2)


def current_rss_bytes() -> int | None:
    """This process's resident memory now (Linux's /proc; None where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
