"""A stop asked for by a signal, taken at a step boundary by every rank at once.

A scheduler warns a job before it ends it: Slurm's `#SBATCH --signal=USR1@120` sends SIGUSR1 to every
task two minutes before the time limit (or a preemption's grace period ends), then SIGTERM. A run
that dies mid-step loses everything since its last checkpoint. `StopRequest()` turns those signals
into a flag; `stop.agreed(comm)`, called at each step boundary, adds up every rank's flag (one float
all-reduce), so that all ranks stop after the same step, save, and exit 0; with `--requeue` Slurm
queues the job again and `--resume latest` continues it. A write under way when the signal comes
goes on (base/files.py leaves a program's own handler in charge).
"""

from __future__ import annotations

import signal
import threading


class StopRequest:
    """SIGUSR1 and SIGTERM (by default) ask for a stop at the next step boundary (module docstring).

    stop = StopRequest()
    for step in ...:
        ... forward, backward, opt.step() ...
        if stop.agreed(comm):
            save_step(root, step + 1, model, opt)
            break
    """

    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM)):
        self.received: str | None = None  # the name of the signal this process received
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # handlers belong to the main thread
            for number in signals:
                self._previous[number] = signal.signal(number, self._note)

    def _note(self, number, frame):
        self.received = signal.Signals(number).name

    def agreed(self, comm) -> bool:
        """Whether any rank was asked to stop: the same answer on every rank. Collective (one float)."""
        asked = comm.all_reduce_scalar(1.0 if self.received else 0.0, what="the stop request")
        return asked > 0

    def close(self):
        """Put back the handlers that were there."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}


__all__ = ["StopRequest"]
