"""Checkpoints: save at N, load at M (all pairs the world allows), resume, crash safety, corruption,
safetensors round trip, and the memory bound while loading."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mpifsdp import full_state_dict, fully_shard, no_grad, sharded_model
from mpifsdp.checkpoint import (
    CheckpointError,
    checkpoints,
    load,
    load_latest,
    save,
    save_step,
    verify,
)
from mpifsdp.checkpoint.consolidated import export_safetensors, load_safetensors
from mpifsdp.models import GPT, GPTConfig

from support import (
    TINY_GPT,
    agree,
    mpiexec,
    run_launched,
    sharded_tiny_gpt,
    shared_dir,
    sub_comm,
    tiny_batch,
    train,
)


def full_moments(model, opt):
    out = {}
    for unit in opt.groups:
        state = opt.state_of(unit)
        for kind, arr in (("m", state["exp_avg"]), ("v", state["exp_avg_sq"])):
            out.update({f"{kind}:{n}": a.copy() for n, a in unit.gather(arr).items()})
    return out


def test_save_at_n_load_at_m_is_bit_identical(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    W = comm.size
    for n in range(1, W + 1):
        c = sub_comm(n)
        expected = None
        if c is not None:
            model, opt = sharded_tiny_gpt(c)
            train(model, opt, c, 2)
            save(f"{root}/n{n}", model, opt, extra={"data_position": 2})
            expected = {**full_state_dict(model), **full_moments(model, opt)}
        expected = comm.mpi.bcast(expected)  # world rank 0 is in every sub-world
        for m in range(1, W + 1):
            c = sub_comm(m)
            ok, message = True, ""
            if c is not None:
                model, opt = sharded_tiny_gpt(
                    c, seed=99
                )  # different weights: the load must overwrite them all
                extra = load(f"{root}/n{n}", model, opt)
                got = {**full_state_dict(model), **full_moments(model, opt)}
                bad = [k for k in expected if not np.array_equal(expected[k], got[k])]
                ok = not bad and extra["data_position"] == 2 and opt.step_count == 2
                message = f"saved at {n}, loaded at {m}: differs in {bad[:3]}"
            agree(comm, ok, message)


def test_resume_gives_identical_losses(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm, dtype=np.float64)
    train(model, opt, comm, 3)
    save_step(root, 3, model, opt)
    uninterrupted = train(model, opt, comm, 3, first=3)

    resumed_model, resumed_opt = sharded_tiny_gpt(comm, seed=5, dtype=np.float64)
    path, extra = load_latest(root, resumed_model, resumed_opt)
    resumed = train(resumed_model, resumed_opt, comm, 3, first=extra["step"])
    agree(comm, resumed == uninterrupted, f"{resumed} != {uninterrupted}")

    # at another world size (1 rank), the same losses up to floating-point reduction order
    c = sub_comm(1)
    if c is not None:
        other, other_opt = sharded_tiny_gpt(c, seed=6, dtype=np.float64)
        load(path, other, other_opt)
        elsewhere = train(other, other_opt, c, 3, first=3)
        # float64 losses; only the order of the sums over ranks differs (measured <= 2.5e-16 relative
        # at N = 2..4 under three BLAS kernels): 1e-10 is far above that and far below a wrong resume.
        np.testing.assert_allclose(elsewhere, uninterrupted, rtol=1e-10)


def test_keep_last_k_and_latest_falls_back_past_a_corrupted_one(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    for step in (1, 2, 3, 4):
        train(model, opt, comm, 1, first=step)
        save_step(root, step, model, opt, keep=2)
    names = [p.name for p in checkpoints(root)]
    assert names == ["step-00000004", "step-00000003"]
    comm.mpi.Barrier()
    if comm.rank == 0:  # flip one byte of the newest checkpoint's first file
        f = checkpoints(root)[0] / "rank-00000.bin"
        data = bytearray(f.read_bytes())
        data[5] ^= 0xFF
        f.write_bytes(bytes(data))
    comm.mpi.Barrier()
    fresh, fresh_opt = sharded_tiny_gpt(comm, seed=7)
    path, extra = load_latest(root, fresh, fresh_opt)
    assert path.name == "step-00000003" and extra["step"] == 3


def test_truncated_missing_and_corrupted_files_are_refused_by_name(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    train(model, opt, comm, 1)
    save(f"{root}/ck", model, opt)
    comm.mpi.Barrier()
    target = f"{root}/ck/rank-{comm.size - 1:05d}.bin"
    original = open(target, "rb").read() if comm.rank == 0 else None

    def damaged(change, expect):
        if comm.rank == 0:
            change()
        comm.mpi.Barrier()
        with pytest.raises(CheckpointError, match=expect):
            load(f"{root}/ck", *sharded_tiny_gpt(comm, seed=3))
        comm.mpi.Barrier()
        if comm.rank == 0:
            with open(target, "wb") as f:
                f.write(original)
        comm.mpi.Barrier()

    name = f"rank-{comm.size - 1:05d}.bin"
    damaged(lambda: os.truncate(target, len(original) - 4), f"{name} is truncated")
    damaged(lambda: open(target, "r+b").write(b"\x00\x01\x02\x03"), f"{name} is corrupted")
    damaged(lambda: os.remove(target), f"{name} is missing")
    load(f"{root}/ck", *sharded_tiny_gpt(comm, seed=3))  # restored: loads again
    with pytest.raises(CheckpointError, match="does not fit this model"):
        other = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=12))
        fully_shard(other, comm, units=other.blocks)
        load(f"{root}/ck", other)


def test_loading_holds_at_most_one_unit_beyond_the_shards(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    train(model, opt, comm, 1)
    save(f"{root}/ck", model, opt)
    fresh, fresh_opt = sharded_tiny_gpt(comm, seed=1)
    ledger = sharded_model(fresh).ledger
    load(f"{root}/ck", fresh, fresh_opt)
    largest = max(u.layout.numel for u in sharded_model(fresh).units) * 4
    assert 0 < ledger.peak["checkpoint_io"] <= largest and ledger.current["checkpoint_io"] == 0


def test_safetensors_round_trip(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    train(model, opt, comm, 2)
    path = export_safetensors(f"{root}/model.safetensors", model)
    want = full_state_dict(model)
    if comm.rank == 0:
        from safetensors.numpy import load_file  # the reference reader (a test dependency)

        tensors = load_file(str(path))
        assert sorted(tensors) == sorted(want)
        assert all(np.array_equal(tensors[k], want[k]) for k in want)
    plain = GPT(TINY_GPT, seed=42)  # a fresh single-process model
    load_safetensors(path, plain)
    x, y = tiny_batch(0, comm)
    with no_grad():
        agree(comm, all(np.array_equal(plain.state_dict()[k], want[k]) for k in want), "params differ")
        loss_plain = plain(x, y).item()
        loss_sharded = model(x, y).item()
    assert loss_plain == loss_sharded
    again, _ = sharded_tiny_gpt(comm, seed=9)
    load_safetensors(path, again)
    agree(
        comm, all(np.array_equal(full_state_dict(again)[k], want[k]) for k in want), "sharded import differs"
    )


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import mpifsdp.checkpoint.sharded as ck
    from mpifsdp import AdamW, Comm, fully_shard
    from mpifsdp.models import GPT, GPTConfig

    root, mode = sys.argv[1], sys.argv[2]  # mode: "new" (step-2 beside step-1) or "overwrite" (one name)
    comm = Comm()
    model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10), seed=0)
    fully_shard(model, comm, units=model.blocks)
    opt = AdamW(model, lr=1e-2)
    x = np.zeros((2, 8), dtype=np.int64)
    model(x, x).backward(); opt.step(); opt.zero_grad()
    save = (lambda step: ck.save_step(root, step, model, opt)) if mode == "new" else (
        lambda step: ck.save(f"{root}/ck", model, opt, {"step": step}))
    save(1)
    model(x, x).backward(); opt.step(); opt.zero_grad()
    original = ck._write_rank_file

    def dying(tmp, group, moments):  # rank 1 dies half-way through writing its file
        if group.comm.rank == 1:
            with open(tmp / "rank-00001.bin", "wb") as f:
                f.write(b"partial")
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(tmp, group, moments)

    ck._write_rank_file = dying
    save(2)
    """
)


def killed_during_save(comm, tmp_path, mode):
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    root = tmp_path / "ckpts"
    result = run_launched(
        [*mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", str(script), str(root), mode], timeout=120
    )
    assert result.returncode != 0
    return root


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint(comm, tmp_path):
    root = killed_during_save(comm, tmp_path, "new")
    assert [p.name for p in checkpoints(root)] == ["step-00000001"]
    assert list(root.glob("step-00000002.tmp-*")), "the partial save stays a temporary directory"
    verify(root / "step-00000001")
    model, opt = sharded_tiny_gpt(comm, seed=3)
    path, extra = load_latest(root, model, opt)
    assert path.name == "step-00000001" and opt.step_count == 1 and extra["step"] == 1


def test_a_rank_killed_while_overwriting_a_checkpoint_leaves_the_old_one(comm, tmp_path):
    root = killed_during_save(comm, tmp_path, "overwrite")
    model, opt = sharded_tiny_gpt(comm, seed=3)
    assert load(root / "ck", model, opt)["step"] == 1 and opt.step_count == 1


def test_extra_is_checked_on_every_rank_before_anything_is_written(comm, tmp_path):
    model, opt = sharded_tiny_gpt(comm)
    root = Path(shared_dir(comm, tmp_path))
    last = comm.rank == comm.size - 1  # one rank's bad extra fails the save on every rank
    bad = {"rng": np.arange(3)} if last else {}
    with pytest.raises(CheckpointError, match=r"extra holds a ndarray \(an array: pass \.tolist\(\)\)"):
        save(root / "ck", model, opt, extra=bad)
    agree(comm, not any(root.iterdir()), f"left behind: {sorted(root.iterdir())}")
    save(root / "ck", model, opt, extra={"step": np.int64(7), "loss": np.float32(0.5)})
    extra = load(root / "ck", model, opt)
    agree(comm, extra == {"step": 7, "loss": 0.5} and type(extra["step"]) is int, f"extra came back {extra}")


def test_a_checkpoint_without_optimizer_state_restarts_the_optimizer(comm, tmp_path, caplog):
    root = Path(shared_dir(comm, tmp_path))
    model, opt = sharded_tiny_gpt(comm)
    train(model, opt, comm, 1)
    save(root / "weights", model)  # the model alone
    train(model, opt, comm, 2)  # moments and step count of other parameters than the saved ones
    with caplog.at_level("WARNING", logger="mpifsdp.checkpoint.sharded"):
        load(root / "weights", model, opt)
    fresh_model, fresh_opt = sharded_tiny_gpt(comm, seed=5)
    load(root / "weights", fresh_model, fresh_opt)
    train(model, opt, comm, 1, first=3)
    train(fresh_model, fresh_opt, comm, 1, first=3)
    same = all(
        np.array_equal(a, b)
        for a, b in zip(full_state_dict(model).values(), full_state_dict(fresh_model).values())
    )
    agree(comm, same and opt.step_count == 1, f"step count {opt.step_count}: the old moments were kept")
    warned = "holds no optimizer state: AdamW starts from step 0" in caplog.text
    assert warned == (comm.rank == 0)


def test_an_export_that_cannot_be_written_leaves_nothing_behind(comm, tmp_path, monkeypatch):
    model, _ = sharded_tiny_gpt(comm)
    root = Path(shared_dir(comm, tmp_path))
    if comm.rank == 0:
        (root / "a_directory").mkdir()
    comm.barrier()
    with pytest.raises(CheckpointError, match="a_directory is a directory: give the .safetensors file"):
        export_safetensors(root / "a_directory", model)  # was refused only at the rename, after the writes
    with pytest.raises(CheckpointError, match="No such file or directory"):
        export_safetensors(root / "missing" / "m.safetensors", model)
    with pytest.raises(CheckpointError, match="`include` accepted none of the model's tensors"):
        export_safetensors(root / "m.safetensors", model, include=lambda name: False)  # was an empty file

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)  # the rename fails after every rank wrote its pieces
    with pytest.raises(CheckpointError, match="No space left on device"):
        export_safetensors(root / "m.safetensors", model)
    monkeypatch.undo()
    agree(comm, sorted(p.name for p in root.iterdir()) == ["a_directory"], f"left: {sorted(root.iterdir())}")


def test_cli_inspect_and_export(comm, tmp_path):
    if comm.size > 1:
        pytest.skip("runs single-process commands: the plain-pytest pass covers it")
    model, opt = sharded_tiny_gpt(comm)
    train(model, opt, comm, 1)
    save(tmp_path / "ck", model, opt, extra={"step": 1})
    run = [sys.executable, "-m", "mpifsdp"]
    out = subprocess.run([*run, "inspect", str(tmp_path / "ck")], capture_output=True, text=True)
    assert out.returncode == 0 and "integrity: OK" in out.stdout and "unit blocks.1" in out.stdout
    out = subprocess.run(
        [*run, "export", str(tmp_path / "ck"), str(tmp_path / "m.safetensors")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    plain = GPT(TINY_GPT, seed=1)
    load_safetensors(tmp_path / "m.safetensors", plain)
    want = full_state_dict(model)
    assert all(np.array_equal(plain.state_dict()[k], want[k]) for k in want)
    (tmp_path / "ck" / "rank-00000.bin").write_bytes(b"oops")
    out = subprocess.run([*run, "inspect", str(tmp_path / "ck")], capture_output=True, text=True)
    assert out.returncode == 1 and "rank-00000.bin is truncated" in out.stderr
    json.loads((tmp_path / "ck" / "manifest.json").read_text())  # the manifest is plain JSON


def as_version_1(path):
    """Rewrite a checkpoint as the first format version wrote it: no manifest checksum, no per-unit
    steps, and slice checksums over the bytes alone."""
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["optimizer"]["group_steps"], manifest["sha256"]
    manifest["version"] = 1
    for record in manifest["files"]:
        data = (path / record["name"]).read_bytes()
        for seg in record["segments"]:
            size = (seg["stop"] - seg["start"]) * np.dtype(manifest["units"][seg["unit"]]["dtype"]).itemsize
            seg["sha256"] = hashlib.sha256(data[seg["offset"] : seg["offset"] + size]).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_each_units_adamw_step_is_saved_and_old_checkpoints_load(comm, tmp_path):
    model, opt = sharded_tiny_gpt(comm)
    train(model, opt, comm, 2)
    steps = dict(zip(opt.summary()["group_steps"], [2, 1, 5]))  # as if first stepped at other times
    opt.restore({**opt.summary(), "group_steps": steps})
    path = save(f"{shared_dir(comm, tmp_path)}/ck", model, opt)
    other, other_opt = sharded_tiny_gpt(comm, seed=1)
    load(path, other, other_opt)
    got = other_opt.summary()
    agree(comm, got["group_steps"] == steps and got["step"] == 2, f"steps {got}")

    if comm.rank == 0:  # a checkpoint of the first format version: one step for all units
        as_version_1(path)
    comm.barrier()
    load(path, other, other_opt)
    got = other_opt.summary()["group_steps"]
    agree(comm, list(got.values()) == [2] * len(steps), f"old format gave steps {got}")


def test_a_missing_root_is_an_error_unless_the_caller_allows_it(comm, tmp_path):
    """load_latest("no_such_dir") was (None, None), as an empty root: a typo meant a silent fresh start."""
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    with pytest.raises(
        CheckpointError, match=r"no_such_dir does not exist: check the path, or pass missing_ok"
    ):
        load_latest(f"{root}/no_such_dir", model, opt)  # raised on every rank: rank 0 looked
    assert load_latest(f"{root}/no_such_dir", model, opt, missing_ok=True) == (None, None)
    assert load_latest(root, model, opt) == (None, None)  # it exists and is empty: a first run
    if comm.rank == 0:
        (Path(root) / "a-file").write_text("x")
    comm.barrier()
    with pytest.raises(CheckpointError, match="is not a directory of step-N checkpoints"):
        load_latest(f"{root}/a-file", model, opt, missing_ok=True)
