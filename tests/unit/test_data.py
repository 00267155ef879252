"""The stdlib corpus: cached once, deterministic, split, batches shifted by one."""

import numpy as np
import pytest

from mpifsdp.data import TextData, rank_slice, stdlib_corpus_path, unigram_entropy


def test_corpus_is_cached_and_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIFSDP_CACHE", str(tmp_path))
    path = stdlib_corpus_path()
    assert path.parent == tmp_path and path.stat().st_size > 1_000_000
    mtime = path.stat().st_mtime_ns
    assert stdlib_corpus_path() == path and path.stat().st_mtime_ns == mtime  # built once
    assert not list(tmp_path.glob("*.tmp-*"))  # atomic write leaves no temporary behind


def test_split_and_batches():
    data = TextData()
    train, val = data.splits["train"], data.splits["val"]
    assert len(train) + len(val) == len(data.tokens)
    assert abs(len(val) / len(data.tokens) - 0.1) < 1e-6
    x, y = data.global_batch("train", step=3, batch_size=4, block_size=16, seed=9)
    x2, _ = data.global_batch("train", step=3, batch_size=4, block_size=16, seed=9)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    assert x.dtype == np.int64 and x.shape == (4, 16)


def test_custom_file_and_errors(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"abcdefghij" * 10)
    data = TextData(f)
    assert len(data.tokens) == 100
    with pytest.raises(
        ValueError, match=r"t.txt: its val split has 10 tokens, not more than block_size\+1 = 65"
    ):
        data.batch("val", 1, 64, np.random.default_rng(0))
    data.check_fits(8)  # 90 train and 10 val tokens: both fit
    with pytest.raises(ValueError, match=r"its val split has 10 tokens.*val_fraction \(now 0.1\)"):
        data.check_fits(9)  # up front: the train split alone would fit
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TextData(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.txt is empty"):  # was "cannot mmap an empty file"
        TextData(tmp_path / "empty.txt")
    for bad, message in [
        (lambda: data.global_batch("test", 0, 2, 8), r"split 'test' is not one of \['train', 'val'\]"),
        (lambda: data.global_batch("train", 0, 0, 8), r"batch_size=0 \(must be an integer >= 1\)"),
        (lambda: data.global_batch("train", 0, 2, -5), r"block_size=-5"),
        (lambda: data.global_batch("train", 0, 2.5, 8), r"batch_size=2.5"),
        (lambda: data.global_batch("train", -1, 2, 8), r"step=-1 \(must be an integer >= 0\)"),
        (lambda: TextData(f, val_fraction=1.5), r"val_fraction 1.5 must be in \[0, 1\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            bad()


def test_rank_slice_and_entropy():
    a = np.arange(12).reshape(6, 2)
    assert rank_slice(a, 1, 3).tolist() == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="do not divide over 4 ranks: make it a multiple, or pass even"):
        rank_slice(a, 0, 4)
    assert rank_slice([1, 2, 3, 4], 1, 2) == [3, 4]  # any sequence with a length
    for rank, world, message in [(3, 3, "rank 3 is not below world_size 3"), (-1, 3, "rank=-1"),
                                 (0, 0, "world_size=0")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):  # not an empty or a wrong slice
            rank_slice(a, rank, world)
    with pytest.raises(ValueError, match="no axis to split"):
        rank_slice(np.float64(3.0), 0, 1)
    assert unigram_entropy(np.array([0, 1, 0, 1], dtype=np.uint8)) == pytest.approx(np.log(2))


def test_atomic_files_fsync_the_file_and_its_directory_and_leave_nothing_on_failure(tmp_path, monkeypatch):
    """base/files.atomic_file, the one writer of whole files: the data and the rename are durable
    (the directory is fsynced too), and a failed write leaves the old file and no temporary."""
    import os
    import stat

    from mpifsdp.base import files

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: synced.append(os.fstat(fd).st_mode) or real_fsync(fd))
    target = tmp_path / "out.bin"
    with files.atomic_file(target) as f:
        f.write(b"new")
    assert target.read_bytes() == b"new"
    assert [stat.S_ISREG(m) for m in synced] == [True, False] and stat.S_ISDIR(synced[1])
    with pytest.raises(RuntimeError), files.atomic_file(target) as f:
        f.write(b"half")
        raise RuntimeError("the writer failed")
    assert target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_an_empty_or_relative_xdg_cache_home_is_ignored(monkeypatch):
    """XDG_CACHE_HOME="" wrote the 31 MB corpus cache into the working directory."""
    from pathlib import Path

    from mpifsdp.data import cache_dir

    monkeypatch.delenv("MPIFSDP_CACHE", raising=False)
    for value in ("", "relative/dir"):
        monkeypatch.setenv("XDG_CACHE_HOME", value)
        assert cache_dir() == Path.home() / ".cache" / "mpifsdp"
    monkeypatch.setenv("XDG_CACHE_HOME", "/tmp/xdg")
    assert cache_dir() == Path("/tmp/xdg/mpifsdp")


def test_a_cache_that_names_a_file_is_named(monkeypatch, tmp_path):
    from mpifsdp.data import cache_dir

    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setenv("MPIFSDP_CACHE", str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match=r"MPIFSDP_CACHE=.*notes.txt is a file, not a directory"):
        cache_dir()
    assert (tmp_path / "notes.txt").read_text() == "mine"
