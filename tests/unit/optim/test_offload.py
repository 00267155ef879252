"""offload="disk" (optim/offload.py DiskStates): an optimizer's states in files under a directory of
the user's, mapped a unit at a time. The bits of in-memory training at every N (clipping, gradient
accumulation, a frozen parameter, AdamW and SGD with momentum, a checkpoint saved with offload and
resumed without, and back); the files made, this rank's own, and removed; a model whose states
exceed an address-space limit trains on disk to the same bits; what cannot work refused by name."""

import fcntl
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mpifsdp
from mpifsdp import checkpoint
from mpifsdp.data import rank_slice
from mpifsdp.models import GPT, GPTConfig

from support import require, shared_dir

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=16)


def _model(comm, directory=None, frozen=True):
    model = GPT(CFG, seed=0)
    if frozen:
        model.wpe.weight.requires_grad = False
    offload = dict(offload="disk", offload_dir=directory) if directory is not None else {}
    return mpifsdp.fully_shard(model, comm, units=model.blocks, **offload)


def _batch(comm, step: int):
    rng = np.random.default_rng(step)
    x, y = (rng.integers(0, CFG.vocab_size, (24, CFG.block_size)) for _ in range(2))  # 2+ rows a rank
    return rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)


def _train(model, opt, comm, steps: range):
    """Steps of two accumulated micro-batches each, clipped; the losses."""
    losses = []
    for step in steps:
        x, y = _batch(comm, step)
        with mpifsdp.no_sync(model):
            model(x[:1], y[:1]).backward()
        loss = model(x[1:], y[1:])
        loss.backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _shards(model) -> list:
    return [unit.shard.copy() for unit in mpifsdp.sharded_model(model).units]


@pytest.mark.parametrize(
    "make", [lambda m: mpifsdp.AdamW(m, lr=1e-2), lambda m: mpifsdp.SGD(m, lr=1e-2, momentum=0.9)]
)
def test_disk_offload_trains_to_the_bits_of_training_in_memory(comm, tmp_path, make):
    """Four steps with the states on disk equal four in memory, bit for bit: losses, shards and the
    states themselves; the files are this rank's (open and unlinked at once: only its owner file is
    seen), and the owner file is gone with the optimizer."""
    kept = _model(comm)
    kept_opt = make(kept)
    want = _train(kept, kept_opt, comm, range(4))
    model = _model(comm, tmp_path)
    opt = make(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank-{comm.rank:05d}.owner"]  # states unlinked
    assert opt.on_disk.nbytes == len(opt.state_kinds) * opt.on_disk.file_bytes
    assert _train(model, opt, comm, range(4)) == want
    assert all(np.array_equal(a, b) for a, b in zip(_shards(model), _shards(kept)))
    for group, kept_group in zip(opt.groups, kept_opt.groups):
        mine, theirs = opt.state_of(group), kept_opt.state_of(kept_group)
        assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
    del opt, mine
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_saved_with_disk_offload_resumes_without_it_and_back(comm, tmp_path):
    """The checkpoint's files are the same with or without offload: saved after two steps on disk,
    loaded into a model in memory (and the reverse), two more steps equal four uninterrupted."""
    tmp_path = Path(shared_dir(comm, tmp_path))  # the checkpoint is one directory for every rank
    kept = _model(comm)
    want = _train(kept, mpifsdp.AdamW(kept, lr=1e-2), comm, range(4))
    for saved_on_disk in (True, False):
        scratch = tmp_path / f"scratch-{saved_on_disk}-{comm.rank}"
        scratch.mkdir()
        first = _model(comm, scratch if saved_on_disk else None)
        opt = mpifsdp.AdamW(first, lr=1e-2)
        losses = _train(first, opt, comm, range(2))
        where = tmp_path / f"checkpoint-{saved_on_disk}"
        checkpoint.save(where, first, opt)
        second = _model(comm, None if saved_on_disk else scratch)
        opt2 = mpifsdp.AdamW(second, lr=1e-2)
        checkpoint.load(where, second, opt2)
        assert losses + _train(second, opt2, comm, range(2, 4)) == want
        del opt, opt2
        gc.collect()


def test_what_disk_offload_cannot_do_is_refused_by_name(comm, tmp_path):
    """A missing directory, none given, another kind on a CPU, a directory another live process
    holds for this rank, one without room: each refused, saying what to do."""
    with pytest.raises(ValueError, match="needs offload_dir"):
        mpifsdp.fully_shard(GPT(CFG, seed=0), comm, offload="disk")
    with pytest.raises(ValueError, match="in host memory already"):
        mpifsdp.fully_shard(GPT(CFG, seed=0), comm, offload="optimizer")
    with pytest.raises(ValueError, match="offload must be one of"):
        mpifsdp.fully_shard(GPT(CFG, seed=0), comm, offload="nvme", offload_dir=tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        mpifsdp.AdamW(_model(comm, tmp_path / "missing"))
    holder = tmp_path / f"rank-{comm.rank:05d}.owner"
    holder.write_text('{"host": "another-node", "pid": 1}')  # a job that ended: its lock went with it
    opt = mpifsdp.AdamW(_model(comm, tmp_path))  # taken over
    with pytest.raises(ValueError, match="in use for this rank by .*pid"):  # this process's own, still alive
        mpifsdp.AdamW(_model(comm, tmp_path))
    del opt
    gc.collect()
    assert list(tmp_path.iterdir()) == []
    with open(holder, "w") as held:  # a live process holds the directory for this rank
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write('{"host": "another-node", "pid": 4321, "job": "77"}')
        held.flush()
        with pytest.raises(ValueError, match='in use for this rank by .*"job": "77"'):
            mpifsdp.AdamW(_model(comm, tmp_path))
    holder.unlink()


def test_a_directory_without_room_is_refused_with_the_sizes(comm, tmp_path, monkeypatch):
    from mpifsdp.optim import offload

    monkeypatch.setattr(offload.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1024})())
    with pytest.raises(ValueError, match="GiB free; this rank's optimizer states need"):
        mpifsdp.AdamW(_model(comm, tmp_path))


def test_states_beyond_an_address_space_limit_train_on_disk_to_the_same_bits(comm, tmp_path):
    """An MLP whose moments (403 MB) are most of its states, in one process each: unlimited in memory
    and on disk (their peak address space measured), then both under a limit halfway between the two
    peaks (RLIMIT_AS): in memory the run fails to allocate, on disk it trains to the unlimited
    run's bits, and leaves no file."""
    if comm.size > 1:
        pytest.skip("one process a run: the plain-pytest pass covers it")
    if not Path("/proc/self/status").exists():
        require("no /proc/self/status (VmPeak): the limit is derived from Linux's figures")
    job = [sys.executable, str(Path(__file__).with_name("offload_under_a_limit.py"))]
    launcher = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_")  # a job of its own, under mpiexec too
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env.update(OPENBLAS_NUM_THREADS="1", MALLOC_ARENA_MAX="2")

    def run(where: str, limit: int) -> dict:
        command = [*job, where, str(tmp_path), str(limit)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        said = done.stdout.strip().splitlines()
        return json.loads(said[-1]) if done.returncode == 0 and said else {"failed": done.stderr[-500:]}

    in_memory, on_disk = run("memory", 0), run("disk", 0)
    assert "digest" in in_memory and on_disk.get("digest") == in_memory["digest"], (in_memory, on_disk)
    assert in_memory["peak_bytes"] - on_disk["peak_bytes"] > 150 * 2**20, (in_memory, on_disk)
    limit = (in_memory["peak_bytes"] + on_disk["peak_bytes"]) // 2
    assert "digest" not in run("memory", limit)  # a MemoryError, or a library that could not allocate
    assert run("disk", limit).get("digest") == in_memory["digest"]
    assert list(tmp_path.iterdir()) == []
