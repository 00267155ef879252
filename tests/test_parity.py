"""THE test: sharded training at the world's size == single-process training on the global batch.

Runs at N = 1 under plain pytest and N = 2, 3, 4 under mpiexec (make test). Shapes are chosen so
that units pad at N = 3 and 4. Losses every step, final parameters and AdamW moments must agree.
"""

import time

import numpy as np
import pytest
from conftest import agree

from mpifsdp import AdamW, Comm, full_state_dict, fully_shard
from mpifsdp.data import rank_slice
from mpifsdp.fsdp import fsdp_group
from mpifsdp.models import GPT, GPTConfig, MLPClassifier

GLOBAL_BATCH = 12  # divides over 1, 2, 3 and 4 ranks
TOLERANCE = {np.float64: 1e-12, np.float32: 1e-5}
# Parameters and moments get 5x and 10x that: AdamW divides by sqrt(v), so where a gradient is near
# zero the last-bit differences of a different summation order (N partial sums) grow to ~lr * 1e-3.
PARAM_SLACK, MOMENT_SLACK = 5, 10


def _gpt(dtype):
    # Each block has 1330 elements, the root 470: neither divides by 3 or 4, so shards pad.
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10, tie_weights=True)
    return GPT(cfg, seed=3, dtype=dtype), lambda m: m.blocks


def _gpt_batch(step):
    rng = np.random.default_rng(step)
    return rng.integers(0, 37, (GLOBAL_BATCH, 8)), rng.integers(0, 37, (GLOBAL_BATCH, 8))


def _mlp(dtype):
    # units of 7*13+13 = 104 and 13*5+5 = 70 elements; the root holds the last layer.
    return MLPClassifier([7, 13, 5, 3], activation="gelu", seed=4, dtype=dtype), lambda m: m.layers[:2]


def _mlp_batch(step):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((GLOBAL_BATCH, 7)), rng.integers(0, 3, GLOBAL_BATCH)


def _moments_by_name(opt, model):
    """name -> (m, v) as full arrays, for the reference (per-param groups) or a sharded model."""
    group = fsdp_group(model)
    if group is None:
        names = [n for n, _ in model.named_parameters()]
        return {
            n: (m.reshape(g.param.shape), v.reshape(g.param.shape))
            for n, g, m, v in zip(names, opt.groups, opt.m, opt.v)
        }
    out = {}
    for unit, m, v in zip(opt.groups, opt.m, opt.v):
        gm, gv = unit.gather(m), unit.gather(v)
        out.update({n: (gm[n], gv[n]) for n in gm})
    return out


class DelayedComm(Comm):
    """Every collective completes only after a sleep: overlap must never change a result."""

    def wait(self, request):
        time.sleep(0.002)
        super().wait(request)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("make,batch", [(_gpt, _gpt_batch), (_mlp, _mlp_batch)], ids=["gpt", "mlp"])
@pytest.mark.parametrize("schedule", ["prefetch1", "prefetch2-keep", "no-prefetch", "delayed"])
def test_sharded_training_matches_single_process(comm, make, batch, dtype, schedule):
    tol = TOLERANCE[dtype]
    ref, _ = make(dtype)
    model, units = make(dtype)
    options = {
        "prefetch1": dict(prefetch=1),
        "prefetch2-keep": dict(prefetch=2, reshard_after_forward=False),
        "no-prefetch": dict(prefetch=0, reshard_root=True),
        "delayed": dict(prefetch=1),
    }[schedule]
    if schedule == "delayed":
        comm = DelayedComm(threads=None)
    fully_shard(model, comm, units=units(model), **options)
    opts = [AdamW(m, lr=1e-2, weight_decay=0.1) for m in (ref, model)]

    worst_loss = 0.0
    for step in range(4):
        x, y = batch(step)
        x = x.astype(dtype) if x.dtype.kind == "f" else x
        losses = []
        for m, opt, (xs, ys) in zip(
            (ref, model),
            opts,
            [(x, y), (rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size))],
        ):
            loss = m(xs, ys)
            loss.backward()
            opt.clip_grad_norm(0.5)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        global_loss = comm.all_reduce_scalar(losses[1]) / comm.size  # equal shares: mean of means
        worst_loss = max(worst_loss, abs(global_loss - losses[0]) / abs(losses[0]))

    want, got = ref.state_dict(), full_state_dict(model)
    param_err = max(np.abs(got[n] - want[n]).max() for n in want)
    m_ref, m_got = _moments_by_name(opts[0], ref), _moments_by_name(opts[1], model)
    moment_err = max(
        np.abs(m_got[n][i] - m_ref[n][i]).max() / (np.abs(m_ref[n][i]).max() + 1e-30)
        for n in m_ref
        for i in (0, 1)
    )
    agree(comm, sorted(got) == sorted(want), f"parameter names differ: {sorted(got)} vs {sorted(want)}")
    agree(
        comm,
        worst_loss < tol and param_err < tol * PARAM_SLACK and moment_err < tol * MOMENT_SLACK,
        f"N={comm.size}: loss rel err {worst_loss:.2e}, param err {param_err:.2e}, "
        f"moment rel err {moment_err:.2e}",
    )
