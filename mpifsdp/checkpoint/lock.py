"""One job writes a checkpoint location at a time: a lock file beside it names its owner.

Two jobs saving into one root removed each other's saves in progress (each took the other's staging
directory for a dead save's) and replaced each other's checkpoints. So a job's rank 0 takes a lock at
its first save — for `save_step(root, ...)` the whole root (`root/.mpifsdp-writer.lock`), for
`save(directory, ...)` that directory (`.<name>.mpifsdp-writer.lock` beside it) — and holds it until
the process ends. The file names the owner's host, pid and a token; it is refreshed at every save.

A second job is refused at its first save, on every rank, naming the owner. A dead owner does not keep
the lock: on the same host a pid that no longer runs is taken over at once; from another host (whose
processes cannot be seen) a lock that names this very Slurm job (its earlier run: a preempted or
requeued job keeps its SLURM_JOB_ID, and lands on any node) or a Slurm job `squeue` says is over is
taken over at once, and any other one once not refreshed for MPIFSDP_LOCK_STALE_S seconds
(default 21600, 6 hours). An owner that finds its lock taken over stops at its next save instead of
writing on, also where that job has ended since (its token is kept in `<lock>.taken-over`); a lock
that is only gone (a clean-up script removed it) is taken again, with a warning.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

from ..base.checks import env_seconds
from .manifest import CheckpointError

log = logging.getLogger(__name__)

SUFFIX = ".mpifsdp-writer.lock"
_held: dict[Path, str] = {}  # lock path -> this process's token


def root_lock(root: Path) -> Path:
    return Path(root) / SUFFIX


def directory_lock(directory: Path) -> Path:
    directory = Path(directory)
    return directory.parent / f".{directory.name}{SUFFIX}"


def holds(lock: Path) -> bool:
    return Path(lock) in _held


def hold(lock: Path):
    """Take `lock` for this process (or refresh it where already ours); CheckpointError where another
    live job holds it, or where ours was taken over."""
    lock = Path(lock)
    if lock in _held and _still_ours(lock):
        os.utime(lock)
        return
    if lock.parent.exists() and not lock.parent.is_dir():
        raise CheckpointError(f"cannot save under {lock.parent}: Not a directory (it is a file)")
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):  # a stale lock moved aside, or a race with another new job: try again
        token = uuid.uuid4().hex
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = _owner(lock)
            if owner is None and _age(lock) < 10:  # another job created it and is writing it now
                raise CheckpointError(
                    f"{_place(lock)}: another job is taking its writer lock {lock} now"
                ) from None
            if owner is not None and not _stale(lock, owner):
                raise CheckpointError(
                    f"{_place(lock)} is being written by another job ({_who(owner)}): give this run its own "
                    f"directory; if that job is gone, delete {lock}"
                ) from None
            _move_aside(lock, owner)
            continue
        with os.fdopen(fd, "w") as f:
            me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "token": token}
            job = _slurm_job()
            json.dump({**me, **({"slurm_job": job} if job else {})}, f)
            f.flush()
            os.fsync(f.fileno())
        _held[lock] = token
        return
    raise CheckpointError(
        f"{_place(lock)}: could not take its writer lock {lock} (other jobs keep taking it)"
    )


def _still_ours(lock: Path) -> bool:
    """Whether `lock`, which this process took, is still its own (True), or gone and to be taken
    again (False); CheckpointError where another job took it over (and perhaps ended since)."""
    if not lock.exists() and _held[lock] in _taken_over(lock):  # taken, then released since
        del _held[lock]
        raise CheckpointError(
            f"{_place(lock)}: another job took over this job's lock (it found it stale) and has "
            "ended since; stopping"
        )
    if not lock.exists():  # removed (a clean-up script): no one took it over, so take it again
        del _held[lock]
        log.warning(
            "%s: this job's writer lock %s was removed meanwhile; taking it again", _place(lock), lock
        )
        return False
    owner = _owner(lock)
    if owner is None or owner.get("token") != _held[lock]:
        del _held[lock]
        raise CheckpointError(
            f"{_place(lock)}: another job took over this job's lock ({_who(owner)}); stopping"
        )
    return True


def release(lock: Path):
    """Remove `lock` if this process holds it (and it is still its own)."""
    token = _held.pop(Path(lock), None)
    owner = _owner(Path(lock)) if token else None
    if owner is not None and owner.get("token") == token:
        Path(lock).unlink(missing_ok=True)


def release_all():
    """Remove the locks this process holds: at exit (atexit), so a job that ends leaves none."""
    for lock in list(_held):
        release(lock)


atexit.register(release_all)  # once, at import: a no-op where this process holds no lock


def _owner(lock: Path) -> dict | None:
    try:
        owner = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None  # gone, or half-written by an owner that died while writing it
    return owner if isinstance(owner, dict) else None


def _stale(lock: Path, owner: dict) -> bool:
    """Whether the job that owns `lock` no longer runs. Same host: its pid. Another host: the lock
    names this very Slurm job (an earlier run of it: a requeued job keeps its SLURM_JOB_ID and lands
    on any node), or a Slurm job squeue says is over; else a lock not refreshed for
    MPIFSDP_LOCK_STALE_S seconds."""
    if owner.get("host") == socket.gethostname():
        try:
            os.kill(int(owner.get("pid", -1)), 0)
        except ProcessLookupError:
            return True
        except (OSError, ValueError, TypeError):
            return False  # it runs (under another user), or the pid is unreadable: assume alive
        return False
    theirs = str(owner.get("slurm_job") or "")
    if theirs and (theirs == _slurm_job() or slurm_job_over(theirs)):
        return True
    stale_after = env_seconds("MPIFSDP_LOCK_STALE_S", 6 * 3600, "the age of another host's stale lock")
    return _age(lock) > stale_after


def _slurm_job() -> str:
    """This process's Slurm job (an array task as ARRAY_TASK: each task is a job of its own), or ''."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID", ""), os.environ.get("SLURM_ARRAY_TASK_ID", "")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID", "")


def slurm_job_over(job: str) -> bool:
    """Whether Slurm says `job` is over: squeue knows it no longer (or not as pending or running).
    False where that cannot be asked (no squeue, no answer in 10 s): the lock's age decides then."""
    try:
        result = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    states = result.stdout.split()
    if result.returncode != 0:
        return "Invalid job id" in result.stderr  # purged from the controller: long over
    return not any(s in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED") for s in states)


def _age(lock: Path) -> float:
    """Seconds since the lock was written or refreshed (infinite where it is gone)."""
    try:
        return time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _move_aside(lock: Path, owner: dict | None):
    """Take a stale (or unreadable, half-written) lock out of the way: a rename, so that of two jobs
    finding it stale only one moves it; the other finds the winner's lock on its next try."""
    aside = lock.with_name(f"{lock.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return
    log.warning("taking over %s from a job that is gone (%s)", lock, _who(owner))
    if owner and owner.get("token"):  # should it be alive after all, its next save stops
        with open(_taken_over_file(lock), "a") as f:
            f.write(f"{owner['token']}\n")
    aside.unlink(missing_ok=True)


def _taken_over_file(lock: Path) -> Path:
    return lock.with_name(f"{lock.name}.taken-over")


def _taken_over(lock: Path) -> set[str]:
    """The tokens of locks other jobs took over as stale (a job whose token is here stops)."""
    try:
        return set(_taken_over_file(lock).read_text().split())
    except OSError:
        return set()


def _place(lock: Path) -> Path:
    name = lock.name
    return lock.parent if name == SUFFIX else lock.parent / name[1 : -len(SUFFIX)]


def _who(owner: dict | None) -> str:
    if not owner:
        return "an unreadable lock"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
    return f"host {owner.get('host')}, pid {owner.get('pid')}, since {since}"
