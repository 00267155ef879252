"""Checkpoints and weights from elsewhere stay inside their fence (docs/checkpoint.md, Security).

Each crafted checkpoint would load, with another model's values, if its names were followed: the
manifest points at a complete, checksummed copy outside the checkpoint. Loading must refuse it, say
which name was refused, and leave the model as it was."""

import json
import os
import shutil
import struct

import numpy as np
import pytest

from mpifsdp import full_state_dict
from mpifsdp.checkpoint import CheckpointError, checkpoints, load, save, save_step
from mpifsdp.checkpoint.consolidated import export_safetensors, load_safetensors
from mpifsdp.checkpoint.manifest import with_digest

from support import agree, on_rank_0, sharded_tiny_gpt, shared_dir, train


def _two_checkpoints(comm, tmp_path):
    """`ck` (the one we load) and `elsewhere` (a valid checkpoint of other values, outside it)."""
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    ck = save(f"{root}/ck", model, opt)
    other, other_opt = sharded_tiny_gpt(comm, seed=3)
    train(other, other_opt, comm, 1)
    elsewhere = save(f"{root}/elsewhere", other, other_opt)
    return root, ck, elsewhere


def _rewrite(path, change):
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(with_digest(manifest)))


def _point_files_at(ck, elsewhere, name_of):
    """ck's manifest takes elsewhere's file records (sizes, checksums), each renamed by name_of."""
    theirs = json.loads((elsewhere / "manifest.json").read_text())

    def change(manifest):
        manifest["files"] = [{**record, "name": name_of(record["name"])} for record in theirs["files"]]

    _rewrite(ck, change)


def _refused(comm, path, why: str):
    """Loading `path` raises CheckpointError naming `why`, and the model keeps its own values."""
    model, opt = sharded_tiny_gpt(comm, seed=7)
    before = full_state_dict(model)
    with pytest.raises(CheckpointError, match=why) as caught:
        load(path, model, opt)
    after = full_state_dict(model)
    agree(comm, all(np.array_equal(before[k], after[k]) for k in before), "a refused load changed the model")
    return str(caught.value)


@pytest.mark.parametrize(
    "name_of",
    [
        lambda name: f"../elsewhere/{name}",
        lambda name: f"{{root}}/elsewhere/{name}",  # absolute
        lambda name: f"{name}\0.txt",
        lambda name: "..",
        lambda name: "",
    ],
    ids=["dot-dot", "absolute", "nul", "parent", "empty"],
)
def test_a_manifest_names_only_plain_files_in_its_checkpoint(comm, tmp_path, name_of):
    root, ck, elsewhere = _two_checkpoints(comm, tmp_path)
    rename = lambda name: name_of(name).replace("{root}", root)  # noqa: E731
    on_rank_0(comm, lambda: _point_files_at(ck, elsewhere, rename))
    message = _refused(comm, ck, "is not a plain file name in the checkpoint")
    assert "bytes" not in message and "missing" not in message  # nothing learnt about the outside


def test_a_link_out_of_the_checkpoint_is_refused_and_one_inside_is_followed(comm, tmp_path):
    root, ck, elsewhere = _two_checkpoints(comm, tmp_path)

    def link_out():
        _point_files_at(ck, elsewhere, lambda name: name)
        for record in json.loads((ck / "manifest.json").read_text())["files"]:
            (ck / record["name"]).unlink()
            (ck / record["name"]).symlink_to(elsewhere / record["name"])

    on_rank_0(comm, link_out)
    message = _refused(comm, ck, "leads out of the checkpoint")
    assert "elsewhere" not in message  # where the link leads is not told

    def link_inside():  # the same bytes, copied in, reached through a link inside the checkpoint
        for link in ck.glob("rank-*.bin"):
            shutil.copy(elsewhere / link.name, ck / f"data-{link.name}")
            link.unlink()
            link.symlink_to(f"data-{link.name}")

    on_rank_0(comm, link_inside)
    model, opt = sharded_tiny_gpt(comm, seed=7)
    load(ck, model, opt)
    other, _ = sharded_tiny_gpt(comm, seed=7)
    load(elsewhere, other, None)
    want, got = full_state_dict(other), full_state_dict(model)
    agree(comm, all(np.array_equal(want[k], got[k]) for k in want), "a link inside was not followed")


def test_a_linked_manifest_is_refused(comm, tmp_path):
    root, ck, elsewhere = _two_checkpoints(comm, tmp_path)

    def link_manifest():
        (ck / "manifest.json").unlink()
        (ck / "manifest.json").symlink_to(elsewhere / "manifest.json")

    on_rank_0(comm, link_manifest)
    _refused(comm, ck, "'manifest.json' leads out of the checkpoint")


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda m: m["units"][0]["tensors"][0].update(shape=[2**40, 2**40]), "offset .*, expected"),
        (lambda m: m["units"][0]["tensors"][0].update(shape=[2**32, 2**32, 0]), "offset"),
        (lambda m: m["files"][0].update(bytes=2**62), "truncated or overwritten"),
        (lambda m: m["files"][0]["segments"][0].update(stop=2**62), "outside unit"),
        (lambda m: m["files"][0]["segments"][0].update(offset=2**62), "runs past the file's end"),
        (lambda m: m.update(world_size=2**70), None),  # informational only: loads
    ],
    ids=["shape", "zero-size-shape", "file-bytes", "slice-stop", "slice-offset", "world-size"],
)
def test_huge_numbers_in_a_manifest_are_refused_before_any_allocation(comm, tmp_path, change, why):
    root, ck, _ = _two_checkpoints(comm, tmp_path)
    on_rank_0(comm, lambda: _rewrite(ck, change))
    if why is None:
        load(ck, *sharded_tiny_gpt(comm, seed=7))
    else:
        _refused(comm, ck, why)


def test_an_oversized_manifest_is_refused_unread(comm, tmp_path, monkeypatch):
    import mpifsdp.checkpoint.manifest

    root, ck, _ = _two_checkpoints(comm, tmp_path)
    monkeypatch.setattr(mpifsdp.checkpoint.manifest, "MAX_MANIFEST", 100)
    _refused(comm, ck, "a manifest of .* bytes, more than any checkpoint writes")


def _header_file(path, header: dict, data: bytes = b""):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    "write, why",
    [
        (lambda p: p.write_bytes(struct.pack("<Q", 2**60) + b"{}"), "a header of 1152921504606846976 bytes"),
        (
            lambda p: _header_file(
                p, {"w": {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}}
            ),
            "do not hold",
        ),
    ],
    ids=["header-length", "shape-overflow"],
)
def test_crafted_safetensors_headers_are_refused(comm, tmp_path, write, why):
    model, _ = sharded_tiny_gpt(comm, seed=7)
    path = tmp_path / "crafted.safetensors"
    write(path)
    with pytest.raises(CheckpointError, match=f"not a valid safetensors file: .*{why}"):
        load_safetensors(path, model)


def test_pruning_deletes_only_what_a_checkpoint_is_made_of_and_follows_no_link(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    precious = save(f"{root}/precious", model, opt)  # a checkpoint outside the pruned set

    def plant():
        os.makedirs(f"{root}/steps", exist_ok=True)
        os.symlink(precious, f"{root}/steps/step-00000000")  # looks like an old step, leads out

    on_rank_0(comm, plant)
    save_step(f"{root}/steps", 1, model, opt, keep=1)
    on_rank_0(comm, lambda: open(f"{root}/steps/step-00000001/notes.txt", "w").write("mine"))
    save_step(f"{root}/steps", 2, model, opt, keep=1)
    save_step(f"{root}/steps", 3, model, opt, keep=1)
    assert [p.name for p in checkpoints(f"{root}/steps")] == ["step-00000003"]
    assert sorted(os.listdir(f"{root}/steps/step-00000001")) == ["notes.txt"]  # the user's file stays
    assert sorted(os.listdir(precious)) == sorted(
        ["manifest.json"] + [f"rank-{r:05d}.bin" for r in range(comm.size)]
    )


def test_a_save_never_overwrites_a_users_file_or_a_link(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    ck = save(f"{root}/ck", model, opt)
    on_rank_0(comm, lambda: (ck / "notes.txt").write_text("mine"))
    with pytest.raises(CheckpointError, match=r"holds files that are not a checkpoint's \(notes.txt\)"):
        save(ck, model, opt)
    on_rank_0(comm, lambda: os.symlink(ck, f"{root}/link"))
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        save(f"{root}/link", model, opt)
    assert (ck / "notes.txt").read_text() == "mine" and os.path.islink(f"{root}/link")
    export_safetensors(f"{root}/m.safetensors", model)  # the safe path still works
