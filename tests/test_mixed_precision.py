"""Mixed precision: fp32 master shards and AdamW state, float16 gathers and compute, fp32 reductions."""

import numpy as np
from conftest import agree

from mpifsdp import AdamW, LossScaler, full_state_dict, fully_shard
from mpifsdp.data import rank_slice
from mpifsdp.fsdp import fsdp_group
from mpifsdp.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16)


def batch(step):
    rng = np.random.default_rng(step)
    return rng.integers(0, 37, (12, 8)), rng.integers(0, 37, (12, 8))


def test_float16_compute_tracks_the_float32_reference(comm):
    ref = GPT(CFG, seed=0)
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks, param_dtype=np.float16, reduce_dtype=np.float32)
    opts = AdamW(ref, lr=3e-3), AdamW(model, lr=3e-3)
    scaler = LossScaler(init_scale=2.0**10)
    comm.ledger.reset()
    worst = 0.0
    for step in range(5):
        x, y = batch(step)
        loss_ref = ref(x, y)
        loss_ref.backward()
        opts[0].step()
        opts[0].zero_grad()
        loss = model(rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size))
        assert loss.dtype == np.float32  # the loss is computed in float32 from float16 logits
        scaler.scale(loss).backward()
        assert scaler.step(opts[1])
        opts[1].zero_grad()
        mean = comm.all_reduce_scalar(loss.item()) / comm.size
        worst = max(worst, abs(mean - loss_ref.item()) / loss_ref.item())
    got, want = full_state_dict(model), ref.state_dict()
    param_err = max(np.abs(got[k] - want[k]).max() for k in want)
    # AdamW moves every weight by about lr per step whatever the gradient's size: 5 steps of 3e-3
    message = f"fp16 vs fp32: loss rel {worst:.2e}, params {param_err:.2e}"
    agree(comm, worst < 1e-3 and param_err < 1e-2, message)

    group = fsdp_group(model)
    assert all(u.shard.dtype == np.float32 and u.grad_shard.dtype == np.float32 for u in group.units)
    assert all(m.dtype == np.float32 for m in opts[1].m)
    ledger = comm.ledger
    for phase in ("forward", "backward"):  # float16 on the wire (full_state_dict's gathers are fp32)
        assert ledger.total("bytes", op="all_gather", phase=phase) == 2 * ledger.total(
            "elements", op="all_gather", phase=phase
        )
    assert ledger.total("bytes", op="reduce_scatter") == 4 * ledger.total("elements", op="reduce_scatter")
    # gathered in float16: root + two blocks (prefetch 1), plus their float16 send copies while in flight
    root, block = group.root.unit.layout, group.units[0].layout
    bound = 2 * (root.padded_numel + root.shard_numel + 2 * (block.padded_numel + block.shard_numel))
    assert 0 < group.ledger.peak["gathered_params"] <= bound


def test_loss_scaler_skips_overflow_and_adapts(comm):
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks, param_dtype=np.float16, reduce_dtype=np.float32)
    opt = AdamW(model, lr=1e-3)
    scaler = LossScaler(init_scale=2.0**12, growth_interval=2)
    x, y = (rank_slice(a, comm.rank, comm.size) for a in batch(0))
    before = full_state_dict(model)
    scaler.scale(model(x, y)).backward()
    if comm.rank == 0:
        fsdp_group(model).units[0].grad_shard[0] = np.inf  # an overflow on one rank
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
