"""Failures end the job promptly with a precise message; bad input gets a clear error on every rank.

Scenarios that hang or kill a rank run as real `mpiexec` jobs in subprocesses, with timeouts.
"""

import contextlib
import re
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpifsdp import (
    AdamW,
    CollectiveError,
    NonFiniteError,
    Unit,
    full_state_dict,
    fully_shard,
    no_grad,
    sharded_model,
)
from mpifsdp.base.backend import parse_device
from mpifsdp.models import GPT, GPTConfig, MLPClassifier

from support import agree, run_job

CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=3, n_head=2, n_embd=8)

PRELUDE = textwrap.dedent(
    """
    import os, signal, sys, time
    import numpy as np
    from mpifsdp import AdamW, Comm, fully_shard
    from mpifsdp.models import GPT, GPTConfig

    comm = Comm()
    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=3, n_head=2, n_embd=8), seed=0)
    fully_shard(model, comm, units=model.blocks)
    opt = AdamW(model, lr=1e-3)
    x = np.zeros((2, 4), dtype=np.int64)

    def step():
        model(x, x).backward()
        opt.step()
        opt.zero_grad()

    step()
    """
)

SCENARIOS = {
    # rank 1 runs block 2 where the others run block 1: a data-dependent branch
    "skip_unit": """
        def skipping_forward(idx, targets):
            h = model.wte(idx) + model.wpe(np.arange(idx.shape[1]))
            for i, block in enumerate(model.blocks):
                if not (comm.rank == 1 and i == 1):
                    h = block(h)
            from mpifsdp import ops
            return ops.cross_entropy(ops.linear(model.ln_f(h), model.wte.weight, transpose_w=True), targets)
        model.forward = skipping_forward
        for _ in range(3):
            step()
        """,
    # rank 1 runs blocks 0 and 1 in the other order; without prefetch (which follows each rank's own
    # last order) every collective still pairs with one of the same op and size, of another unit
    "swap_units": """
        model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=3, n_head=2, n_embd=8), seed=0)
        fully_shard(model, comm, units=model.blocks, prefetch=0)
        opt = AdamW(model, lr=1e-3)

        def swapped_forward(idx, targets):
            h = model.wte(idx) + model.wpe(np.arange(idx.shape[1]))
            for i in ([1, 0, 2] if comm.rank == 1 else [0, 1, 2]):
                h = model.blocks[i](h)
            from mpifsdp import ops
            return ops.cross_entropy(ops.linear(model.ln_f(h), model.wte.weight, transpose_w=True), targets)

        model.forward = swapped_forward
        for _ in range(3):
            step()
        print("finished without noticing")
        """,
    "sleep": """
        if comm.rank == 1:
            time.sleep(20)
        step()
        """,
    "sigkill": """
        for i in range(10_000):
            if comm.rank == 1 and i == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            step()
        """,
}


def run_scenario(comm, tmp_path, name, env=None, timeout=120):
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    script = tmp_path / f"{name}.py"
    script.write_text(PRELUDE + textwrap.dedent(SCENARIOS[name]))
    result, elapsed = run_job(script, 3, env=env, timeout=timeout)
    print(f"{name}: exit {result.returncode} after {elapsed:.1f} s")
    return result, elapsed


def test_a_skipped_unit_is_named_on_every_rank_in_debug_mode(comm, tmp_path):
    # a short watchdog: without the debug check the divergence would end in the watchdog instead
    env = {"MPIFSDP_DEBUG": "1", "MPIFSDP_TIMEOUT": "10"}
    result, elapsed = run_scenario(comm, tmp_path, "skip_unit", env)
    assert result.returncode != 0 and elapsed < 30
    assert "ScheduleError: ranks disagree on the sequence of collectives" in result.stderr
    # Forward gathers run ahead in registration order on every rank, so the skip shows in backward,
    # whose order is the reverse of what each rank actually ran: caught before the first divergence.
    at = r"-> backward gather of unit 'blocks.{}' \(873 x float32, collective #(\d+)\)"
    rank0, rank1 = re.search(at.format(1), result.stderr), re.search(at.format(0), result.stderr)
    assert rank0 and rank1 and rank0[1] == rank1[1], result.stderr  # the same position, different units


def test_a_skipped_unit_ends_the_job_without_debug_mode(comm, tmp_path):
    result, elapsed = run_scenario(comm, tmp_path, "skip_unit", {"MPIFSDP_TIMEOUT": "5"})
    assert result.returncode != 0 and elapsed < 30
    assert "ScheduleError" in result.stderr or "mpifsdp watchdog" in result.stderr


def test_units_swapped_on_one_rank_are_caught_by_the_per_step_check(comm, tmp_path):
    """Equal-sized collectives of different units pair silently; the comparison of the ranks'
    fingerprint hashes at the start of backward stops the job before the mixed values are used."""
    result, elapsed = run_scenario(comm, tmp_path, "swap_units", {"MPIFSDP_TIMEOUT": "10"})
    assert result.returncode != 0 and elapsed < 30, result.stdout + result.stderr
    assert "ScheduleError: ranks disagree on the sequence of collectives (at the start of a backward)" in (
        result.stderr
    )
    assert "finished without noticing" not in result.stdout


def test_a_stalled_rank_trips_the_watchdog_which_names_the_collective(comm, tmp_path):
    result, elapsed = run_scenario(comm, tmp_path, "sleep", {"MPIFSDP_TIMEOUT": "3"})
    assert result.returncode != 0 and elapsed < 3 + 12  # rank 1 sleeps 20 s
    # ranks 0 and 2 wait; whichever times out first aborts the job (the other may not get to print)
    assert re.search(r"mpifsdp watchdog: rank [02] waited 3\.0 s in forward batch-size check", result.stderr)
    assert "rank 1 waited" not in result.stderr  # the sleeping rank never arrived: it does not report


def test_a_killed_rank_ends_the_job(comm, tmp_path):
    result, elapsed = run_scenario(comm, tmp_path, "sigkill", {"MPIFSDP_TIMEOUT": "10"})
    assert result.returncode != 0 and elapsed < 30


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_nan_on_one_rank_is_seen_by_every_rank(comm, policy):
    model = MLPClassifier([5, 7, 3], seed=0)
    fully_shard(model, comm, units=model.layers)
    opt = AdamW(model, lr=1e-2, nonfinite=policy)
    x, y = np.ones((2, 5), np.float32), np.array([0, 2])
    model(x, y).backward()
    before = full_state_dict(model)
    if comm.rank == comm.size - 1:
        sharded_model(model).units[0].grad_shard[0] = np.nan  # one rank's gradient goes bad
    if policy == "raise":
        with pytest.raises(NonFiniteError, match="gradient norm is nan"):
            opt.step()
    else:
        assert opt.step() is False and opt.skipped_steps == 1 and opt.step_count == 0
    after = full_state_dict(model)
    finite_and_unchanged = all(
        np.isfinite(after[k]).all() and np.array_equal(after[k], before[k]) for k in after
    )
    agree(comm, finite_and_unchanged, "parameters changed or went non-finite")
    opt.zero_grad()
    model(x, y).backward()
    assert opt.step() is True  # the next good step goes through


@pytest.mark.mpi(min_size=2)
def test_uneven_batches_are_refused_on_every_rank(comm):
    model = GPT(CFG, seed=0)
    fully_shard(model, comm, units=model.blocks)
    rows = 3 if comm.rank == 0 else 2
    x = np.zeros((rows, 4), dtype=np.int64)
    with pytest.raises(CollectiveError, match=r"different batch sizes \{0: 3, 1: 2"):
        model(x, x)
    model(x[:2], x[:2]).backward()  # the model is usable afterwards


@pytest.mark.mpi(min_size=2)
def test_an_uneven_evaluation_batch_is_allowed_and_a_forward_of_another_kind_is_refused(comm):
    """Under no_grad nothing is averaged: an uneven last validation batch was refused for a gradient
    reason that does not apply. Its loss is still the global mean (the count of valid targets is
    global). A rank in no_grad beside ranks with gradients is named on every rank."""
    model = GPT(CFG, seed=0, dtype=np.float64)
    fully_shard(model, comm, units=model.blocks)
    everything = np.random.default_rng(0).integers(0, CFG.vocab_size, (2 * comm.size + 1, 4))
    start = 0 if comm.rank == 0 else 3 + 2 * (comm.rank - 1)  # rank 0 holds 3 rows, the others 2
    mine = everything[start : start + (3 if comm.rank == 0 else 2)]
    with no_grad():
        local = model(mine, mine).item()
    plain = GPT(CFG, seed=0, dtype=np.float64)
    with no_grad():
        want = plain(everything, everything).item()
    total = comm.all_reduce_scalar(local) / comm.size
    # float64: the two sums differ only in their order, a few ulps (1e-12 leaves three orders of margin)
    agree(comm, abs(total - want) <= 1e-12 * abs(want), f"uneven evaluation {total}, single process {want}")
    x = np.zeros((2, 4), dtype=np.int64)
    with pytest.raises(CollectiveError, match=r"ranks \[1\] run this forward under no_grad\(\)"):
        with no_grad() if comm.rank == 1 else contextlib.nullcontext():
            model(x, x)
    model(x, x).backward()  # usable afterwards


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("change", ["eval", "dropout rate", "heads"])
def test_a_setting_that_changes_the_mathematics_on_one_rank_is_named_on_every_rank(comm, change):
    """model.eval() (or another dropout rate, another head count) on one rank after fully_shard ran
    silently: the ranks averaged gradients of different functions. The next forward names it."""
    model = GPT(GPTConfig(**{**vars(CFG), "dropout": 0.1}), seed=0)
    fully_shard(model, comm, units=model.blocks)
    x = np.zeros((2, 4), dtype=np.int64)
    model(x, x).backward()
    if comm.rank == 1:
        if change == "eval":
            model.eval()
        elif change == "dropout rate":
            model.blocks[0].mlp.drop.p = 0.2
        else:
            model.blocks[1].attn.n_head = 1
    said = {"eval": r"training \{0: True, 1: False.*\} in \d+ modules \(GPT, blocks\.0, \.\.\.\)",
            "dropout rate": r"p \{0: 0\.1, 1: 0\.2.*\} in blocks\.0\.mlp\.drop\.",
            "heads": r"n_head \{0: 2, 1: 1.*\} in blocks\.1\.attn\."}[change]  # fmt: skip
    with pytest.raises(CollectiveError, match=said):
        model(x, x)
    if comm.rank == 1:
        model.train()
        model.blocks[0].mlp.drop.p, model.blocks[1].attn.n_head = 0.1, CFG.n_head
    model(x, x).backward()  # agreed again: usable


def test_optimizer_built_before_sharding(comm):
    model = MLPClassifier([3, 4, 2])
    opt = AdamW(model)
    fully_shard(model, comm, units=model.layers)
    model(np.ones((1, 3), np.float32), np.array([1])).backward()
    with pytest.raises(RuntimeError, match="built before fully_shard"):
        opt.step()


def test_more_ranks_than_elements_leaves_empty_shards_that_work(comm):
    """A 1x1 linear (2 numbers) at N = 4: two ranks hold only padding, and training still agrees."""
    model, ref = (MLPClassifier([3, 1, 2], seed=1, dtype=np.float64) for _ in range(2))
    fully_shard(model, comm, units=model.layers)
    opts = AdamW(model, lr=0.1), AdamW(ref, lr=0.1)
    x, y = (
        np.random.default_rng(0).standard_normal((comm.size * 2, 3)),
        np.arange(comm.size * 2) % 2,
    )
    for m, opt, (xs, ys) in zip(
        (model, ref),
        opts,
        [(x[comm.rank * 2 : comm.rank * 2 + 2], y[comm.rank * 2 : comm.rank * 2 + 2]), (x, y)],
    ):
        m(xs, ys).backward()
        opt.step()
    got, want = full_state_dict(model), ref.state_dict()
    # float64: one AdamW step (about lr = 0.1 per weight) from sums over 2 rows per rank in another
    # order, a few ulps; wrong padding or a lost gradient would be off by O(lr)
    agree(
        comm,
        all(np.allclose(got[k], want[k], rtol=0, atol=1e-12) for k in want),
        "empty shards broke training",
    )


def test_bad_devices_and_non_contiguous_arrays(comm):
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        parse_device("tpu")
    w = np.arange(12.0).reshape(3, 4).T  # a non-contiguous view
    unit = Unit("t", {"w": w}, comm)
    with unit.unsharded() as full:
        assert np.array_equal(full["w"], w)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        comm.all_gather(np.zeros(4)[::2], np.zeros(2 * comm.size))


@settings(max_examples=25, deadline=None, derandomize=True, database=None)  # same examples on every rank
@given(
    shapes=st.lists(st.lists(st.integers(1, 5), max_size=3).map(tuple), min_size=1, max_size=4),
    dtype=st.sampled_from([np.float32, np.float64, np.float16]),
)
def test_unit_gather_of_shard_is_identity_with_zero_padding(comm, shapes, dtype):
    """Random shapes and dtypes at this world size: unshard returns the arrays, padding stays zero."""
    rng = np.random.default_rng(len(shapes))
    arrays = {f"t{i}": rng.standard_normal(s).astype(dtype) for i, s in enumerate(shapes)}
    unit = Unit("p", arrays, comm)
    full = unit.unshard()
    same = all(np.array_equal(full[k], arrays[k]) for k in arrays)
    padding = unit.full[unit.layout.numel :]
    assert same and not padding.any()
    unit.reshard()
    unit.reduce_grad({k: np.ones_like(v) for k, v in arrays.items()})
    assert np.all(unit.gather(unit.grad_shard)["t0"] == 1)
