"""Mixed precision: fp32 master shards and AdamW state, float16 gathers and compute, fp32 reductions."""

import numpy as np
import pytest
from mpi4py import MPI

from mpifsdp import AdamW, Comm, LossScaler, Tensor, full_state_dict, fully_shard, sharded_model
from mpifsdp.data import rank_slice
from mpifsdp.models import GPT, GPTConfig

from support import agree
from tolerance import rel_err, within

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16)


def batch(step):
    rng = np.random.default_rng(step)
    return rng.integers(0, 37, (12, 8)), rng.integers(0, 37, (12, 8))


def _train(comm=None):
    """5 AdamW steps: float32 in one process without comm; with comm, sharded with float16 compute and
    float32 reductions (LossScaler). Returns the model, its optimizer and {quantity: [arrays]}."""
    model = GPT(CFG, seed=0)
    if comm is not None:
        fully_shard(model, comm, units=model.blocks, param_dtype=np.float16, reduce_dtype=np.float32)
    opt, scaler, losses = AdamW(model, lr=3e-3), LossScaler(init_scale=2.0**10), []
    for step in range(5):
        x, y = batch(step)
        if comm is not None:
            x, y = rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)
        loss = model(x, y)
        assert loss.dtype == np.float32  # computed in float32, also from float16 logits
        if comm is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            assert scaler.step(opt)
        opt.zero_grad()
        losses.append(loss.item() if comm is None else comm.all_reduce_scalar(loss.item()) / comm.size)
    params = full_state_dict(model)
    return model, opt, {"loss": [np.array(losses)], "params": [params[k] for k in sorted(params)]}


def test_float16_compute_tracks_the_float32_reference(comm):
    """Tolerance (tests/tolerance.py): float16 compute is itself far from float32 (AdamW moves weights
    by about lr whatever a gradient's size, so float16's errors show at the scale of lr). Measured: the
    same mixed-precision training on one rank; sharding may add no more than a small multiple of it."""
    reference = _train()[2]
    single = _train(Comm(MPI.COMM_SELF, threads=None))[2]
    comm.ledger.reset()
    model, opt, sharded = _train(comm)
    probe = {k: rel_err(single[k], reference[k]) for k in reference}
    errors = {k: rel_err(sharded[k], reference[k]) for k in reference}
    worst, report = within(errors, probe, np.float32)  # the loss and the masters are float32
    agree(comm, worst <= 1.0, f"N={comm.size}: float16 compute beyond the bound ({worst:.2f}x): {report}")

    sharded = sharded_model(model)
    assert all(u.shard.dtype == np.float32 and u.grad_shard.dtype == np.float32 for u in sharded.units)
    assert all(opt.state_of(u)["exp_avg"].dtype == np.float32 for u in opt.groups)
    ledger = comm.ledger
    for phase in ("forward", "backward"):  # float16 on the wire (full_state_dict's gathers are fp32)
        assert ledger.total("bytes", op="all_gather", phase=phase) == 2 * ledger.total(
            "elements", op="all_gather", phase=phase
        )
    assert ledger.total("bytes", op="reduce_scatter") == 4 * ledger.total("elements", op="reduce_scatter")
    # gathered in float16: root + two blocks (prefetch 1), plus their float16 send copies while in flight
    root, block = sharded.units[-1].layout, sharded.units[0].layout  # the root unit is the last
    bound = 2 * (root.padded_numel + root.shard_numel + 2 * (block.padded_numel + block.shard_numel))
    assert 0 < sharded.ledger.peak["gathered_params"] <= bound


def test_loss_scaler_skips_overflow_and_adapts(comm):
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks, param_dtype=np.float16, reduce_dtype=np.float32)
    opt = AdamW(model, lr=1e-3)
    scaler = LossScaler(init_scale=2.0**12, growth_interval=2)
    x, y = (rank_slice(a, comm.rank, comm.size) for a in batch(0))
    before = full_state_dict(model)
    scaler.scale(model(x, y)).backward()
    if comm.rank == 0:
        sharded_model(model).units[0].grad_shard[0] = np.inf  # an overflow on one rank
    assert scaler.step(opt) is False and scaler.scale_value == 2.0**11 and scaler.skipped_steps == 1
    after = full_state_dict(model)
    agree(
        comm, all(np.array_equal(after[k], before[k]) for k in after), "an overflowed step changed parameters"
    )
    opt.zero_grad()
    for _ in range(2):
        scaler.scale(model(x, y)).backward()
        assert scaler.step(opt) is True
        opt.zero_grad()
    assert scaler.scale_value == 2.0**12 and opt.step_count == 2
    # a resumed run's scaler goes on where this one is (train_gpt keeps it in the checkpoint's extra)
    state = scaler.state_dict()
    assert state == {"scale_value": 2.0**12, "good_steps": 2, "skipped_steps": 1, "skips_in_a_row": 0}
    assert np.isfinite(scaler.last_grad_norm) and scaler.last_grad_norm > 0
    resumed = LossScaler()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state and resumed.scale(Tensor(np.float32(1.0))).item() == 2.0**12
    with pytest.raises(ValueError, match="expected the keys"):
        resumed.load_state_dict({"scale": 2.0})
