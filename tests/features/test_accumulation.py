"""Gradient accumulation: k micro-batches of b == one batch of k*b, in both ways (docs/training.md).

"reduce": every micro-batch's backward reduce-scatters into the gradient shard (least memory);
"no_sync": the first k-1 backwards keep each unit's full gradient and only the last one reduces (one
reduce-scatter per unit instead of k). Float64, against one process on the global batch, N = 1..4.
"""

import numpy as np
import pytest

import mpifsdp
from mpifsdp import AdamW, full_state_dict, fully_shard, sharded_model
from mpifsdp.data import rank_slice
from mpifsdp.models import GPT, GPTConfig

MICRO = 12  # global rows per micro-batch: divides over 1..4 ranks
K = 3  # micro-batches per step
STEPS = 3
# float64: the two ways differ only in the order of sums (eps 2.2e-16), which AdamW's early steps
# amplify by at most ~1e3 here; 1e-12 leaves that margin and is 1e10 below what a missing 1/k gives.
TOL = 1e-12


def _model():
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10, tie_weights=True)
    return GPT(cfg, seed=3, dtype=np.float64)


def _batch(step):
    rng = np.random.default_rng(step)
    return rng.integers(0, 37, (K * MICRO, 8)), rng.integers(0, 37, (K * MICRO, 8))


def _reference():
    model = _model()
    opt = AdamW(model, lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        x, y = _batch(step)
        model(x, y).backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
    return full_state_dict(model)


def _train_accumulated(comm, mode):
    model = _model()
    fully_shard(model, comm, units=model.blocks)
    sharded = sharded_model(model)
    opt = AdamW(model, lr=1e-2, weight_decay=0.1)
    per_micro = []
    for step in range(STEPS):
        x, y = _batch(step)
        for j in range(K):
            rows = slice(j * MICRO, (j + 1) * MICRO)
            xj, yj = rank_slice(x[rows], comm.rank, comm.size), rank_slice(y[rows], comm.rank, comm.size)
            comm.ledger.reset()
            last = j == K - 1
            sharded.set_requires_gradient_sync(mode == "reduce" or last)
            (model(xj, yj) / K).backward()  # each micro-batch's mean weighs 1/k of the global mean
            per_micro.append(comm.ledger.total("elements", op="reduce_scatter"))
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
    return full_state_dict(model), per_micro, sharded


@pytest.mark.parametrize("mode", ["reduce", "no_sync"])
def test_k_micro_batches_equal_one_global_batch(comm, mode):
    want = _reference()
    got, per_micro, sharded = _train_accumulated(comm, mode)
    diff = max(float(np.abs(got[n] - want[n]).max() / np.abs(want[n]).max()) for n in want)
    assert diff < TOL, f"{mode}: parameters differ from the global-batch reference by {diff:.3g}"
    # Traffic per micro-step, exactly: a reduce-scatter moves (N-1)/N of each unit's padded vector.
    one_reduce = (comm.size - 1) * sum(u.numel for u in sharded.units)
    expected = [one_reduce] * K if mode == "reduce" else [0] * (K - 1) + [one_reduce]
    assert per_micro == expected * STEPS


def test_no_sync_holds_full_gradients_and_reduces_their_sum_once(comm):
    model = _model()
    fully_shard(model, comm, units=model.blocks)
    sharded = sharded_model(model)
    x, y = (rank_slice(a[:MICRO], comm.rank, comm.size) for a in _batch(0))
    full_grads = sum(u.layout.padded_numel * 8 for u in sharded.units)
    with mpifsdp.no_sync(model):
        model(x, y).backward()
        assert sharded.ledger.current["gathered_grads"] == full_grads  # every unit's, kept
        assert not sharded.requires_gradient_sync
    assert sharded.requires_gradient_sync
    opt = AdamW(model, lr=1e-2)
    with pytest.raises(RuntimeError, match="never reduced"):
        opt.step()  # would miss the held gradients
    model(x, y).backward()  # sync on: reduces the sum of both
    assert sharded.ledger.current["gathered_grads"] == 0
    assert opt.step()


def test_zero_grad_drops_held_gradients(comm):
    model = _model()
    fully_shard(model, comm, units=model.blocks)
    sharded = sharded_model(model)
    x, y = (rank_slice(a[:MICRO], comm.rank, comm.size) for a in _batch(0))
    opt = AdamW(model, lr=1e-2)
    with mpifsdp.no_sync(model):
        model(x, y).backward()
    opt.zero_grad()
    assert sharded.ledger.current["gathered_grads"] == 0
    assert all(u.full_grad is None and not u.has_grad for u in sharded.units)


def test_no_sync_needs_a_sharded_model():
    with pytest.raises(ValueError, match="fully_shard"):
        mpifsdp.no_sync(_model())
