"""fully_shard: exact communication and memory, freeing, the end-of-backward sweep, and errors."""

import gc
import weakref

import numpy as np
import pytest
from conftest import agree

from mpifsdp import AdamW, CollectiveError, ShardedParameterError, Tensor, fully_shard, ops
from mpifsdp.fsdp import fsdp_group
from mpifsdp.layers import Linear, Module
from mpifsdp.models import GPT, GPTConfig, MLPClassifier

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=10)


def _batch(comm, seed=0):
    rng = np.random.default_rng(seed + comm.rank)
    return rng.integers(0, 37, (2, 8)), rng.integers(0, 37, (2, 8))


def _step(model, opt, x, y):
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_communication_per_step_is_exact(comm):
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks)
    opt = AdamW(model, lr=1e-3)
    comm.ledger.reset()
    _step(model, opt, *_batch(comm))
    N, ledger, units = comm.size, comm.ledger, fsdp_group(model).units
    for unit in units:
        for phase, op in (
            ("forward", "all_gather"),
            ("backward", "all_gather"),
            ("backward", "reduce_scatter"),
        ):
            assert ledger.total("calls", unit=unit.name, phase=phase, op=op) == 1, (unit.name, phase, op)
            assert ledger.total("elements", unit=unit.name, phase=phase, op=op) == (N - 1) * unit.numel
    assert ledger.total("calls") == 3 * len(units) == 3 * (CFG.n_layer + 1)
    total_padded = sum(u.layout.padded_numel for u in units)
    assert ledger.total("elements") * N == 3 * (N - 1) * total_padded  # 3 (N-1)/N sum(padded)
    assert ledger.total("bytes") == 4 * ledger.total("elements")


def test_memory_is_exact_and_nothing_stays_gathered(comm):
    model = MLPClassifier([7, 13, 5, 3], seed=0)  # every layer a unit: the root holds nothing
    fully_shard(model, comm, units=model.layers)
    opt = AdamW(model, lr=1e-3)
    ledger = fsdp_group(model).ledger
    x, y = np.random.default_rng(comm.rank).standard_normal((4, 7), dtype=np.float32), np.arange(4) % 3
    for _ in range(2):
        _step(model, opt, x, y)
    units = fsdp_group(model).units
    shard_numel = sum(u.numel for u in units)
    largest = max(u.layout.padded_numel for u in units) * 4
    report = ledger.report()
    assert report["persistent"] == 16 * shard_numel  # fp32 params, grads, m, v
    assert report["current"]["gathered_params"] == 0 and report["current"]["gathered_grads"] == 0
    assert report["peak"]["gathered_params"] == largest  # one unit at a time, no prefetch yet
    assert all(u.full is None and u.full_grad is None for u in units)
    assert all(p._data is None for p in model.parameters())


def test_root_stays_gathered_next_to_one_block(comm):
    """The root unit (embeddings, ln_f, tied head) is gathered through forward and backward, as in FSDP2."""
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks)
    _step(model, AdamW(model, lr=1e-3), *_batch(comm))
    group = fsdp_group(model)
    root, blocks = group.root.unit, [u for u in group.units if u is not group.root.unit]
    peak = group.ledger.report()["peak"]["gathered_params"]
    assert peak == 4 * (root.layout.padded_numel + max(b.layout.padded_numel for b in blocks))


def test_gathered_parameters_are_freed_after_forward(comm):
    """Invariant 1 end to end: no tape entry keeps a view of a unit's gathered buffer alive."""
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks)
    refs = []
    for unit in fsdp_group(model).units:
        original = unit.unshard

        def tracking_unshard(phase="forward", unit=unit, original=original):
            views = original(phase)
            refs.append(weakref.ref(unit.full))
            return views

        unit.unshard = tracking_unshard
    loss = model(*_batch(comm))
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert len(refs) == CFG.n_layer + 1 and alive == 0, f"{alive} gathered buffers still alive after forward"
    loss.backward()


class TwoHeads(Module):
    """The second head's output is computed but not used by the loss."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.body = Linear(4, 4, rng=rng)
        self.used = Linear(4, 3, rng=rng)
        self.unused = Linear(4, 3, rng=rng)

    def forward(self, x, y):
        h = ops.gelu(self.body(x))
        self.unused(h)
        return ops.cross_entropy(self.used(h), y)


def test_units_backward_never_reached_are_still_reduced(comm):
    model = TwoHeads()
    fully_shard(model, comm, units=[model.body, model.used, model.unused])
    comm.ledger.reset()
    loss = model(np.ones((2, 4), np.float32), np.array([0, 2]))
    loss.backward()
    unused = next(u for u in fsdp_group(model).units if u.name == "unused")
    assert comm.ledger.total("calls", unit="unused", op="reduce_scatter") == 1
    assert unused.has_grad and not unused.grad_shard.any() and unused.full is None


def test_parameter_used_outside_its_unit_names_it(comm):
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks)
    with pytest.raises(ShardedParameterError, match=r"'blocks.1.ln_1.weight'.*unit 'blocks.1' is sharded"):
        model.blocks[1].ln_1(Tensor(np.ones((1, 2, 10), np.float32)))


class Tied(Module):
    def __init__(self):
        rng = np.random.default_rng(0)
        self.a = Linear(3, 3, rng=rng)
        self.b = Linear(3, 3, rng=rng)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


def test_tied_weights_split_across_units_are_refused(comm):
    model = Tied()
    with pytest.raises(
        CollectiveError, match=r"'a.weight': \['a', 'root'\].*tied weights must live in one unit"
    ):
        fully_shard(model, comm, units=[model.a])
    fully_shard(Tied(), comm)  # both in the root: fine


def test_fully_shard_misuse(comm):
    model = MLPClassifier([3, 4, 2])
    with pytest.raises(ValueError, match="units must be submodules"):
        fully_shard(model, comm, units=[MLPClassifier([3, 2]).layers[0]])
    fully_shard(model, comm, units=model.layers[:1])
    with pytest.raises(RuntimeError, match="already called on this model"):
        fully_shard(model, comm)


def test_eval_under_no_grad_leaves_nothing_behind(comm):
    from mpifsdp import no_grad

    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks)
    with no_grad():
        logits = model(_batch(comm)[0])
    group = fsdp_group(model)
    agree(comm, logits.shape == (2, 8, 37) and not group.pending, "eval left pending units")
    assert all(u.full is None for u in group.units)
