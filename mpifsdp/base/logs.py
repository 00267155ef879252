"""The job's log: mpifsdp's records labelled "[rank k] " where several ranks print, and a warning the
ranks agree on said once for the job instead of once a rank.

Why: under srun or mpiexec every rank's log reaches one file. A warning each rank gave alike (a
skipped step, an overflow, the transport chosen) was N identical lines, and a rank's own warning
could not be told from another's."""

from __future__ import annotations

import logging

_rank = 0
_labelled = False


class JobWide(str):
    """A message every rank gives alike: said by rank 0 alone, without a rank label."""


def label(rank: int, size: int):
    """Prefix mpifsdp's records with "[rank k] " where several ranks print, and leave job-wide warnings
    to rank 0. Once per process, for the job's world; other loggers' records are left as they are."""
    global _rank, _labelled
    _rank = rank
    if _labelled or size < 2:
        return
    _labelled = True
    make = logging.getLogRecordFactory()

    def labelled(name, *args, **kwargs):
        record = make(name, *args, **kwargs)
        mine = name == "mpifsdp" or name.startswith("mpifsdp.")
        if mine and not isinstance(record.msg, JobWide):
            record.msg = f"[rank {rank}] {record.msg}"
        return record

    logging.setLogRecordFactory(labelled)


def job_warning(log: logging.Logger, message: str, *args):
    """A warning whose condition every rank agrees on (a collective decided it): rank 0 says it, once
    for the job; the other ranks say nothing."""
    if _rank == 0:
        log.warning(JobWide(message), *args)
