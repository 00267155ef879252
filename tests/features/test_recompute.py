"""Activation checkpointing (recompute.py, fully_shard(recompute=...)): the same numbers, less memory.

A re-run forward performs the same operations in the same order on the same values, so checkpointed
training is bit-identical to plain training, dropout included (its masks are replayed): the tests
compare exactly. Activation bytes held after forward are predicted from one block's own graph.
"""

import random

import numpy as np
import pytest

from mpifsdp import AdamW, CollectiveError, Module, Param, Tensor, fully_shard, sharded_model
from mpifsdp.autodiff.tensor import graph_nbytes
from mpifsdp.data import rank_slice
from mpifsdp.extend import recompute
from mpifsdp.models import GPT, GPTConfig
from mpifsdp.nn.layers import Block, Dropout, draws_replay

B, T, C = 4, 8, 16


def _block(seed=0):
    return Block(C, 2, dropout=0.3, rng=np.random.default_rng(seed), dtype=np.float64, device="cpu")


def _grads(block, x, checkpointed):
    xt = Tensor(x, requires_grad=True)
    run = block.forward
    y = recompute(run, xt, replay=draws_replay(block)) if checkpointed else run(xt)
    (y * y).sum().backward()
    grads = {n: p.grad.copy() for n, p in block.named_parameters()}
    for _, p in block.named_parameters():
        p.grad = None
    return y.data.copy(), xt.grad, grads


def test_recomputed_block_is_bit_identical_with_dropout():
    x = np.random.default_rng(1).standard_normal((B, T, C))
    plain, ckpt = _block(), _block()
    for _ in range(2):  # the second call draws new masks: the replay must rewind to the right ones
        y0, gx0, g0 = _grads(plain, x, checkpointed=False)
        y1, gx1, g1 = _grads(ckpt, x, checkpointed=True)
        assert np.array_equal(y0, y1) and np.array_equal(gx0, gx1)
        assert all(np.array_equal(g0[n], g1[n]) for n in g0)


def test_without_replay_dropout_would_differ():
    """The replay is what makes the test above pass: a re-run that draws fresh masks differs."""
    x = np.random.default_rng(1).standard_normal((B, T, C))
    _, gx0, _ = _grads(_block(), x, checkpointed=False)
    block = _block()
    xt = Tensor(x, requires_grad=True)
    (recompute(block.forward, xt) ** 2).sum().backward()  # no replay
    assert not np.allclose(xt.grad, gx0)


def test_recompute_keeps_only_the_inputs():
    x = Tensor(np.random.default_rng(1).standard_normal((B, T, C)), requires_grad=True)
    block = _block()
    assert graph_nbytes(recompute(block.forward, x, replay=draws_replay(block))) == x.data.nbytes
    assert graph_nbytes(block(x)) > 5 * x.data.nbytes


def test_recompute_passes_non_tensor_arguments_and_refuses_other_outputs():
    w = Param(np.arange(3.0), name="w")
    y = recompute(lambda a, scale: (a * w).sum() * scale, Tensor(np.ones(3)), 2.0)
    y.backward()
    assert np.array_equal(w.grad, [2.0, 2.0, 2.0])
    with pytest.raises(TypeError, match="one Tensor"):
        recompute(lambda a: (a, a), Tensor(np.ones(3), requires_grad=True))


def _gpt():
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=12, dropout=0.2)
    return GPT(cfg, seed=3, dtype=np.float64)


def _batch(step, comm):
    rng = np.random.default_rng(step)
    x, y = rng.integers(0, 37, (12, 8)), rng.integers(0, 37, (12, 8))
    return rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)


def _train(comm, checkpoint):
    model = _gpt()
    fully_shard(model, comm, units=model.blocks, recompute=checkpoint)
    opt = AdamW(model, lr=1e-2, weight_decay=0.1)
    losses, grads, held = [], [], []
    for step in range(3):
        loss = model(*_batch(step, comm))
        held.append(graph_nbytes(loss))
        loss.backward()
        grads.append([u.grad_shard.copy() for u in sharded_model(model).units])
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    shards = [u.shard.copy() for u in sharded_model(model).units]
    return losses, grads, shards, held


def test_checkpointed_units_train_bit_identically(comm):
    plain = _train(comm, checkpoint=False)
    ckpt = _train(comm, checkpoint=True)
    assert ckpt[0] == plain[0]  # losses
    for got, want in zip(ckpt[1], plain[1]):  # gradient shards, every step
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert all(np.array_equal(g, w) for g, w in zip(ckpt[2], plain[2]))  # parameter shards
    # Held after forward: each block's own graph (measured alone, its input included) becomes its input.
    model = _gpt()
    x = Tensor(np.zeros((len(_batch(0, comm)[0]), 8, 12)), requires_grad=True)
    own = graph_nbytes(model.blocks[0](x))
    predicted = plain[3][0] - 3 * (own - x.data.nbytes)
    assert ckpt[3] == [predicted] * 3, (ckpt[3], predicted, plain[3])


def test_some_units_checkpointed_and_nested_units_refused(comm):
    model = _gpt()
    fully_shard(model, comm, units=model.blocks, recompute={model.blocks[1]: True})
    assert [lc.recomputes for lc in sharded_model(model).lifecycles] == [False, True, False, False]
    model = _gpt()
    with pytest.raises(CollectiveError, match="contain other units"):
        fully_shard(model, comm, units=[model.blocks[0], model.blocks[0].attn], recompute=True)


def test_draws_replay_restores_positions():
    drop, fresh = Dropout(0.5, seed=1), Dropout(0.5, seed=1)
    replay = draws_replay(drop)
    x = Tensor(np.ones(100))
    masks = [fresh(x).data for _ in range(3)]  # calls 1, 2, 3 of a dropout seeded alike
    assert np.array_equal(drop(x).data, masks[0]) and np.array_equal(drop(x).data, masks[1])
    with replay():  # rewound to where it was when replay was made
        assert np.array_equal(drop(x).data, masks[0])
    assert np.array_equal(drop(x).data, masks[2])  # and back where it was after


def test_the_re_run_draws_the_same_numbers_from_the_global_generators():
    """A forward that draws noise from np.random.* or Python's random got other noise on the re-run:
    gradients silently off (0.065 of 0.125). Both generators are put back for the re-run, and after it."""
    import random

    def noisy(x):
        noise = np.random.standard_normal(x.shape) + random.random()
        return (x * x * Tensor(noise)).sum()

    def grad(checkpointed):
        np.random.seed(7)
        random.seed(7)
        x = Tensor(np.arange(4.0), requires_grad=True)
        (recompute(noisy, x) if checkpointed else noisy(x)).backward()
        return x.grad, np.random.standard_normal(), random.random()  # and what the generators give next

    plain, recomputed = grad(False), grad(True)
    np.testing.assert_array_equal(recomputed[0], plain[0])
    assert recomputed[1:] == plain[1:]  # the re-run left the generators where the first run had


class _NoisyUnit(Module):
    """A unit drawing noise from generators of its own (NumPy's recommended API, the legacy one,
    Python's), one of them inside a list, as a scientist's code would."""

    def __init__(self, seed):
        self.w = Param(np.linspace(0.5, 1.5, 6))
        self.rng = np.random.default_rng(seed)
        self.others = [np.random.RandomState(seed), random.Random(seed)]

    def forward(self, x):
        legacy, plain = self.others
        noise = self.rng.standard_normal(6) + legacy.standard_normal(6) + plain.random()
        return x * self.w * Tensor(noise)


class _TwoNoisyUnits(Module):
    def __init__(self):
        self.units = [_NoisyUnit(1), _NoisyUnit(2)]

    def forward(self, x):
        return (self.units[1](self.units[0](x)) ** 2).sum()


def test_generators_a_unit_holds_draw_the_same_numbers_in_the_re_run(comm):
    """A unit's own np.random.Generator under fully_shard(recompute=True) drew new noise on the
    re-run: gradients 0.0046 off of 0.125, silently. Its generators are rewound for the re-run
    (nn.layers.draws_replay) and left where the first run left them."""

    def run(recomputed):
        model = _TwoNoisyUnits()
        fully_shard(model, comm, units=model.units, recompute=recomputed)
        model(Tensor(np.arange(6.0) + comm.rank)).backward()
        return sharded_model(model).units, [u.rng.standard_normal() for u in model.units]

    (plain, plain_next), (recomputed, recomputed_next) = run(False), run(True)
    for a, b in zip(plain, recomputed):
        np.testing.assert_array_equal(a.grad_shard, b.grad_shard)
    assert plain_next == recomputed_next  # the generators go on from where the first run left them
