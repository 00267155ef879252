"""What the launcher started against what MPI joined: a mismatch is refused by name at the first Comm.

Processes started by `srun` with the wrong `--mpi`, or an mpi4py built against another MPI than the
launcher's, do not join one job: each runs as "rank 0 of 1", and they train independent copies of the
model until something else notices (the writer lock, at the first save). The launcher says how many
tasks it started, in its own variable: Open MPI's mpirun `OMPI_COMM_WORLD_SIZE`, a PMI launcher
(MPICH's hydra, `srun --mpi=pmi2`) `PMI_SIZE`, Slurm's srun `SLURM_STEP_NUM_TASKS` with
`SLURM_PROCID` (set inside a job step only, not in the batch script's shell, where a plain `python`
is one process by right). MPIFSDP_CHECK_LAUNCHER=0 turns the check off for a launcher that lies.
"""

from __future__ import annotations

import logging
import os

from ..base.checks import env_flag

log = logging.getLogger(__name__)

ANNOUNCED = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")  # innermost launcher first
RANK_OF = {"OMPI_COMM_WORLD_SIZE": "OMPI_COMM_WORLD_RANK", "PMI_SIZE": "PMI_RANK"}
RANK_OF["SLURM_STEP_NUM_TASKS"] = "SLURM_PROCID"
_logged = False


def launcher_problem(rank: int, size: int) -> str | None:
    """Why this process's MPI world (rank of size) is not the job its launcher started, or None."""
    if not env_flag("MPIFSDP_CHECK_LAUNCHER", default=True):
        return None
    variable = next((v for v in ANNOUNCED if os.environ.get(v, "").strip().isdigit()), None)
    if variable is None:
        return None
    tasks, task = int(os.environ[variable]), os.environ.get(RANK_OF[variable], "").strip()
    if tasks == size and (not task.isdigit() or int(task) == rank):
        return None
    where = f"task {task} of " if task.isdigit() else ""
    return (
        f"the launcher started this process as {where}{tasks} ({variable}={tasks}), but MPI made it rank "
        f"{rank} of {size}: the tasks did not join one job, and each would train a copy of its own. Most "
        "likely srun's --mpi does not fit the MPI (the mpich wheel: srun --mpi=pmi2; Open MPI: "
        "--mpi=pmix), or mpi4py was built against another MPI than the launcher's (python -m "
        "mpi4py --mpi-lib-version). MPIFSDP_CHECK_LAUNCHER=0 turns this check off."
    )


def library(mpi) -> str:
    """The MPI library's name and version, from the first line it gives ("MPICH Version: 5.0.2",
    "Open MPI v4.1.4"): which MPI a job ran on, for its log."""
    first = " ".join(mpi.Get_library_version().strip().splitlines()[0].split())
    return first.split(",")[0]


def log_library(rank: int, name: str):
    """The MPI library said once per process (rank 0's log)."""
    global _logged
    if not _logged:
        _logged = True
        if rank == 0:
            log.info("MPI: %s", name)
