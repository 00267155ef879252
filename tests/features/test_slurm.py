"""The shipped examples/slurm/cpu.sbatch under a real Slurm (one node, this machine: .ci/run starts it with
tools/slurm/one_node.sh), run as a cluster user runs it: sbatch, srun under two MPI routes (pmi2 with the
mpich wheel; pmix with Debian's Open MPI and mpi4py built against it, `make install MPI=site`), a requeue
in the middle of a run, a job array. The script is shrunk by its variables, never edited."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import MACHINE_LACKS, ROOT, Slurm, step_losses

SCRIPT = ROOT / "examples" / "slurm" / "cpu.sbatch"
SMALL = {"N_LAYER": 1, "N_EMBD": 16, "N_HEAD": 2, "BLOCK_SIZE": 16, "BATCH_SIZE": 4}
ONE_NODE = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10"]
# The two ways to start MPI ranks under srun, and the interpreter whose mpi4py each needs.
ROUTES = {"pmi2": ROOT / ".venv" / "bin" / "python", "pmix": ROOT / ".venv-site" / "bin" / "python"}


def slurm_here(comm) -> Slurm:
    """The Slurm, once per make test: the scenarios start their own jobs (skipped under mpiexec) and
    name their interpreters themselves (the MPICH pass runs them; the Open MPI wheel's would repeat them)."""
    if comm.size > 1:
        pytest.skip("submits its own Slurm jobs: runs in the plain-pytest pass of make test")
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():  # a venv's python links to the same file
        pytest.skip("the Slurm scenarios run in make test's MPICH pass (they start both MPI routes' venvs)")
    return Slurm.here()


def route(mpi: str):
    python = ROUTES[mpi]
    if not python.exists():
        missing = f"srun --mpi={mpi} needs {python}: make install{' MPI=site' if mpi == 'pmix' else ''}"
        if os.environ.get("MPIFSDP_REQUIRE_SLURM") == "1":
            pytest.fail(missing)
        pytest.skip(MACHINE_LACKS + missing)
    return {"SRUN_MPI": mpi, "PYTHON": python}


def run_to_the_end(slurm, tmp_path, name, steps, mpi="pmi2", options=()):
    """cpu.sbatch for `steps` steps into tmp_path/name; (its job's fields, its log)."""
    out = tmp_path / name
    env = {**SMALL, **route(mpi), "OUT": out, "MAX_STEPS": steps, "SAVE_EVERY": 10}
    job = slurm.submit(SCRIPT, *ONE_NODE, f"--output={tmp_path}/{name}.log", *options, env=env)
    [fields] = slurm.wait(job)
    log = (tmp_path / f"{name}.log").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    return fields, log


def test_cpu_sbatch_trains_under_srun_with_mpich_over_pmi2_and_open_mpi_over_pmix(comm, tmp_path):
    """Both routes train the same 2-rank run. With two ranks every sum has two terms, whose order does
    not change a float's bits: the two MPIs' losses are equal, step for step."""
    slurm = slurm_here(comm)
    seen = {}
    for mpi, library in [("pmi2", "MPICH Version"), ("pmix", "Open MPI v")]:
        _, log = run_to_the_end(slurm, tmp_path, mpi, 20, mpi)
        assert f"2 rank(s) on cpu over {library}" in log, log[-3000:]  # which MPI the job ran on
        assert json.loads(log.strip().splitlines()[-1])["world_size"] == 2
        seen[mpi] = step_losses(tmp_path / mpi / "metrics.jsonl")
        assert len(seen[mpi]) == 20
    assert seen["pmi2"] == seen["pmix"]


def test_a_requeued_job_resumes_and_ends_with_the_loss_of_an_uninterrupted_run(comm, tmp_path):
    """scontrol requeue (what a preemption does): Slurm signals the tasks, train_gpt saves after the step
    it is in (its only checkpoint before the end) and exits 0, the job is queued again under the same
    id, and --resume latest continues from that checkpoint. Every step's loss equals the
    uninterrupted run's. (A lock a killed run left is taken over by its requeued job:
    tests/failures/test_checkpoint_safety.py.)"""
    slurm = slurm_here(comm)
    steps = 400
    run_to_the_end(slurm, tmp_path, "whole", steps)
    out = tmp_path / "requeued"
    env = {**SMALL, **route("pmi2"), "OUT": out, "MAX_STEPS": steps, "SAVE_EVERY": 1000}
    job = slurm.submit(SCRIPT, *ONE_NODE, f"--output={tmp_path}/requeued.log", "--open-mode=append", env=env)
    metrics = out / "metrics.jsonl"

    def trained_a_while(jobs) -> bool:  # or ended: a job that failed must not be waited for
        return (
            jobs[0]["JobState"] in slurm.FINAL or metrics.exists() and metrics.read_text().count("\n") >= 20
        )

    running = slurm.wait(job, until=trained_a_while)[0]["JobState"] == "RUNNING"
    assert running, (tmp_path / "requeued.log").read_text()
    subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
    # Slurm starts it again once the first run's credential expired (one_node.sh: cred_expire=20; an
    # earlier start, forced, is refused by the node: "Job credential revoked")
    [fields] = slurm.wait(
        job, until=lambda jobs: jobs[0]["Restarts"] == "1" and jobs[0]["JobState"] in slurm.FINAL
    )
    log = (tmp_path / "requeued.log").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    stopped = int(log.split("stopped after step ")[1].split()[0])
    assert 20 <= stopped < steps, log[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped:08d}'} at step {stopped}" in log, log[-3000:]
    assert step_losses(out / "metrics.jsonl") == step_losses(tmp_path / "whole" / "metrics.jsonl")


def test_a_job_array_gives_each_task_a_run_of_its_own(comm, tmp_path):
    """sbatch --array=0-1: two tasks of the same script at once, each writing under $OUT/<job>_<task>,
    logs under %A_%a: nothing shared, nothing overwritten."""
    slurm = slurm_here(comm)
    env = {**SMALL, **route("pmi2"), "OUT": tmp_path / "out", "MAX_STEPS": 10, "SAVE_EVERY": 5}
    one_task = ["--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=10"]
    array = slurm.submit(SCRIPT, *one_task, "--array=0-1", f"--output={tmp_path}/array-%A_%a.log", env=env)
    tasks = slurm.wait(array)
    assert sorted((t["JobState"], t["ExitCode"]) for t in tasks) == [("COMPLETED", "0:0")] * 2, tasks
    for task in (0, 1):
        run = tmp_path / "out" / f"{array}_{task}"
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000005", "step-00000010"]
        assert len(step_losses(run / "metrics.jsonl")) == 10
        assert "saved" in (tmp_path / f"array-{array}_{task}.log").read_text()
    assert step_losses(tmp_path / "out" / f"{array}_0" / "metrics.jsonl") == step_losses(
        tmp_path / "out" / f"{array}_1" / "metrics.jsonl"
    )  # one config


def test_srun_without_pmi_is_refused_on_every_task(comm, tmp_path):
    """srun --mpi=none: the tasks cannot find each other, and each would be rank 0 of 1, training a copy
    of its own. Each is refused at Comm(), naming srun's --mpi."""
    slurm_here(comm)
    python = route("pmi2")["PYTHON"]
    done = subprocess.run(["srun", "--mpi=none", "-n", "2", "-N", "1", "--time=5", python, "-c",
                           "import mpifsdp; mpifsdp.Comm()"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert said.count("the tasks did not join one job") == 2, said[-3000:]
    assert "--mpi=pmi2" in said, said[-3000:]
