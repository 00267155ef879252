"""Parameters matched by tensor name across unit divisions: consolidated.load_params, and
export_safetensors of a chosen subset (what fine-tuning needs: a base checkpoint into a model that
adds adapters or freezes part of itself, and an export without the adapters)."""

import numpy as np
import pytest

from mpifsdp import CollectiveError, Param, full_state_dict, fully_shard
from mpifsdp.checkpoint import CheckpointError, save
from mpifsdp.checkpoint.consolidated import (
    export_safetensors,
    load_params,
    read_safetensors_header,
    saved_extra,
)
from mpifsdp.models import GPT, GPTConfig

from support import TINY_GPT, agree, sharded_tiny_gpt, shared_dir, train


def _divided_otherwise(comm, extra=False):
    """The same GPT, other values, attention frozen (so each block is two units), the root sharded
    as one with the blocks' MLPs in it; with `extra`, a parameter the checkpoint lacks."""
    model = GPT(TINY_GPT, seed=7)
    for block in model.blocks:
        block.attn.requires_grad_(False)
    if extra:
        model.blocks[0].adapter = Param(np.full(3, 5.0, dtype=np.float32))
    fully_shard(model, comm, units=[b.attn for b in model.blocks])
    return model


def test_a_checkpoint_loads_by_name_into_another_division(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, opt = sharded_tiny_gpt(comm)
    train(model, opt, comm, 2)
    save(f"{root}/ck", model, opt, extra={"config": {"n_layer": 2}})
    want = full_state_dict(model)

    other = _divided_otherwise(comm, extra=True)
    missing = load_params(f"{root}/ck", other, allow_missing=lambda name: name.endswith("adapter"))
    assert missing == ["blocks.0.adapter"]
    got = full_state_dict(other)
    agree(comm, all(np.array_equal(got[k], want[k]) for k in want), "a loaded parameter differs")
    assert np.array_equal(got["blocks.0.adapter"], [5.0, 5.0, 5.0])  # kept its value
    assert saved_extra(f"{root}/ck") == {"config": {"n_layer": 2}}

    with pytest.raises(CheckpointError, match=r"tensors the checkpoint lacks: \['blocks.0.adapter'\]"):
        load_params(f"{root}/ck", _divided_otherwise(comm, extra=True))


def test_load_params_refuses_other_shapes_and_unknown_tensors(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model, _ = sharded_tiny_gpt(comm)
    save(f"{root}/ck", model)
    wider = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=12), seed=0)
    fully_shard(wider, comm, units=wider.blocks)
    with pytest.raises(CheckpointError, match="differ for"):
        load_params(f"{root}/ck", wider)
    shallower = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=1, n_head=2, n_embd=10), seed=0)
    fully_shard(shallower, comm, units=shallower.blocks)
    with pytest.raises(CheckpointError, match=r"the model does not have: \['blocks.1"):
        load_params(f"{root}/ck", shallower)


def test_export_of_a_subset_holds_exactly_those_tensors(comm, tmp_path):
    root = shared_dir(comm, tmp_path)
    model = _divided_otherwise(comm, extra=True)
    path = export_safetensors(f"{root}/base.safetensors", model, include=lambda n: not n.endswith("adapter"))
    want = full_state_dict(model)
    del want["blocks.0.adapter"]
    if comm.rank == 0:
        from safetensors.numpy import load_file  # the reference reader (a test dependency)

        tensors = load_file(str(path))
        assert sorted(tensors) == sorted(want)
        assert all(np.array_equal(tensors[k], want[k]) for k in want)
    header, _ = read_safetensors_header(path)
    assert "blocks.0.adapter" not in header


def test_load_params_needs_a_sharded_model(tmp_path):
    with pytest.raises((ValueError, CollectiveError, CheckpointError), match="fully_shard|sharded"):
        load_params(tmp_path, GPT(TINY_GPT, seed=0))
