"""StepMetrics: one JSON line per training step, written by rank 0 to a file the user names.

Each line has what the caller measured (step, loss, lr, grad norm, tokens, seconds) and what only the
runtime knows, from every rank's ledgers: the step split into compute and exposed communication (the
time a rank sat blocked in collectives; the slowest rank's), peak memory per rank by category, and
bytes moved by phase; "time_s" is the wall time since the StepMetrics was made. `start()` resets the
ledgers at a step's beginning; `write()` is collective (one small allgather), so call both on every
rank. `note()` adds a line of the caller's own (rank 0 writes it; not collective), e.g. a val loss.

One step (`timeline_step`, the second by default: the first pays for warm-up) also records every
rank's memory over time (each allocation and free of the ledger's categories, with the process's
RSS beside it) and the bytes each unit moved in each phase, as one extra line with "timeline_step".
`python -m mpifsdp pictures RUN.jsonl` draws the file as pictures.

    metrics = StepMetrics("out/metrics.jsonl", model)
    for step in ...:
        metrics.start()
        ... forward, backward, step ...
        metrics.write(step=step, loss=loss.item(), seconds=dt, tokens=n, lr=lr, grad_norm=norm)
    metrics.note(step=step, val_loss=val)
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from pathlib import Path

from ..base.accounting import PERSISTENT, TRANSIENT
from ..base.checks import is_count, plain_json
from ..base.files import atomic_file
from ..fsdp.build import sharded_model

log = logging.getLogger(__name__)


class StepMetrics:
    """One JSON line per training step on rank 0, with what the ledgers saw of it (module docstring)."""

    def __init__(self, path, model, timeline_step: int | None = 2, resume_after: int | None = None):
        """timeline_step: which start() (1 = the first) also records the memory timeline; None: none.
        resume_after: a run resumed from the checkpoint of step k continues the file: its lines up to
        step k are kept (a run that crashed may have logged steps past its last checkpoint) and the new
        ones follow; None starts the file afresh (one run per file). Collective."""
        self.sharded = sharded_model(model)
        if self.sharded is None:
            raise ValueError("StepMetrics needs a model fully_shard() was called on (N = 1 works too)")
        if resume_after is not None and not is_count(resume_after):  # on every rank, before rank 0 reads
            raise ValueError(
                f"StepMetrics: resume_after={resume_after!r} must be None or a step (an integer >= 0)"
            )
        self.comm = self.sharded.comm
        self.path = Path(path)
        self.timeline_step, self.starts = timeline_step, 0
        self.t0 = time.perf_counter()
        self.comm.run_everywhere(lambda: self._begin(resume_after), f"starting {self.path}", root=0)

    def _begin(self, resume_after: int | None):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = b""
        if resume_after is not None and self.path.exists():
            kept = b"".join(line for line, step in _whole_lines(self.path) if step <= resume_after)
        with atomic_file(self.path) as f:
            f.write(kept)

    def start(self):
        """A step begins: count its collectives, waits and memory peaks from here."""
        for level in self.sharded.levels():
            level.ledger.reset()
        self.sharded.ledger.reset_peaks()
        self.starts += 1  # the same count on every rank: the timeline's allgather is collective
        if self.starts == self.timeline_step:
            self.sharded.ledger.start_timeline()

    def note(self, **values):
        """Append a line of the caller's values (rank 0), e.g. note(step=s, val_loss=v)."""
        if self.comm.rank == 0:
            self._append({**{k: _finite(v) for k, v in values.items()}, "time_s": self._elapsed()})

    def write(self, *, step: int, loss: float, seconds: float, tokens: int, **values) -> dict | None:
        """Append this step's line (rank 0; returns it there, None elsewhere). Collective.

        loss: this rank's (the line has the mean over ranks); tokens: the step's, over all ranks;
        values: anything else to record as it is (lr, grad_norm, ...)."""
        reports = [level.ledger.report() for level in self.sharded.levels()]
        try:  # NumPy scalars become numbers; anything else JSON cannot hold is refused on every rank
            values, problem = plain_json("StepMetrics.write", {"loss": loss, **values}), None
        except ValueError as exc:
            values, problem = {}, str(exc)
        mine = {
            "problem": problem,
            "loss": values.get("loss"),
            "wait_s": sum(r["wait_s"] for r in reports),
            "peak": {c: self.sharded.ledger.peak[c] for c in PERSISTENT + TRANSIENT},
            "bytes_by_phase": _summed([r["bytes_by_phase"] for r in reports]),
        }
        timeline = self.sharded.ledger.timeline is not None
        if timeline:
            mine["memory_events"] = self.sharded.ledger.stop_timeline()
        everyone = self.comm.allgather_object(mine)
        problems = [f"rank {r}: {m['problem']}" for r, m in enumerate(everyone) if m["problem"]]
        if problems:
            raise ValueError("; ".join(problems))
        values.pop("loss")
        if timeline and self.comm.rank == 0:
            self._write_timeline(step, everyone)
        if self.comm.rank != 0:
            return None
        exposed = max(r["wait_s"] for r in everyone)
        line = {
            "step": step,
            "loss": _finite(sum(r["loss"] for r in everyone) / len(everyone)),
            **{k: _finite(v) for k, v in values.items()},
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "compute_s": max(0.0, seconds - exposed),
            "exposed_comm_s": exposed,
            "peak_bytes_per_rank": [r["peak"] for r in everyone],
            "bytes_by_phase": mine["bytes_by_phase"],
            "time_s": self._elapsed(),
        }
        self._append(line)
        return line

    def _write_timeline(self, step: int, everyone: list):
        """The timeline step's extra line: every rank's memory events and the bytes each unit moved."""
        self._append(
            {
                "timeline_step": step,
                "memory_events": [r["memory_events"] for r in everyone],
                "bytes_by_unit_phase": self._bytes_by_unit_phase(),
            }
        )

    def _bytes_by_unit_phase(self) -> dict:
        """{unit: {phase: bytes}} this rank moved, over the model's communicators."""
        out: dict = defaultdict(lambda: defaultdict(int))
        for level in self.sharded.levels():
            for (unit, phase, _), nbytes in level.ledger.bytes.items():
                out[unit][phase] += nbytes
        return {unit: dict(phases) for unit, phases in out.items()}

    def _elapsed(self) -> float:
        return round(time.perf_counter() - self.t0, 4)

    def _append(self, line: dict):
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _whole_lines(path: Path) -> list[tuple[bytes, float]]:
    """(line, the step it belongs to) for each line of the file written whole, each read once: a
    crash while a line was written leaves a fragment with no newline at the end, which is cut (the
    next line would be glued onto it); a line that is not JSON (such a fragment a run before this
    check continued) goes too, said in a warning. A line that is not a step's belongs to step 0."""
    lines, whole = path.read_bytes().splitlines(keepends=True), []
    for line in lines:
        try:
            value = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            continue
        if value is not None:
            step = value.get("step", 0) if isinstance(value, dict) else 0
            whole.append((line, step if isinstance(step, (int, float)) else 0))
    if len(whole) < len(lines):
        log.warning("%s: dropped %d torn line(s) a crash left while writing", path, len(lines) - len(whole))
    return whole


def _summed(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _finite(value):
    """JSON has no NaN or Inf: those become null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
