"""The job's log: mpifsdp's records labelled "[rank k] " where several ranks print, and a warning the
ranks agree on said once for the job instead of once a rank.

Why: under srun or mpiexec every rank's log reaches one file. A warning each rank gave alike (a
skipped step, an overflow, the transport chosen) was N identical lines, and a rank's own warning
could not be told from another's."""

from __future__ import annotations

import logging

_world_size = 0  # the job's, once label() has seen the world
_labelled = False


class JobWide(str):
    """A message every rank gives alike: said by rank 0 alone, without a rank label."""


def label(rank: int, size: int):
    """Prefix mpifsdp's records with "[rank k] " where several ranks print, and leave job-wide warnings
    to rank 0. Once per process, for the job's world; other loggers' records are left as they are."""
    global _world_size, _labelled
    _world_size = size
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


def job_warning(group, log: logging.Logger, message: str, *args):
    """A warning whose condition the ranks of `group` agree on (a collective decided it): its rank 0
    says it, once for them all, and the others say nothing. `group`: a Comm, an mpi4py communicator,
    or None (this process alone). Said for the whole job (the world), it carries no rank label; for a
    group of it, rank 0's label."""
    if group is None:
        rank, size = 0, 1
    elif hasattr(group, "Get_rank"):
        rank, size = group.Get_rank(), group.Get_size()
    else:
        rank, size = group.rank, group.size
    if speaks(rank):
        log.warning(JobWide(message) if size == _world_size else message, *args)


def speaks(rank: int) -> bool:
    """Whether this rank of a group says the group's warning: its rank 0 alone."""
    return rank == 0
