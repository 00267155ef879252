"""THE test: sharded training at the world's size == single-process training on the global batch.

Runs at N = 1 under plain pytest and N = 2, 3, 4 under mpiexec (make test). Shapes are chosen so
that units pad at N = 3 and 4. Losses every step, final parameters and AdamW moments must agree
within a bound measured on this machine (tests/tolerance.py). The PARITY line each test prints
(pytest -s) is what bench/parity_kernels.py collects across BLAS kernels.
"""

import functools
import time

import numpy as np
import pytest

from mpifsdp import AdamW, Comm, full_state_dict, fully_shard, sharded_model
from mpifsdp.data import rank_slice
from mpifsdp.models import GPT, GPTConfig, MLPClassifier

from support import agree
from tolerance import rel_err, within

GLOBAL_BATCH = 12  # divides over 1, 2, 3 and 4 ranks
STEPS = 4


def _gpt(dtype):
    # Each block has 1330 elements, the root 470: neither divides by 3 or 4, so shards pad.
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10, tie_weights=True)
    return GPT(cfg, seed=3, dtype=dtype), lambda m: m.blocks


def _gpt_batch(step):
    rng = np.random.default_rng(step)
    return rng.integers(0, 37, (GLOBAL_BATCH, 8)), rng.integers(0, 37, (GLOBAL_BATCH, 8))


def _gpt_batch_with_ignored_targets(step):
    """About 40% of targets ignored (-1), most in the first rows: ranks hold unequal valid counts."""
    x, y = _gpt_batch(step)
    share = np.linspace(0.95, 0.0, GLOBAL_BATCH)[:, None]
    return x, np.where(np.random.default_rng(1000 + step).random(y.shape) < share, -1, y)


def _mlp(dtype):
    # units of 7*13+13 = 104 and 13*5+5 = 70 elements; the root holds the last layer.
    return MLPClassifier([7, 13, 5, 3], activation="gelu", seed=4, dtype=dtype), lambda m: m.layers[:2]


def _mlp_batch(step):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((GLOBAL_BATCH, 7)), rng.integers(0, 3, GLOBAL_BATCH)


def _moments_by_name(opt, model):
    """name -> (m, v) as full arrays, for the reference (per-param groups) or a sharded model."""
    sharded = sharded_model(model)
    if sharded is None:
        names = [n for n, _ in model.named_parameters()]
        moments = [opt.state_of(g) for g in opt.groups]
        return {
            n: (s["exp_avg"].reshape(g.param.shape), s["exp_avg_sq"].reshape(g.param.shape))
            for n, g, s in zip(names, opt.groups, moments)
        }
    out = {}
    for unit in opt.groups:
        state = opt.state_of(unit)
        gm, gv = unit.gather(state["exp_avg"]), unit.gather(state["exp_avg_sq"])
        out.update({n: (gm[n], gv[n]) for n in gm})
    return out


# Reorderings of the global batch's rows for the probes (tests/tolerance.py): the same samples, every
# batch sum in another order.
REORDERINGS = {
    "reversed": lambda n: np.arange(n)[::-1],
    "rolled": lambda n: np.roll(np.arange(n), n // 2),
    "shuffled": lambda n: np.random.default_rng(0).permutation(n),
}


def _train(make, batch, dtype, comm=None, order=None, **shard_options):
    """STEPS AdamW steps with clipping and decay; returns {quantity: list of arrays} in a fixed order.

    Without comm: one process on the global batch (its rows in `order`, one of REORDERINGS). With
    comm: sharded, each rank its slice; the loss is the mean of the ranks' losses (each rank's loss
    is its share of the global mean: docs/design.md, invariant 3)."""
    model, units = make(dtype)
    if comm is not None:
        fully_shard(model, comm, units=units(model), **shard_options)
    opt = AdamW(model, lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        x = x.astype(dtype) if x.dtype.kind == "f" else x
        if order is not None:
            rows = REORDERINGS[order](len(x))
            x, y = x[rows], y[rows]
        if comm is not None:
            x, y = rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)
        loss = model(x, y)
        loss.backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() if comm is None else comm.all_reduce_scalar(loss.item()) / comm.size)
    params = full_state_dict(model)
    moments = _moments_by_name(opt, model)
    names = sorted(params)
    return {
        "loss": [np.array(losses)],
        "params": [params[n] for n in names],
        "exp_avg": [moments[n][0] for n in names],
        "exp_avg_sq": [moments[n][1] for n in names],
    }


def _errors(run, reference) -> dict:
    return {k: rel_err(run[k], reference[k]) for k in reference}


class DelayedComm(Comm):
    """Every collective completes only after a sleep: overlap must never change a result."""

    def wait(self, request):
        time.sleep(0.002)
        super().wait(request)


@functools.cache
def _reference_and_probe(make, batch, dtype):
    """The single-process run, and per quantity the largest distance from it of the same run with the
    batch reordered (or, for float32, in float64): the reordering noise of this trajectory here."""
    reference = _train(make, batch, dtype)
    probes = [_errors(_train(make, batch, dtype, order=order), reference) for order in REORDERINGS]
    if dtype == np.float32:  # the error float32 already has, against float64
        probes.append(_errors(_train(make, batch, np.float64), reference))
    return reference, {k: max(p[k] for p in probes) for k in reference}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(
    "make,batch",
    [(_gpt, _gpt_batch), (_gpt, _gpt_batch_with_ignored_targets), (_mlp, _mlp_batch)],
    ids=["gpt", "gpt-ignored", "mlp"],
)
@pytest.mark.parametrize("schedule", ["prefetch1", "prefetch2-keep", "no-prefetch", "delayed"])
def test_sharded_training_matches_single_process(comm, make, batch, dtype, schedule):
    """Tolerances: tests/tolerance.py. The single-process reference, its reordered runs and (for
    float32) its float64 run are computed on every rank (small models); they set the bound."""
    options = {
        "prefetch1": dict(prefetch=1),
        "prefetch2-keep": dict(prefetch=2, reshard_after_forward=False),
        "no-prefetch": dict(prefetch=0, reshard_root=True),
        "delayed": dict(prefetch=1),
    }[schedule]
    if schedule == "delayed":
        comm = DelayedComm(threads=None)
    reference, probe = _reference_and_probe(make, batch, dtype)
    errors = _errors(_train(make, batch, dtype, comm, **options), reference)
    worst, report = within(errors, probe, dtype)
    if comm.rank == 0:
        case = f"{batch.__name__[1:]} {np.dtype(dtype).name} {schedule}"
        print(f"\nPARITY N={comm.size} {case} ratio={worst:.3f}")
    agree(comm, worst <= 1.0, f"N={comm.size}: sharded run beyond the bound ({worst:.2f}x): {report}")
