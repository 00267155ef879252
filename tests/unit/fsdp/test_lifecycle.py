"""A unit's lifecycle within a step, walked edge by edge (docs/design.md, "The unit lifecycle")."""

import numpy as np
import pytest

from mpifsdp import Param, Tensor, Unit, fully_shard, no_grad, sharded_model
from mpifsdp.fsdp.lifecycle import MOVES, Stage, UnitLifecycle
from mpifsdp.models import GPT, GPTConfig


class StepLog:
    """Stands in for the ShardedModel: records what the lifecycle tells it, and the stage it is at."""

    def __init__(self):
        self.events = []
        self.requires_gradient_sync = True
        self.deterministic = False

    def prefetch_after(self, lifecycle, direction):
        self.events.append(("prefetch", direction, lifecycle.stage, lifecycle.unit.state))

    def ran(self, lifecycle):
        self.events.append(("ran", lifecycle.stage))

    def reducing(self, unit):
        unit.finish_reduce_grad()
        self.events.append(("reducing", unit.name))


def _lifecycle(comm, reshard_after_forward=True):
    w = Param(np.arange(5.0), "w")
    unit = Unit("u", {"w": w.data}, comm)
    log = StepLog()
    lifecycle = UnitLifecycle(unit, [("w", w)], log, reshard_after_forward)
    lifecycle.release()
    return lifecycle, w, log


def test_the_stages_of_a_step_with_grad(comm):
    lc, w, log = _lifecycle(comm)
    assert lc.stage is Stage.IDLE and lc.unit.state == "sharded" and w.absent
    inside = []

    def forward(x):
        inside.append((lc.stage, lc.unit.state, w.data.copy()))
        return (Tensor(x) * w).sum()

    loss = lc.run_forward(forward, np.ones(5))
    assert inside[0][:2] == (Stage.FORWARD, "unsharded") and np.array_equal(inside[0][2], np.arange(5.0))
    assert log.events == [("prefetch", "forward", Stage.FORWARD, "unsharded"), ("ran", Stage.FORWARD)]
    assert lc.stage is Stage.AWAITING_BACKWARD and lc.unit.state == "sharded" and w.absent
    loss.backward()  # the engine calls pre_backward and post_backward through the lifecycle's scope
    assert log.events[2] == ("prefetch", "backward", Stage.BACKWARD, "unsharded")
    assert log.events[3] == ("reducing", "u")
    assert lc.stage is Stage.IDLE and lc.unit.state == "sharded" and w.absent and w.grad is None
    lo, hi = lc.unit.layout.shard_range(comm.rank)
    want = np.zeros(lc.unit.layout.padded_numel)
    want[:5] = 1.0  # d(sum x*w)/dw = x on every rank, and their mean; zero in the padding
    assert np.array_equal(lc.unit.grad_shard, want[lo:hi])


def test_a_forward_without_grad_returns_to_idle(comm):
    lc, w, log = _lifecycle(comm, reshard_after_forward=False)
    with no_grad():
        lc.run_forward(lambda: None)
    assert lc.stage is Stage.IDLE and lc.unit.state == "sharded"  # no backward will need it: freed
    lc.run_forward(lambda: (w * 1.0).sum())
    assert lc.stage is Stage.AWAITING_BACKWARD and lc.unit.state == "unsharded"  # kept for backward
    with no_grad():  # an evaluation between forward and backward keeps the unit awaiting backward
        lc.run_forward(lambda: None)
    assert lc.stage is Stage.AWAITING_BACKWARD


def test_a_move_off_the_diagram_raises(comm):
    lc, w, _ = _lifecycle(comm)
    with pytest.raises(RuntimeError, match="unit 'u' cannot go from idle to idle"):
        lc.post_backward()  # a post_backward without its pre_backward
    with no_grad(), pytest.raises(RuntimeError, match="cannot go from forward to forward"):
        lc.run_forward(lambda: lc.run_forward(lambda: None))  # a unit's forward inside itself
    assert lc.stage is Stage.IDLE and lc.unit.state == "sharded"  # the failed forward cleaned up
    assert set(MOVES) == set(Stage)


def test_a_sharded_models_units_through_forward_backward_and_eval(comm):
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=8)
    model = GPT(cfg, seed=0)
    fully_shard(model, comm, units=model.blocks)
    sharded = sharded_model(model)
    ids = np.arange(16).reshape(2, 8) % 37
    root = sharded.lifecycles[-1]
    assert [lc.unit.name for lc in sharded.lifecycles] == ["blocks.0", "blocks.1", "root"]
    loss = model(ids, ids)
    assert all(lc.stage is Stage.AWAITING_BACKWARD for lc in sharded.lifecycles)
    assert root.unit.state == "unsharded" and all(u.state == "sharded" for u in sharded.units[:-1])
    loss.backward()
    assert all(lc.stage is Stage.IDLE for lc in sharded.lifecycles)
    assert all(u.state == "sharded" and u.has_grad for u in sharded.units)
    with no_grad():
        model(ids)
    assert all(lc.stage is Stage.IDLE and lc.unit.state == "sharded" for lc in sharded.lifecycles)


def test_a_backward_that_raised_part_way_does_not_block_the_next_step(comm, monkeypatch):
    """A VJP that raises ends the pass: every unit back to IDLE, nothing gathered or in flight, and
    the steps after it train normally (same loss as a model that never failed)."""
    from mpifsdp import AdamW
    from mpifsdp.extend import PRIMITIVES

    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=8)
    ids = np.arange(16).reshape(2, 8) % 37
    models = []
    for fails in (True, False):
        model = GPT(cfg, seed=0)
        fully_shard(model, comm, units=model.blocks)
        if fails:
            good = PRIMITIVES["layer_norm_linear"]  # the blocks' LayerNorms, fused into c_attn and c_fc
            broken = good.__class__(good.name, good.forward, lambda *a, **k: 1 / 0, good.reads_inputs)
            monkeypatch.setitem(PRIMITIVES, "layer_norm_linear", broken)
            loss = model(ids, ids)
            monkeypatch.setitem(PRIMITIVES, "layer_norm_linear", good)
            with pytest.raises(ZeroDivisionError):
                loss.backward()
            sharded = sharded_model(model)  # cleaned up at once (ShardedModel.backward_failed)
            assert all(lc.stage is Stage.IDLE for lc in sharded.lifecycles)
            assert sharded.ledger.current["gathered_params"] == sharded.ledger.current["gathered_grads"] == 0
        opt = AdamW(model, lr=1e-2)
        for _ in range(2):
            model(ids, ids).backward()
            opt.step()
            opt.zero_grad()
        models.append(model(ids, ids).item())
        assert all(lc.stage is Stage.AWAITING_BACKWARD for lc in sharded_model(model).lifecycles)
    assert models[0] == models[1]
