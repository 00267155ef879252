"""Checkpoints never lose data: what pruning and "latest" may touch, interrupted overwrites, edited or
malformed manifests and safetensors files, failed saves, and the command line's errors."""

import dataclasses
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from mpifsdp import full_state_dict
from mpifsdp.checkpoint import CheckpointError, checkpoints, load, load_latest, lock, save, save_step
from mpifsdp.checkpoint.consolidated import export_safetensors, load_safetensors
from mpifsdp.checkpoint.manifest import with_digest
from mpifsdp.models import GPT

from support import ROOT, TINY_GPT, agree, on_rank_0, run_job, sharded_tiny_gpt, shared_dir, sub_comm, train


def test_pruning_and_latest_see_only_step_checkpoints(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    save(f"{root}/best", model, opt, {"step": 0})
    save(f"{root}/warm-start", model, opt, {"step": 0})
    for step in (1, 2, 3, 4):
        train(model, opt, comm, 1, first=step)
        save_step(root, step, model, opt, keep=2)
    assert [p.name for p in checkpoints(root)] == ["step-00000004", "step-00000003"]
    assert os.path.isdir(f"{root}/best") and os.path.isdir(f"{root}/warm-start")  # a user's, untouched
    path, extra = load_latest(root, *sharded_tiny_gpt(comm, seed=5))
    assert path.name == "step-00000004" and extra["step"] == 4


def test_an_overwrite_interrupted_between_its_renames_is_recovered(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    save_step(root, 1, model, opt, extra={"copy": "old"})
    save(f"{root}/new", model, opt, {"step": 1, "copy": "new"})

    def killed_between_renames():  # the state a job killed inside _move_into_place leaves
        os.replace(f"{root}/step-00000001", f"{root}/step-00000001.old-aaaa0000")
        os.replace(f"{root}/new", f"{root}/step-00000001.tmp-bbbb0000")

    on_rank_0(comm, killed_between_renames)
    assert checkpoints(root) == []  # nameless for now: neither copy is lost
    path, extra = load_latest(root, *sharded_tiny_gpt(comm, seed=5))
    assert path.name == "step-00000001.tmp-bbbb0000" and extra["copy"] == "new"  # the newer, where it lies
    save_step(root, 2, model, opt, keep=3)  # the writer puts it back; deletes nothing not proven superseded
    assert [p.name for p in checkpoints(root)] == ["step-00000002", "step-00000001"]

    def only_the_old_copy_left():  # killed after moving the old one aside, before the new was whole
        os.replace(f"{root}/step-00000002", f"{root}/step-00000002.old-cccc0000")
        os.makedirs(f"{root}/step-00000002.tmp-dddd0000")

    on_rank_0(comm, only_the_old_copy_left)
    assert load(f"{root}/step-00000002", *sharded_tiny_gpt(comm, seed=5))["step"] == 2


def _read_only(monkeypatch, root):
    """Make every change under `root` fail as a read-only file system's would (the tests run as root,
    for whom a chmod changes nothing)."""
    import errno

    for name in ("replace", "rename", "unlink", "rmdir", "mkdir"):
        real = getattr(os, name)

        def refused(path, *args, _real=real, **kwargs):
            if str(path).startswith(str(root)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, refused)


def test_a_read_only_archive_holding_an_interrupted_overwrite_still_loads(comm, tmp_path, monkeypatch):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    save_step(root, 1, model, opt, extra={"copy": "old"})
    save_step(root, 2, model, opt, extra={"copy": "two"})
    save(f"{root}/new", model, opt, {"step": 1, "copy": "new"})

    def killed_between_renames():
        os.replace(f"{root}/step-00000001", f"{root}/step-00000001.old-aaaa0000")
        os.replace(f"{root}/new", f"{root}/step-00000001.tmp-bbbb0000")
        shutil.copytree(f"{root}/step-00000002", f"{root}/step-00000002.old-cccc0000")  # superseded

    on_rank_0(comm, killed_between_renames)
    before = sorted(os.listdir(root))
    _read_only(monkeypatch, root)
    extra = load(f"{root}/step-00000001", *sharded_tiny_gpt(comm, seed=5))
    assert extra["copy"] == "new"  # read where it lies, no rename needed
    path, extra = load_latest(root, *sharded_tiny_gpt(comm, seed=5))
    assert path.name == "step-00000002" and extra["copy"] == "two"
    assert sorted(os.listdir(root)) == before  # nothing changed, nothing failed


def test_a_superseded_copy_left_by_a_killed_overwrite_is_pruned(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    save_step(root, 1, model, opt)
    on_rank_0(comm, lambda: shutil.copytree(f"{root}/step-00000001", f"{root}/step-00000001.old-aaaa0000"))
    save_step(root, 2, model, opt, keep=1)  # killed after its second rename: step-1 superseded the copy
    assert sorted(p for p in os.listdir(root) if not p.startswith(".")) == ["step-00000002"]


def test_an_edited_manifest_is_refused(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    train(model, opt, comm, 1)
    path = save(f"{root}/ck", model, opt)
    original = (path / "manifest.json").read_text()

    def refused(edit, expect, redo_checksum):
        def change():
            manifest = json.loads(original)
            edit(manifest)
            (path / "manifest.json").write_text(
                json.dumps(with_digest(manifest) if redo_checksum else manifest)
            )

        on_rank_0(comm, change)
        with pytest.raises(CheckpointError, match=expect):
            load(path, *sharded_tiny_gpt(comm, seed=3))
        comm.barrier()

    def drop_a_slice(m):
        m["files"][0]["segments"].pop(0)

    def swap_two_slices(m):  # unit 0's parameters and first moments, same size, same file
        segments = {s["kind"]: s for s in m["files"][0]["segments"] if s["unit"] == 0}
        a, b = segments["param"], segments["exp_avg"]
        a["offset"], b["offset"] = b["offset"], a["offset"]

    refused(drop_a_slice, "the manifest's checksum does not match", redo_checksum=False)
    refused(drop_a_slice, "slices do not cover it once", redo_checksum=True)
    refused(swap_two_slices, "do not match their checksum", redo_checksum=True)
    refused(lambda m: m.update(world_size=0), "world_size must be a positive integer", redo_checksum=True)
    on_rank_0(comm, lambda: (path / "manifest.json").write_text(original))
    load(path, *sharded_tiny_gpt(comm, seed=3))  # restored: loads again


@pytest.mark.parametrize(
    "content, why",
    [
        (b"", "manifest is unreadable"),
        (os.urandom(64), "manifest is unreadable"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"format": "mpifsdp-checkpoint", "version": 1}', "missing field 'world_size'"),
        (b'{"format": "other", "version": 1}', "format 'other'"),
    ],
    ids=["empty", "random", "list", "missing-fields", "other-format"],
)
def test_a_malformed_manifest_is_not_a_valid_checkpoint(comm, tmp_path, content, why):
    root = shared_dir(comm, tmp_path)
    on_rank_0(
        comm, lambda: (os.makedirs(f"{root}/bad"), open(f"{root}/bad/manifest.json", "wb").write(content))
    )
    with pytest.raises(CheckpointError, match=f"not a valid checkpoint: {root}/bad .*{why}"):
        load(f"{root}/bad", *sharded_tiny_gpt(comm))


def _safetensors_file(header: dict, data: bytes, length=None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


MALFORMED = {
    "empty": b"",
    "random": os.urandom(100),
    "huge-header-length": _safetensors_file({}, b"", length=2**62),
    "not-json": struct.pack("<Q", 3) + b"abc",
    "offsets-past-the-end": _safetensors_file(
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8
    ),
    "offsets-disagree-with-shape": _safetensors_file(
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8
    ),
    "gap-between-tensors": _safetensors_file(
        {
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
        },
        b"\0" * 12,
    ),
    "unknown-dtype": _safetensors_file(
        {"w": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_safetensors_file_is_named_and_the_reference_reader_agrees(comm, tmp_path, name):
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(MALFORMED[name])
    with pytest.raises(Exception):  # noqa: B017 - the safetensors package refuses it too, in its own words
        safetensors.numpy.load_file(path)
    with pytest.raises(CheckpointError, match=f"not a valid safetensors file: {path}"):
        load_safetensors(path, GPT(TINY_GPT, seed=0))


def test_a_safetensors_file_with_extra_tensors_is_refused_unless_not_strict(comm, tmp_path):
    model = GPT(TINY_GPT, seed=0)
    path = tmp_path / "extra.safetensors"
    safetensors.numpy.save_file({**model.state_dict(), "extra.weight": np.ones(3, np.float32)}, path)
    with pytest.raises(CheckpointError, match=r"unexpected extra.weight \(strict=False ignores it\)"):
        load_safetensors(path, GPT(TINY_GPT, seed=1))
    other = GPT(TINY_GPT, seed=1)
    load_safetensors(path, other, strict=False)
    assert all(np.array_equal(other.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_failed_save_leaves_nothing_behind_and_fails_on_every_rank(comm, tmp_path, monkeypatch):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    on_rank_0(comm, lambda: open(f"{root}/a-file", "w").write("mine"))
    with pytest.raises(CheckpointError, match="it exists and is not a directory"):
        save(f"{root}/a-file", model, opt)
    with pytest.raises(CheckpointError, match="Not a directory"):
        save(f"{root}/a-file/ck", model, opt)
    save(f"{root}/ck", model, opt, {"step": 1})

    import mpifsdp.checkpoint.sharded as ck

    writer = ck._write_rank_file

    def disk_full_on_the_last_rank(*args):
        if comm.rank == comm.size - 1:
            raise OSError(28, "No space left on device")
        return writer(*args)

    monkeypatch.setattr(ck, "_write_rank_file", disk_full_on_the_last_rank)
    with pytest.raises(CheckpointError, match=rf"rank {comm.size - 1}: \[Errno 28\] No space left on device"):
        save(f"{root}/ck", model, opt, {"step": 2})
    comm.barrier()
    left = sorted(os.listdir(root))  # and the writer lock of ck this job holds (none for a-file)
    agree(comm, left == [".ck.mpifsdp-writer.lock", "a-file", "ck"], f"left behind: {left}")
    assert open(f"{root}/a-file").read() == "mine"
    assert (
        load(f"{root}/ck", *sharded_tiny_gpt(comm, seed=3))["step"] == 1
    )  # the earlier checkpoint is intact


def test_saving_into_a_directory_of_other_files_is_refused(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    on_rank_0(comm, lambda: (os.makedirs(f"{root}/notes"), open(f"{root}/notes/todo.txt", "w").write("x")))
    with pytest.raises(CheckpointError, match="it holds files that are not a checkpoint.s .todo.txt."):
        save(f"{root}/notes", *sharded_tiny_gpt(comm))
    assert os.listdir(f"{root}/notes") == ["todo.txt"]


def test_the_command_line_names_every_problem_without_a_traceback(comm, tmp_path):
    if comm.size > 1:
        pytest.skip("runs single-process commands: the plain-pytest pass covers it")
    model, opt = sharded_tiny_gpt(comm)
    save_step(tmp_path / "run", 1, model, opt)
    save_step(tmp_path / "run", 2, model, opt)
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "manifest.json").write_bytes(os.urandom(50))

    def cli(*args):
        done = subprocess.run(
            [sys.executable, "-m", "mpifsdp", *map(str, args)], capture_output=True, text=True
        )
        assert "Traceback" not in done.stderr, done.stderr
        return done.returncode, done.stdout + done.stderr

    rc, out = cli("inspect", tmp_path / "run")  # a root: its newest step-N checkpoint
    assert rc == 0 and "step-00000002: mpifsdp-checkpoint v2" in out and "integrity: OK" in out
    for target, why in [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "holds no checkpoint"),
        (tmp_path / "garbage", "not a valid checkpoint"),
    ]:
        rc, out = cli("inspect", target)
        assert rc == 1 and why in out, out
    for out_path, why in [
        (tmp_path / "nowhere" / "m.safetensors", "does not exist: create it first"),
        (tmp_path / "empty", "is a directory"),
    ]:
        rc, out = cli("export", tmp_path / "run", out_path)
        assert rc == 1 and why in out, out
    assert cli("export", tmp_path / "run", tmp_path / "m.safetensors")[0] == 0
    rc, out = cli("export", tmp_path / "run", tmp_path / "m.safetensors")
    assert rc == 1 and "pass --force to replace it" in out
    assert cli("export", tmp_path / "run", tmp_path / "m.safetensors", "--force")[0] == 0
    safetensors.numpy.load_file(tmp_path / "m.safetensors")
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]  # failed exports left nothing
    old_name = subprocess.run(  # it once exited 0 having checked nothing; now it is no command at all
        [sys.executable, "-m", "mpifsdp.checkpoint", "inspect", tmp_path / "run"],
        capture_output=True,
        text=True,
    )
    assert old_name.returncode != 0 and "cannot be directly executed" in old_name.stderr, old_name.stderr


@pytest.mark.parametrize("where", ["export", "atomic_file"])
def test_a_write_killed_by_sigterm_leaves_no_temporary_file(comm, tmp_path, where):
    """A scheduler's SIGTERM in the middle of writing: the process still ends by that signal, the file
    it replaced is as it was, and no hidden temporary copy is left in the user's directory."""
    if comm.size > 1:
        pytest.skip("runs a single-process job: the plain-pytest pass covers it")
    script = tmp_path / "killed.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal
        import mpifsdp.checkpoint.consolidated as consolidated
        from mpifsdp.base.files import atomic_file
        from mpifsdp.checkpoint.consolidated import export_safetensors
        from mpifsdp.models import GPT
        from mpifsdp import Comm, fully_shard
        from support import TINY_GPT

        def killed(*args):
            os.kill(os.getpid(), signal.SIGTERM)

        model = GPT(TINY_GPT)
        fully_shard(model, Comm(), units=model.blocks)
        if {where!r} == "export":
            consolidated._write_pieces = killed
            export_safetensors("{tmp_path}/m.safetensors", model)
        else:
            with atomic_file("{tmp_path}/m.safetensors") as f:
                f.write(b"partial")
                killed()
        """)
    )
    (tmp_path / "m.safetensors").write_bytes(b"the user's earlier file")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run([sys.executable, script], env=env, capture_output=True, timeout=120)
    assert result.returncode == -15, result.stderr.decode()[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["killed.py", "m.safetensors"]
    assert (tmp_path / "m.safetensors").read_bytes() == b"the user's earlier file"


@pytest.mark.parametrize("disposition", ["ignored", "graceful"])
def test_a_sigterm_that_does_not_end_the_process_leaves_the_write_going_on(comm, tmp_path, disposition):
    """Under nohup (SIGTERM ignored) or a handler of the user's that stops gracefully, the process goes
    on after the signal: the clean-up removed the temporary file anyway and the write then failed
    with "No such file", the export lost. The file is written whole, the user's handler ran."""
    if comm.size > 1:
        pytest.skip("runs a single-process job: the plain-pytest pass covers it")
    script = tmp_path / "signalled.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal
        import mpifsdp.checkpoint.consolidated as consolidated
        from mpifsdp.checkpoint.consolidated import export_safetensors
        from mpifsdp.models import GPT
        from mpifsdp import Comm, fully_shard
        from support import TINY_GPT

        asked = []
        if {disposition!r} == "ignored":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            signal.signal(signal.SIGTERM, lambda number, frame: asked.append(number))
        write = consolidated._write_pieces

        def signalled(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            return write(*args, **kwargs)

        model = GPT(TINY_GPT)
        fully_shard(model, Comm(), units=model.blocks)
        consolidated._write_pieces = signalled
        export_safetensors("{tmp_path}/m.safetensors", model)
        assert signal.getsignal(signal.SIGTERM) is not None
        print("exported; the handler saw", asked, flush=True)
        """)
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run([sys.executable, script], env=env, capture_output=True, timeout=120, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("[15]" if disposition == "graceful" else "[]") in result.stdout, result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "signalled.py"]
    assert safetensors.numpy.load_file(tmp_path / "m.safetensors")  # whole


def test_an_exported_file_is_one_the_reference_reader_accepts(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, _ = sharded_tiny_gpt(comm)
    export_safetensors(f"{root}/m.safetensors", model)
    assert set(safetensors.numpy.load_file(f"{root}/m.safetensors")) == set(full_state_dict(model))


def test_a_users_units_checkpoint_and_export_like_a_model(comm, tmp_path):
    """The framework-free path: a list of Units (and their AdamW) saves, loads at another world size,
    and exports, with the same atomicity and checksums as a sharded model."""

    from mpifsdp import AdamW, Unit, full_state_dict

    root = shared_dir(comm, tmp_path)

    def units(c, seed):
        rng = np.random.default_rng(seed)
        return [Unit("a", {"w": rng.standard_normal((5, 3))}, c), Unit("b", {"v": rng.standard_normal(7)}, c)]

    mine = units(comm, 0)
    opt = AdamW(mine, lr=1e-2)
    for unit in mine:
        with unit.unsharded() as p:
            grads = {name: np.cos(value) for name, value in p.items()}
        unit.reduce_grad(grads)
    opt.step()
    save_step(root, 1, mine, opt)
    export_safetensors(f"{root}/u.safetensors", mine)
    want = full_state_dict(mine)
    # collective: before the sub-communicator part
    first_moment = mine[0].gather(opt.state_of(mine[0])["exp_avg"])["w"]
    small = sub_comm(1)  # world rank 0 alone: another world size
    if small is not None:
        other = units(small, 1)
        other_opt = AdamW(other, lr=1e-2)
        path, extra = load_latest(root, other, other_opt)
        got = full_state_dict(other)
        assert extra["step"] == 1 and all(np.array_equal(got[k], want[k]) for k in want)
        assert list(other_opt.summary()["group_steps"].values()) == [1, 1]
        assert np.array_equal(other[0].gather(other_opt.state_of(other[0])["exp_avg"])["w"], first_moment)
    again = units(comm, 2)
    load_safetensors(f"{root}/u.safetensors", again)
    got = full_state_dict(again)
    agree(comm, all(np.array_equal(got[k], want[k]) for k in want), "safetensors round trip of units differs")


def test_sgd_momentum_is_checkpointed_and_another_optimizer_is_refused(comm, tmp_path):
    from mpifsdp import SGD

    root = shared_dir(comm, tmp_path)
    model, _ = sharded_tiny_gpt(comm)
    opt = SGD(model, lr=0.1, momentum=0.9, nesterov=True)
    train(model, opt, comm, 2)
    path = save(f"{root}/c", model, opt, {"step": 2})
    other, _ = sharded_tiny_gpt(comm, seed=4)
    other_opt = SGD(other, lr=0.1, momentum=0.9, nesterov=True)
    load(path, other, other_opt)
    same = all(
        np.array_equal(opt.state_of(a)["momentum_buffer"], other_opt.state_of(b)["momentum_buffer"])
        for a, b in zip(opt.groups, other_opt.groups)
    )
    same_steps = other_opt.summary()["group_steps"] == opt.summary()["group_steps"]
    agree(comm, same and same_steps, "momentum buffers or steps differ after loading")
    with pytest.raises(CheckpointError, match="holds the state of SGD, the optimizer given is AdamW"):
        load(path, *sharded_tiny_gpt(comm, seed=4))


SECOND_WRITER = textwrap.dedent(
    """
    import sys
    from mpifsdp import AdamW, Comm, fully_shard
    from mpifsdp import checkpoint
    from mpifsdp.models import GPT, GPTConfig

    comm = Comm()
    model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10), seed=0)
    fully_shard(model, comm, units=model.blocks)
    try:
        checkpoint.save_step(sys.argv[1], 2, model, AdamW(model, lr=1e-3), keep=0)
    except checkpoint.CheckpointError as exc:
        print(f"rank {comm.rank} refused: {exc}", flush=True)
        sys.exit(3)
    print("SAVED", flush=True)
    """
)


def test_a_second_job_saving_into_the_same_root_is_refused_at_its_first_save(comm, tmp_path):
    """Two jobs saving into one root removed each other's saves in progress and replaced each other's
    checkpoints: a save that returned normally could be gone. The first job's writer lock refuses the
    second at its first save, on every rank, naming the owner; the first job's checkpoints stay."""
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    model, opt = sharded_tiny_gpt(comm)
    root = tmp_path / "ckpts"
    save_step(root, 1, model, opt, keep=0)  # this process now holds root's writer lock
    script = tmp_path / "second.py"
    script.write_text(SECOND_WRITER)
    result, elapsed = run_job(script, 2, root, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 3 and elapsed < 60, out[-2000:]
    owner = rf"being written by another job \(host \S+, pid {os.getpid()},"
    for rank in (0, 1):
        assert re.search(rf"rank {rank} refused: .*{owner}", out, re.S), out
    assert sorted(p.name for p in root.iterdir()) == [lock.SUFFIX, "step-00000001"]  # no trace of the second
    assert load(root / "step-00000001", *sharded_tiny_gpt(comm, seed=4))["step"] == 1
    lock.release(lock.root_lock(root))
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]


def test_a_dead_owner_does_not_keep_the_lock(comm, tmp_path, monkeypatch, caplog):
    """Same host: an owner pid that no longer runs is taken over at once. Another host: a lock not
    refreshed for MPIFSDP_LOCK_STALE_S is; a fresh one is refused."""
    root = Path(shared_dir(comm, tmp_path)) / "ckpts"
    model, opt = sharded_tiny_gpt(comm)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    owners = {"dead": (socket.gethostname(), int(gone.stdout)), "elsewhere": ("another-host", 1)}

    def plant(host, pid, age_s=0.0):
        def write():
            root.mkdir(parents=True, exist_ok=True)
            lock.root_lock(root).write_text(json.dumps({"host": host, "pid": pid, "since": 0, "token": "x"}))
            os.utime(lock.root_lock(root), (time.time() - age_s, time.time() - age_s))

        on_rank_0(comm, write)

    plant(*owners["dead"])
    with caplog.at_level("WARNING"):
        save_step(root, 1, model, opt)  # taken over
    assert comm.rank != 0 or "taking over" in caplog.text
    lock.release(lock.root_lock(root))
    plant(*owners["elsewhere"])
    with pytest.raises(CheckpointError, match=r"being written by another job \(host another-host, pid 1,"):
        save_step(root, 2, model, opt)
    monkeypatch.setenv("MPIFSDP_LOCK_STALE_S", "3600")
    plant(*owners["elsewhere"], age_s=7200)
    save_step(root, 2, model, opt)  # not refreshed for two hours: its job is gone
    agree(comm, [p.name for p in checkpoints(root)] == ["step-00000002", "step-00000001"], "both saved")
    lock.release(lock.root_lock(root))


def test_weights_loaded_into_a_model_with_other_settings_are_refused(comm, tmp_path):
    """Another head count over the same shapes computes another function from the same weights: the
    checkpoint names the settings it was saved with, and load and load_params refuse others."""
    from mpifsdp import AdamW, fully_shard
    from mpifsdp.checkpoint.consolidated import load_params

    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    save(f"{root}/ck", model, opt)
    other = GPT(dataclasses.replace(TINY_GPT, n_head=1), seed=1)
    fully_shard(other, comm, units=other.blocks)
    for loading in (
        lambda: load(f"{root}/ck", other, AdamW(other)),
        lambda: load_params(f"{root}/ck", other),
    ):
        with pytest.raises(
            CheckpointError, match=r"other settings \(blocks\.0\.attn\.n_head: saved 2, the model's 1"
        ):
            loading()
    assert load(f"{root}/ck", *sharded_tiny_gpt(comm, seed=5)) == {}  # the same settings load


def test_the_lock_staleness_setting_is_checked_and_a_removed_lock_is_taken_again(comm, tmp_path, monkeypatch):
    """MPIFSDP_LOCK_STALE_S of words failed as a float conversion naming no variable, a negative one
    took over a live job's lock at once, NaN never took over a dead one; a lock a clean-up script
    deleted stopped the running job with "another job took over"."""
    root = Path(shared_dir(comm, tmp_path)) / "ckpts"
    model, opt = sharded_tiny_gpt(comm)

    def plant():
        root.mkdir(parents=True, exist_ok=True)
        lock.root_lock(root).write_text(
            json.dumps({"host": "another-host", "pid": 1, "since": 0, "token": "x"})
        )

    for value in ("six hours", "-1", "0", "nan", "inf"):
        on_rank_0(comm, plant)
        monkeypatch.setenv("MPIFSDP_LOCK_STALE_S", value)
        with pytest.raises(CheckpointError, match=rf"MPIFSDP_LOCK_STALE_S='{value}': give the age"):
            save_step(root, 1, model, opt)
    monkeypatch.delenv("MPIFSDP_LOCK_STALE_S")
    on_rank_0(comm, lambda: lock.root_lock(root).unlink())
    save_step(root, 1, model, opt)  # this job holds the lock now
    on_rank_0(comm, lambda: lock.root_lock(root).unlink())  # a clean-up script removes it
    save_step(root, 2, model, opt)  # taken again, not "taken over"
    assert comm.rank != 0 or json.loads(lock.root_lock(root).read_text())["pid"] == os.getpid()
    agree(comm, [p.name for p in checkpoints(root)] == ["step-00000002", "step-00000001"], "both saved")

    def taken_over_then_released():  # another job found this one's lock stale, saved, and ended
        path = lock.root_lock(root)
        lock._move_aside(path, json.loads(path.read_text()))

    on_rank_0(comm, taken_over_then_released)
    with pytest.raises(CheckpointError, match="another job took over this job's lock .* and has ended since"):
        save_step(root, 3, model, opt)
    agree(comm, [p.name for p in checkpoints(root)] == ["step-00000002", "step-00000001"], "none written")


KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from mpifsdp import Comm, Unit
    from mpifsdp.checkpoint import save_step
    comm = Comm()
    unit = Unit("fit", {"w": np.arange(6.0)}, comm)
    save_step(sys.argv[1], int(sys.argv[2]), [unit])
    print("saved", sys.argv[2], flush=True)
    if sys.argv[3] == "killed":
        os.kill(os.getpid(), signal.SIGTERM)  # preempted: no exit handler runs, the lock stays
    """
)


def test_a_preempted_job_requeued_on_another_node_saves_at_once(comm, tmp_path):
    """A job ended by SIGTERM left its writer lock; requeued, its rank 0 landed on another node and
    its first save was refused for up to 6 hours. A lock that names this very Slurm job is its own
    earlier run's; one naming a job squeue says is over is taken too; a live job's is refused."""
    if comm.size > 1:
        pytest.skip("runs single-process jobs: the plain-pytest pass covers it")
    root, script = tmp_path / "ckpts", tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "OMPI_COMM"))}
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])

    def run(step, how, job, **more):
        env = {**clean, "PYTHONPATH": path, "SLURM_JOB_ID": job, **more}
        return subprocess.run([sys.executable, script, root, str(step), how], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    first = run(1, "killed", "77")
    assert first.returncode == -15 and "saved 1" in first.stdout, first.stderr[-2000:]
    held = json.loads(lock.root_lock(root).read_text())
    assert held["slurm_job"] == "77"
    lock.root_lock(root).write_text(json.dumps({**held, "host": "node-7"}))  # it ran on another node

    refused = run(2, "ends", "78")  # another job: no squeue here, and the lock is fresh
    assert refused.returncode != 0 and "is being written by another job (host node-7" in refused.stderr
    requeued = run(2, "ends", "77")  # the same job, requeued
    assert requeued.returncode == 0 and "saved 2" in requeued.stdout, requeued.stderr[-2000:]

    lock.root_lock(root).write_text(json.dumps({**held, "host": "node-7", "slurm_job": "70"}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for states, code, taken in (("RUNNING", 0, False), ("", 0, True)):
        (bin_dir / "squeue").write_text(f"#!/bin/sh\necho '{states}'\nexit {code}\n")
        (bin_dir / "squeue").chmod(0o755)
        result = run(3, "ends", "78", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        assert (result.returncode == 0) == taken, result.stderr[-2000:]  # over: taken; running: refused
    assert [p.name for p in checkpoints(root)] == ["step-00000003", "step-00000002", "step-00000001"]
