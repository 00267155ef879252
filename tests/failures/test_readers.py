"""A reader never disturbs a writer: loading from a root another job is saving into renames, removes
and "recovers" nothing there (docs/checkpoint.md, "Readers and writers")."""

import os
import textwrap

import pytest

from mpifsdp.checkpoint import load, load_latest, save, save_step

from support import on_rank_0, run_job, sharded_tiny_gpt, shared_dir


def test_a_live_saves_complete_staging_is_read_where_it_lies_and_left_to_its_writer(comm, tmp_path):
    """A save between its manifest and its rename: the staging directory is complete and its job is
    about to rename it. Loading reads it where it lies and leaves it there, so the writer's rename
    still finds it (a reader that "recovered" it made the writer die on every rank)."""
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    save_step(root, 1, model, opt, extra={"copy": "one"})
    save(f"{root}/live", model, opt, {"step": 2, "copy": "two"})
    staging = f"{root}/step-00000002.tmp-live0000"
    on_rank_0(comm, lambda: os.replace(f"{root}/live", staging))  # the writer, a moment before its rename
    before = sorted(os.listdir(root))
    path, extra = load_latest(root, *sharded_tiny_gpt(comm, seed=5))
    assert str(path) == staging and extra["copy"] == "two"
    assert load(f"{root}/step-00000002", *sharded_tiny_gpt(comm, seed=5))["copy"] == "two"
    comm.barrier()
    assert sorted(os.listdir(root)) == before  # nothing renamed, nothing removed
    on_rank_0(comm, lambda: os.replace(staging, f"{root}/step-00000002"))  # the writer's rename succeeds


def test_a_replaced_copy_a_live_overwrite_set_aside_is_not_removed_by_a_reader(comm, tmp_path):
    """An overwrite between its two renames leaves `.old-*` beside `.tmp-*`: a reader reads the new copy
    and removes neither (removing the old copy is the writer's, once the new one is in place)."""
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    save_step(root, 1, model, opt, extra={"copy": "old"})
    save(f"{root}/new", model, opt, {"step": 1, "copy": "new"})

    def between_renames():
        os.replace(f"{root}/step-00000001", f"{root}/step-00000001.old-aaaa0000")
        os.replace(f"{root}/new", f"{root}/step-00000001.tmp-bbbb0000")

    on_rank_0(comm, between_renames)
    before = sorted(os.listdir(root))
    assert load(f"{root}/step-00000001", *sharded_tiny_gpt(comm, seed=5))["copy"] == "new"
    comm.barrier()
    assert sorted(os.listdir(root)) == before


WRITER = textwrap.dedent(
    """
    import sys
    from mpifsdp import Comm
    from mpifsdp.checkpoint import save_step
    sys.path.insert(0, sys.argv[2])
    from support import sharded_tiny_gpt, train
    comm = Comm()
    model, opt = sharded_tiny_gpt(comm)
    for step in range(1, 41):
        train(model, opt, comm, 1, first=step)
        save_step(sys.argv[1], step, model, opt, keep=2)
    print("writer done", flush=True)
    """
)

READER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from mpifsdp import Comm
    from mpifsdp.checkpoint import load_latest
    sys.path.insert(0, sys.argv[2])
    from support import sharded_tiny_gpt
    comm = Comm()
    loads, end = 0, time.monotonic() + 60
    while not Path(sys.argv[3]).exists() and time.monotonic() < end:
        path, extra = load_latest(sys.argv[1], *sharded_tiny_gpt(comm, seed=3), missing_ok=True)
        loads += path is not None
    print(f"reader loaded {loads} times", flush=True)
    """
)


def test_a_job_loading_the_latest_in_a_loop_never_stops_a_job_saving_every_step(comm, tmp_path):
    """The issue's case as two real jobs on one root: a 2-rank training job saving every step (keep=2,
    so its pruning runs too) and a 1-rank job calling load_latest as fast as it can. Both end well."""
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    import subprocess
    import sys

    from support import ROOT, mpiexec

    root, done = tmp_path / "root", tmp_path / "writer-done"
    (tmp_path / "writer.py").write_text(WRITER)
    (tmp_path / "reader.py").write_text(READER)
    tests = str(ROOT / "tests")
    reader = subprocess.Popen(
        [*mpiexec(), "-n", "1", sys.executable, "-m", "mpi4py", str(tmp_path / "reader.py"), str(root), tests,
         str(done)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        result, _ = run_job(tmp_path / "writer.py", 2, root, tests, timeout=150)
        done.touch()
        out, _ = reader.communicate(timeout=90)
    finally:
        done.touch()
        if reader.poll() is None:
            reader.kill()
    writer_out = result.stdout + result.stderr
    assert result.returncode == 0 and "writer done" in writer_out, writer_out
    assert reader.returncode == 0 and "reader loaded" in out and "recovered" not in out, out
    assert int(out.split("reader loaded ")[1].split()[0]) > 0, out
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "step-00000039",
        "step-00000040",
    ]


@pytest.mark.mpi(min_size=2)
def test_ranks_never_load_two_versions_of_one_checkpoint(comm, tmp_path, monkeypatch):
    """Another job's save over a checkpoint while the ranks read it gave some ranks the old manifest
    and slices and others the new, each consistent: different weights, no error. The ranks agree on
    the manifest first; a disagreement is read again, and one that persists is refused."""
    import mpifsdp.checkpoint.sharded as sharded_module
    from mpifsdp.checkpoint import CheckpointError

    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    save(f"{root}/ck", model, opt, {"version": 1})
    real, reads = sharded_module.read_manifest, []

    def another_version_on_rank_1(directory, times):
        manifest = real(directory)
        reads.append(1)
        if comm.rank == 1 and len(reads) <= times:
            manifest = {**manifest, "extra": {"version": 2}}  # what the other job's save wrote
        return manifest

    monkeypatch.setattr(sharded_module, "read_manifest", lambda d: another_version_on_rank_1(d, 1))
    assert load(f"{root}/ck", *sharded_tiny_gpt(comm, seed=5)) == {"version": 1}  # read again: agreed
    reads.clear()
    monkeypatch.setattr(sharded_module, "read_manifest", lambda d: another_version_on_rank_1(d, 99))
    with pytest.raises(CheckpointError, match="changed while it was read"):
        load(f"{root}/ck", *sharded_tiny_gpt(comm, seed=5))
