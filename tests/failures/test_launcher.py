"""A launch whose tasks did not join one MPI job is refused at the first Comm, on every task
(comm/launcher.py): they trained independent copies of the model until the writer lock noticed."""

import os
import subprocess
import sys
import textwrap

import pytest

from support import mpiexec, run_launched

SCRIPT = textwrap.dedent(
    """
    from mpifsdp import Comm
    comm = Comm()
    print(f"rank {comm.rank} of {comm.size} joined", flush=True)
    """
)
LAUNCHERS = ("PMI_SIZE", "PMI_RANK", "PMI_FD", "PMI_PORT", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")


def _env(**values):
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHERS and not k.startswith("SLURM_")}
    return {**clean, **values}


def test_tasks_that_did_not_join_one_job_are_refused_on_every_task(comm, tmp_path):
    """Two tasks Slurm started (srun -n 2, a --mpi that does not fit the MPI): each is rank 0 of 1."""
    if comm.size > 1:
        pytest.skip("starts its own processes: runs in the plain-pytest pass of make test")
    (tmp_path / "job.py").write_text(SCRIPT)
    tasks = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "job.py")],
            env=_env(SLURM_STEP_NUM_TASKS="2", SLURM_PROCID=str(task), SLURM_JOB_ID="77"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for task in (0, 1)
    ]  # fmt: skip
    outs = [task.communicate(timeout=120)[0] for task in tasks]
    for task, (process, out) in enumerate(zip(tasks, outs)):
        assert process.returncode != 0 and "joined" not in out, out
        said = f"the launcher started this process as task {task} of 2 (SLURM_STEP_NUM_TASKS=2), but MPI"
        assert said in out and "srun --mpi=pmi2" in out, out
    alone = subprocess.run(  # the check off: the user's word
        [sys.executable, str(tmp_path / "job.py")],
        env=_env(SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1", MPIFSDP_CHECK_LAUNCHER="0"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert alone.returncode == 0 and "rank 0 of 1 joined" in alone.stdout, alone.stderr


def test_the_innermost_launcher_is_believed(comm, tmp_path):
    """mpiexec -n 2 inside a Slurm step of one task (srun -n 1 mpiexec ...): the MPI launcher's own
    count (PMI_SIZE, OMPI_COMM_WORLD_SIZE) is the job's, and the run goes on; a plain python in the
    batch script's shell (SLURM_NTASKS=4, no step) is one process by right."""
    if comm.size > 1:
        pytest.skip("starts its own processes: runs in the plain-pytest pass of make test")
    (tmp_path / "job.py").write_text(SCRIPT)
    env = _env(SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0", SLURM_NTASKS="4")
    result = run_launched([*mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", str(tmp_path / "job.py")],
                          env=env, timeout=120)  # fmt: skip
    assert result.returncode == 0 and "rank 1 of 2 joined" in result.stdout, result.stdout + result.stderr
    batch = _env(SLURM_NTASKS="4", SLURM_PROCID="0", SLURM_JOB_ID="77")
    shell = subprocess.run([sys.executable, str(tmp_path / "job.py")], env=batch, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert shell.returncode == 0 and "rank 0 of 1 joined" in shell.stdout, shell.stderr
