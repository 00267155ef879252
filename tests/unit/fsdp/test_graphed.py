"""GraphedPasses' refusals that a CPU can see (the capture and its replays are checked on the GPU
branches by tools/gpusim/standin_graphs.py, run by tests/project/test_gpu_budget.py)."""

import pytest

import mpifsdp
from mpifsdp.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)


def _passes(model):
    def passes(x, y):
        loss = model(x, y)
        loss.backward()
        return loss

    return passes


def test_a_model_on_the_cpu_is_refused_naming_the_gpu(comm):
    model = GPT(CONFIG, seed=0)
    mpifsdp.fully_shard(model, comm, units=model.blocks)
    with pytest.raises(ValueError, match="CUDA graphs need a GPU"):
        mpifsdp.GraphedPasses(model, _passes(model))


def test_a_model_fully_shard_was_not_called_on_is_refused(comm):
    model = GPT(CONFIG, seed=0)
    with pytest.raises(ValueError, match=r"needs a model fully_shard\(\) was called on, got a GPT"):
        mpifsdp.GraphedPasses(model, _passes(model))
