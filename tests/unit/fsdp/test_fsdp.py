"""fully_shard: exact communication and memory, freeing, the end-of-backward sweep, and errors."""

import numpy as np
import pytest

from mpifsdp import (
    AbsentDataError,
    AdamW,
    Tensor,
    full_state_dict,
    fully_shard,
    ops,
    sharded_model,
)
from mpifsdp.fsdp.lifecycle import Stage
from mpifsdp.models import GPT, GPTConfig, MLPClassifier
from mpifsdp.nn.layers import Linear
from mpifsdp.nn.module import Module

from support import agree

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
    fully_shard(model, comm, units=model.blocks, reshard_root=True)  # every unit: 3 collectives
    opt = AdamW(model, lr=1e-3)
    comm.ledger.reset()
    _step(model, opt, *_batch(comm))
    N, ledger, units = comm.size, comm.ledger, sharded_model(model).units
    for unit in units:
        for phase, op in (
            ("forward", "all_gather"),
            ("backward", "all_gather"),
            ("backward", "reduce_scatter"),
        ):
            assert ledger.total("calls", unit=unit.name, phase=phase, op=op) == 1, (unit.name, phase, op)
            assert ledger.total("elements", unit=unit.name, phase=phase, op=op) == (N - 1) * unit.numel
    gathers_and_reductions = [ledger.total(what, op=op) for what in ("calls", "elements", "bytes")
                              for op in ("all_gather", "reduce_scatter")]  # fmt: skip
    calls, elements, nbytes = (sum(gathers_and_reductions[i : i + 2]) for i in (0, 2, 4))
    assert calls == 3 * len(units) == 3 * (CFG.n_layer + 1)
    total_padded = sum(u.layout.padded_numel for u in units)
    assert elements * N == 3 * (N - 1) * total_padded  # 3 (N-1)/N sum(padded)
    assert nbytes == 4 * elements
    # besides: the batch-size check and the loss's count of valid targets (one int each), and
    # AdamW's global grad norm (one float64)
    for op in ("batch_size_check", "valid_target_count", "all_reduce"):
        assert ledger.total("calls", op=op) == 1, op


@pytest.mark.parametrize("keep", ["root", "all"])
def test_units_kept_after_forward_skip_the_backward_gather(comm, keep):
    """reshard_after_forward=False (and the root by default): 2 collectives per step instead of 3."""
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks, reshard_after_forward=keep == "root")
    opt = AdamW(model, lr=1e-3)
    _step(model, opt, *_batch(comm))  # the first step also builds the prefetch order
    comm.ledger.reset()
    _step(model, opt, *_batch(comm))
    for unit in sharded_model(model).units:
        kept = keep == "all" or unit.name == "root"
        assert comm.ledger.total("calls", unit=unit.name, phase="backward", op="all_gather") == (
            0 if kept else 1
        )
        assert comm.ledger.total("calls", unit=unit.name) == (2 if kept else 3)
        assert unit.full is None and unit.full_grad is None


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_memory_is_exact_and_nothing_stays_gathered(comm, prefetch):
    """Gathered peak = (1 + prefetch) units exactly; persistent = 16 bytes per shard element."""
    model = MLPClassifier([8] * 6, seed=0)  # 5 equal units of 72 elements; the root holds nothing
    fully_shard(model, comm, units=model.layers, prefetch=prefetch)
    opt = AdamW(model, lr=1e-3)
    sharded = sharded_model(model)
    x, y = np.random.default_rng(comm.rank).standard_normal((4, 8), dtype=np.float32), np.arange(4) % 3
    for _ in range(3):
        _step(model, opt, x, y)
    unit_bytes = sharded.units[0].layout.padded_numel * 4
    report = sharded.ledger.report()
    assert report["persistent"] == 16 * sum(u.numel for u in sharded.units)  # fp32 params, grads, m, v
    assert report["current"]["gathered_params"] == 0 and report["current"]["gathered_grads"] == 0
    assert report["peak"]["gathered_params"] == (1 + prefetch) * unit_bytes
    assert report["peak"]["gathered_grads"] <= 2 * unit_bytes  # one reduce-scatter left in flight
    assert sharded.pool.nbytes <= (1 + prefetch + 2) * unit_bytes  # buffers are reused, not re-allocated
    assert all(u.full is None and u.full_grad is None for u in sharded.units)
    assert all(p._data is None for p in model.parameters())


def test_root_stays_gathered_next_to_one_block(comm):
    """The root unit (embeddings, ln_f, tied head) stays gathered through forward and backward (FSDP2)."""
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks)
    _step(model, AdamW(model, lr=1e-3), *_batch(comm))
    sharded = sharded_model(model)
    root, blocks = sharded.units[-1], sharded.units[:-1]  # the root unit is the last
    peak = sharded.ledger.report()["peak"]["gathered_params"]
    assert peak == 4 * (
        root.layout.padded_numel + 2 * max(b.layout.padded_numel for b in blocks)
    )  # prefetch 1


def _arrays_in(value):
    if isinstance(value, np.ndarray):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _arrays_in(v)


def test_tape_holds_no_view_of_gathered_parameters(comm):
    """Invariant 1 end to end: after forward, nothing the tape keeps shares memory with a gather buffer."""
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks, reshard_root=True)
    loss = model(*_batch(comm))
    sharded = sharded_model(model)
    assert all(u.full is None for u in sharded.units)
    buffers = [b for free in sharded.pool._free.values() for b in free]
    assert buffers, "the forward gathered through the pool"
    held, stack, seen = [], [loss], set()
    while stack:  # every array the graph keeps: saved values and non-parameter inputs
        t = stack.pop()
        if id(t) in seen or t._node is None:
            continue
        seen.add(id(t))
        held += list(_arrays_in(t._node.saved))
        held += [i._data for i in t._node.inputs if isinstance(i._data, np.ndarray)]
        stack += list(t._node.inputs)
    leaks = sum(np.shares_memory(a, b) for a in held for b in buffers)
    # the walk reached the graph: at least every Linear's kept input (four per block, and the head)
    assert len(held) >= 4 * CFG.n_layer + 1, len(held)
    assert leaks == 0, f"{leaks} tape arrays alias gathered parameters"
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
    unused = next(u for u in sharded_model(model).units if u.name == "unused")
    assert comm.ledger.total("calls", unit="unused", op="reduce_scatter") == 1
    assert unused.has_grad and not unused.grad_shard.any() and unused.full is None


def test_parameter_used_outside_its_unit_names_it(comm):
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks)
    with pytest.raises(AbsentDataError, match=r"'blocks.1.ln_1.weight'.*unit 'blocks.1' is sharded"):
        model.blocks[1].ln_1(Tensor(np.ones((1, 2, 10), np.float32)))


def test_layernorms_that_are_units_of_their_own_are_called_not_fused(comm):
    """A block fuses its LayerNorm into the next projection only while the LayerNorm has no hooks:
    made a unit of its own, it is called (its gather runs), and the loss is the unsharded one."""
    ids = np.arange(16).reshape(2, 8) % CFG.vocab_size
    expected = GPT(CFG, seed=0)(ids, ids).item()
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=[block.ln_1 for block in model.blocks] + [model.ln_f])
    loss = model(ids, ids)
    loss.backward()
    assert loss.item() == expected  # every rank the same batch: the same arithmetic as unsharded
    assert all(np.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_eval_under_no_grad_leaves_nothing_behind(comm):
    from mpifsdp import no_grad

    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks)
    with no_grad():
        logits = model(_batch(comm)[0])
    sharded = sharded_model(model)
    idle = all(lc.stage is Stage.IDLE for lc in sharded.lifecycles)
    agree(comm, logits.shape == (2, 8, 37) and idle, "eval left units awaiting backward")
    assert all(u.full is None for u in sharded.units)


def test_deferred_init_materializes_one_unit_at_a_time(comm):
    """A model built under deferred_init has no parameter memory until fully_shard makes each unit,
    keeps this rank's shard, and drops the rest: the same shards as an eager build."""
    import tracemalloc

    from mpifsdp import deferred_init

    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=12, n_head=2, n_embd=32)
    eager = GPT(cfg, seed=0)
    fully_shard(eager, comm, units=eager.blocks)
    with deferred_init():
        lazy = GPT(cfg, seed=0)
    assert all(p._data is None for p in lazy.parameters()) and lazy.num_params() == eager.num_params()
    with pytest.raises(AbsentDataError, match="built under deferred_init"):
        lazy(np.zeros((1, 4), dtype=np.int64))
    tracemalloc.start()
    fully_shard(lazy, comm, units=lazy.blocks)
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    sharded = sharded_model(lazy)
    unit_bytes = max(u.layout.padded_numel for u in sharded.units) * 4
    # what it keeps: the shards (and its bookkeeping objects); beyond that, at its peak, one unit's
    # float32 arrays and one parameter's float64 draw at most
    assert kept >= sharded.ledger.persistent()
    assert peak - kept <= 4 * unit_bytes < 4 * lazy.num_params() / 2
    want, got = full_state_dict(eager), full_state_dict(lazy)
    agree(comm, all(np.array_equal(want[k], got[k]) for k in want), "deferred init differs from eager")


def test_report_gives_every_ranks_ledgers(comm):
    import mpifsdp

    model = MLPClassifier([4, 4, 3], seed=0)
    with pytest.raises(ValueError, match="report\\(\\) needs a model fully_shard\\(\\) was called on"):
        mpifsdp.report(model)
    fully_shard(model, comm, units=model.layers[:1])
    reports = mpifsdp.report(model)
    assert [r["rank"] for r in reports] == list(range(comm.size))
    persistent = 8 * sum(u.numel for u in sharded_model(model).units)  # param and grad shards, fp32
    assert all(r["memory"]["persistent"] == persistent for r in reports)


def _trained_shards(comm, **shard_settings) -> list:
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks, **shard_settings)
    opt = AdamW(model, lr=1e-2)
    for step in range(2):
        x, y = _batch(comm, seed=step)
        if shard_settings.get("deterministic"):
            for chunk in sharded_model(model).chunks(x, y):
                model(*chunk).backward()
        else:
            model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return [unit.shard.copy() for unit in sharded_model(model).units]


def test_policy_objects_train_as_the_keywords_they_group(comm):
    """MixedPrecision(param_dtype, reduce_dtype) and Deterministic(chunk_size, chunk_threads) are the
    keywords they group: the same shards after two steps, bit for bit."""
    from mpifsdp import Deterministic, MixedPrecision

    pairs = (
        (
            dict(param_dtype=np.float16, reduce_dtype=np.float32),
            dict(mixed_precision=MixedPrecision(np.float16, np.float32)),
        ),
        (dict(deterministic=True, chunk_size=1), dict(deterministic=Deterministic(chunk_size=1))),
    )
    for keywords, policy in pairs:
        for a, b in zip(_trained_shards(comm, **keywords), _trained_shards(comm, **policy)):
            np.testing.assert_array_equal(a, b)


def test_a_setting_given_both_ways_or_a_wrong_policy_is_refused(comm):
    from mpifsdp import Deterministic, MixedPrecision

    with pytest.raises(ValueError, match=r"param_dtype given both as a keyword and in MixedPrecision\(\)"):
        fully_shard(
            GPT(CFG, seed=0), comm, param_dtype=np.float16, mixed_precision=MixedPrecision(np.float16)
        )
    with pytest.raises(ValueError, match=r"chunk_size given both .* in Deterministic\(\)"):
        fully_shard(GPT(CFG, seed=0), comm, chunk_size=2, deterministic=Deterministic(chunk_size=2))
    with pytest.raises(TypeError, match="expected a MixedPrecision, got dict"):
        fully_shard(GPT(CFG, seed=0), comm, mixed_precision={"param_dtype": np.float16})
    with pytest.raises(TypeError, match="deterministic must be True, False or a Deterministic"):
        fully_shard(GPT(CFG, seed=0), comm, deterministic=MixedPrecision(np.float16))
