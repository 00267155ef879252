"""Hybrid sharding (fully_shard(shard_size=S)): shard inside groups of S ranks, replicate across them.

Parity with one process on the global batch, float64, for every shape the world allows (N = 4 as
1x4, 2x2, 4x1; N = 2 as 1x2, 2x1; N = 3 as 1x3, 3x1); traffic per level equals its formula exactly;
a checkpoint saved under one shape loads under any other, bit-identically.
"""

import numpy as np
import pytest

from mpifsdp import AdamW, CollectiveError, Comm, full_state_dict, fully_shard, sharded_model
from mpifsdp.checkpoint import load, save
from mpifsdp.data import rank_slice
from mpifsdp.models import GPT, GPTConfig

from support import shared_dir, sub_comm
from tolerance import rel_err

STEPS = 3
TOL = 1e-12  # float64; only the order of sums differs (see test_accumulation.py)
CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10, tie_weights=True)


def _batch(step):
    rng = np.random.default_rng(step)
    return rng.integers(0, 37, (12, 8)), rng.integers(0, 37, (12, 8))


def _train(model, opt, comm=None, steps=STEPS, first=0):
    for step in range(first, first + steps):
        x, y = _batch(step)
        if comm is not None:
            x, y = rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)
        model(x, y).backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()


def _hsdp(comm, shard_size):
    model = GPT(CFG, seed=3, dtype=np.float64)
    fully_shard(model, comm, units=model.blocks, shard_size=shard_size)
    return model, AdamW(model, lr=1e-2, weight_decay=0.1)


def _shard_sizes(comm):
    return [s for s in range(1, comm.size + 1) if comm.size % s == 0]


def test_every_group_shape_matches_one_process(comm):
    reference = GPT(CFG, seed=3, dtype=np.float64)
    _train(reference, AdamW(reference, lr=1e-2, weight_decay=0.1))
    want = reference.state_dict()
    for shard_size in _shard_sizes(comm):
        model, opt = _hsdp(comm, shard_size)
        _train(model, opt, comm)
        got = full_state_dict(model)
        err = rel_err([got[n] for n in sorted(want)], [want[n] for n in sorted(want)])
        assert err < TOL, f"shard_size {shard_size}: {err:.3g}"


def test_traffic_per_level_is_exact(comm):
    for shard_size in _shard_sizes(comm):
        model, opt = _hsdp(comm, shard_size)
        sharded = sharded_model(model)
        S, R = shard_size, comm.size // shard_size
        inside = sharded.shard_comm.ledger
        inside.reset()
        if sharded.replicas is not None:
            sharded.replicas.ledger.reset()
        _train(model, opt, comm, steps=1)
        assert sharded.shard_comm.size == S and (sharded.replicas.size if R > 1 else 1) == R
        for unit in sharded.units:
            shard = unit.numel  # padded_numel / S
            gathers = 1 if unit.name == "root" else 2  # the root stays gathered from forward to backward
            got = inside.total("elements", unit=unit.name, op="all_gather")
            assert got == gathers * (S - 1) * shard, (S, unit.name)
            assert inside.total("elements", unit=unit.name, op="reduce_scatter") == (S - 1) * shard
            across = sharded.replicas.ledger if R > 1 else None
            if across is not None:  # ring all-reduce of the gradient shard: 2 (R - 1) / R of it
                assert across.total("elements", unit=unit.name, op="all_reduce") == 2 * (R - 1) * shard // R
                assert across.total("calls", unit=unit.name, op="all_gather") == 0
        levels = sharded.report()[comm.rank]
        assert ("comm_across_groups" in levels) == (R > 1) and ("comm_in_group" in levels) == (S < comm.size)


def test_a_checkpoint_loads_under_any_group_shape(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    sizes = _shard_sizes(comm)
    model, opt = _hsdp(comm, sizes[len(sizes) // 2])
    _train(model, opt, comm, steps=2)
    save(f"{root}/ck", model, opt)
    want = full_state_dict(model)
    _train(model, opt, comm, steps=1, first=2)
    after = full_state_dict(model)
    for shard_size in sizes:
        other, other_opt = _hsdp(comm, shard_size)
        load(f"{root}/ck", other, other_opt)
        got = full_state_dict(other)
        assert all(np.array_equal(got[n], want[n]) for n in want), shard_size
        _train(other, other_opt, comm, steps=1, first=2)  # moments loaded too: the same next step
        got = full_state_dict(other)
        err = rel_err([got[n] for n in sorted(after)], [after[n] for n in sorted(after)])
        assert err < TOL, (shard_size, err)


def test_node_groups_and_bad_sizes(comm, monkeypatch):
    with pytest.raises(ValueError, match="divides"):
        _hsdp(comm, comm.size + 1)
    model, _ = _hsdp(comm, "node")  # one machine: the whole world is one node
    assert sharded_model(model).replicas is None
    monkeypatch.setenv("MPIFSDP_RANKS_PER_NODE", "1")  # pretend: every rank a node of its own
    model, _ = _hsdp(Comm(threads=None), "node")
    sharded = sharded_model(model)
    assert sharded.shard_comm.size == 1 and (sharded.replicas.size if comm.size > 1 else 1) == comm.size


@pytest.mark.mpi(min_size=2)
def test_the_all_reduce_across_groups_overlaps_the_next_units_backward(comm, monkeypatch):
    """When a unit's reduce-scatter starts, the previous unit's all-reduce across groups is already
    in flight (started, not waited for): both levels overlap backward compute."""
    model, _ = _hsdp(comm, 1)
    sharded = sharded_model(model)
    seen, reducing = [], type(sharded).reducing

    def watch(self, unit):
        reducing(self, unit)
        seen.append(sorted(("across" if u._reducing.source is None else "in group") for u in self._reduces))

    monkeypatch.setattr(type(sharded), "reducing", watch)
    model(*(rank_slice(a, comm.rank, comm.size) for a in _batch(0))).backward()
    assert ["across", "in group"] in seen, seen


@pytest.mark.mpi(min_size=4)
def test_a_checkpoint_saved_under_hsdp_loads_at_another_world_size(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = _hsdp(comm, 2)
    _train(model, opt, comm, steps=2)
    save(f"{root}/ck", model, opt)
    want = full_state_dict(model)
    smaller = sub_comm(2)  # collective over every rank; None outside ranks 0 and 1
    if smaller is not None:
        for shard_size in (1, 2):
            other, other_opt = _hsdp(smaller, shard_size)
            load(f"{root}/ck", other, other_opt)
            got = full_state_dict(other)
            assert all(np.array_equal(got[n], want[n]) for n in want), shard_size
    comm.barrier()


@pytest.mark.mpi(min_size=2)
def test_groups_built_from_different_values_are_refused_or_synced(comm):
    """Each group checks its own ranks; across the groups the same shard must hold the same values."""
    with pytest.raises(CollectiveError, match="different parameter values"):
        fully_shard(GPT(CFG, seed=comm.rank, dtype=np.float64), comm, shard_size=1)
    model = GPT(CFG, seed=comm.rank, dtype=np.float64)
    fully_shard(model, comm, units=model.blocks, shard_size=1, sync_params=True)
    want = GPT(CFG, seed=0, dtype=np.float64).state_dict()  # world rank 0's values, everywhere
    got = full_state_dict(model)
    assert all(np.array_equal(got[n], want[n]) for n in want)
