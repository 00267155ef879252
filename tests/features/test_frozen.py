"""Frozen parameters (requires_grad = False): never changed, never reduced, no gradient, no state.

A unit mixing frozen and trainable parameters becomes two flat vectors (fully_shard splits them):
only the trainable one is reduce-scattered and stepped. Float64 against one process with the same
parameters frozen, N = 1..4; the traffic and memory are counted exactly.
"""

import dataclasses

import numpy as np
import pytest

from mpifsdp import AdamW, fully_shard, sharded_model
from mpifsdp.autodiff.tensor import PRIMITIVES
from mpifsdp.data import rank_slice
from mpifsdp.fsdp.lifecycle import Stage
from mpifsdp.models import GPT, GPTConfig

from tolerance import rel_err

STEPS = 3
TOL = 1e-12  # float64; the sharded run only reorders sums (see test_accumulation.py)


def _model():
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10, tie_weights=True)
    model = GPT(cfg, seed=3, dtype=np.float64)
    for block in model.blocks:  # units mixing frozen and trainable parameters
        block.attn.requires_grad_(False)
    model.wte.requires_grad_(False)  # the root's tied embedding too
    model.blocks[1].mlp.c_fc.requires_grad_(False)
    return model


def _frozen(model):
    return {n: p for n, p in model.named_parameters() if not p.requires_grad}


def _batch(step, comm=None):
    rng = np.random.default_rng(step)
    x, y = rng.integers(0, 37, (12, 8)), rng.integers(0, 37, (12, 8))
    if comm is None:
        return x, y
    return rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)


def _run(model, opt, comm=None):
    for step in range(STEPS):
        model(*_batch(step, comm)).backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()


def test_frozen_parameters_unsharded_get_no_grad_and_no_state():
    model = _model()
    before = {n: p.data.copy() for n, p in _frozen(model).items()}
    opt = AdamW(model, lr=1e-2, weight_decay=0.1)
    model(*_batch(0)).backward()
    assert all(p.grad is None for p in _frozen(model).values())
    assert len(opt.groups) == sum(p.requires_grad for p in model.parameters())
    _run(model, opt)
    assert all(np.array_equal(p.data, before[n]) for n, p in _frozen(model).items())


def test_frozen_parameters_sharded_match_the_reference_and_stay_bit_identical(comm):
    reference = _model()
    _run(reference, AdamW(reference, lr=1e-2, weight_decay=0.1))
    want = reference.state_dict()

    model = _model()
    initial = {n: p.data.copy() for n, p in _frozen(model).items()}
    fully_shard(model, comm, units=model.blocks)
    sharded = sharded_model(model)
    names = [u.name for u in sharded.units]
    assert names == ["blocks.0", "blocks.0:frozen", "blocks.1", "blocks.1:frozen", "root", "root:frozen"]
    opt = AdamW(model, lr=1e-2, weight_decay=0.1)
    assert [u.name for u in opt.groups] == ["blocks.0", "blocks.1", "root"]  # no state for frozen ones
    comm.ledger.reset()
    _run(model, opt)
    for unit in sharded.units:  # frozen: gathered for forward and backward, never reduced
        calls = comm.ledger.total("calls", unit=unit.name, op="reduce_scatter")
        assert calls == (STEPS if unit.trainable else 0), unit.name
        gathers = STEPS if unit.name.startswith("root") else 2 * STEPS  # the root stays gathered for backward
        assert comm.ledger.total("calls", unit=unit.name, op="all_gather") == gathers, unit.name
    got = {}
    for unit in sharded.units:
        got.update({n: np.array(v) for n, v in unit.gather(unit.shard).items()})
    for name, value in initial.items():
        assert np.array_equal(got[name], value), f"frozen {name} changed"
    assert sorted(got) == sorted(want)
    diff = rel_err([got[n] for n in sorted(want)], [want[n] for n in sorted(want)])
    assert diff < TOL, diff

    # Persistent memory per shard element: value, gradient and two AdamW moments when trainable (4 x 8
    # bytes in float64), only the value when frozen.
    persistent = sum((4 if u.trainable else 1) * u.numel * 8 for u in sharded.units)
    assert sharded.ledger.persistent() == persistent == sharded.plan()["persistent"]
    assert all(u.grad_shard is None for u in sharded.units if not u.trainable)


def test_frozen_weight_gradient_is_not_computed(monkeypatch):
    """The linear VJPs (alone, with a LayerNorm fused in, and adding into the residual stream) are
    told which inputs need a gradient: a frozen weight's GEMM never runs."""
    calls = []  # (needs and returned gradients from the weight on) of every linear VJP

    def recording(name):
        prim = PRIMITIVES[name]

        def vjp(g, saved, *arrays, needs, **settings):
            grads = prim.vjp(g, saved, *arrays, needs=needs, **settings)
            weight = 2 + settings["ln_bias"] if name == "layer_norm_linear" else 1  # its index
            params = slice(weight, weight + 2 if name == "linear_add" else None)  # not the residual
            calls.append((needs[params], grads[params]))
            return grads

        monkeypatch.setitem(PRIMITIVES, name, dataclasses.replace(prim, vjp=vjp))

    recording("linear")
    recording("linear_add")
    recording("layer_norm_linear")
    model = _model()
    model(*_batch(0)).backward()
    frozen = [grads for needs, grads in calls if not needs[0]]
    assert len(frozen) == 6  # both attentions (c_attn, c_proj), blocks.1.mlp.c_fc, the tied lm_head
    assert all(g is None for grads in frozen for g in grads)  # weight (and bias) skipped


def test_unfreezing_after_fully_shard_is_refused(comm):
    model = _model()
    fully_shard(model, comm, units=model.blocks)
    model.blocks[0].attn.requires_grad_(True)
    with pytest.raises(RuntimeError, match="changed after fully_shard"):
        model(*_batch(0, comm)).backward()
    # The failed backward left nothing in flight or gathered (tape.backward -> backward_failed): the
    # unit that raised had its gather prefetched by the one before it.
    sharded = sharded_model(model)
    assert all(lc.stage is Stage.IDLE for lc in sharded.lifecycles)
    assert all(u.state == "sharded" for u in sharded.units)
    assert sharded.ledger.current["gathered_params"] == sharded.ledger.current["gathered_grads"] == 0
