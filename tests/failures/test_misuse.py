"""Misuse is named, on every rank: bad inputs, ranks that would silently diverge, invalid settings.

Runs at every N: where a case needs several ranks to exist (a rank that differs from the others) it
is checked under mpiexec, and at N = 1 the single-rank half of it is.
"""

import math

import numpy as np
import pytest

from mpifsdp import (
    SGD,
    AdamW,
    CollectiveError,
    Comm,
    LossScaler,
    NonFiniteError,
    Unit,
    full_state_dict,
    fully_shard,
    sharded_model,
)
from mpifsdp.comm.schedule import ScheduleError
from mpifsdp.models import GPT, GPTConfig, MLPClassifier
from mpifsdp.nn import Linear, Module
from mpifsdp.nn.layers import Dropout

CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8)
GOOD = np.zeros((2, 4), dtype=np.int64)
BAD_INPUTS = {
    "negative-target": (
        GOOD,
        np.full((2, 4), -2),
        r"targets holds -2, outside \[0, 16\) \(and is not the ignore",
    ),
    "id-past-vocab": (np.full((2, 4), 16), GOOD, r"idx \(token ids\) holds 16, outside \[0, 16\)"),
    "float-targets": (GOOD, np.zeros((2, 4)), "targets must be an integer array of ids, got a float64 array"),
    "one-dimensional-tokens": (
        np.zeros(4, dtype=np.int64),
        None,
        r"must have 2 dimensions, got \(4,\)",
    ),
    "a-list": ([[0, 1, 2, 3], [0, 1, 2, 3]], None, "must be an integer array of ids, got a list"),
    "too-long": (np.zeros((2, 5), dtype=np.int64), None, "sequence length 5 exceeds block_size 4"),
    "shapes-differ": (GOOD, np.zeros((2, 3), dtype=np.int64), r"targets \(2, 3\) and idx \(2, 4\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_on_one_rank_is_named_on_every_rank(comm, case):
    idx, targets, why = BAD_INPUTS[case]
    model = GPT(CFG, seed=0)
    with pytest.raises(ValueError, match=why):  # unsharded: the model says what is wrong
        model(idx, targets)
    fully_shard(model, comm, units=model.blocks)
    last = comm.rank == comm.size - 1
    with pytest.raises(CollectiveError, match=f"rank {comm.size - 1}: GPT: .*{why}"):
        model(idx if last else GOOD, targets if last else GOOD)
    model(GOOD, GOOD).backward()  # still usable


def test_the_mlp_checks_its_inputs_too():
    model = MLPClassifier([3, 4, 2])
    with pytest.raises(
        ValueError, match=r"x must be a float array of shape \(batch, 3\), got shape \(2, 5\)"
    ):
        model(np.ones((2, 5)), np.array([0, 1]))
    with pytest.raises(ValueError, match=r"targets holds 2, outside \[0, 2\)"):
        model(np.ones((2, 3), np.float32), np.array([0, 2]))


@pytest.mark.mpi(min_size=2)
def test_ranks_built_from_different_seeds_are_refused_or_synced(comm):
    with pytest.raises(CollectiveError, match="starts from different parameter values on different ranks"):
        fully_shard(GPT(CFG, seed=comm.rank), comm, units=[])
    model = fully_shard(GPT(CFG, seed=comm.rank), comm, units=[], sync_params=True)
    want = GPT(CFG, seed=0).state_dict()
    got = full_state_dict(model)
    assert all(np.array_equal(got[k], want[k]) for k in want)  # everyone has rank 0's values


@pytest.mark.mpi(min_size=2)
def test_a_configuration_that_differs_without_changing_shapes_is_refused(comm):
    heads = 4 if comm.rank == 0 else 2  # n_embd 8 divides either way: no shape changes
    config = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=heads, n_embd=8)
    with pytest.raises(CollectiveError, match="configuration differs between ranks.*n_head"):
        fully_shard(GPT(config, seed=0), comm, units=[])


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n_layer", 0, "n_layer=0: sizes are integers >= 1"),  # was a ZeroDivisionError
        ("vocab_size", 0, "vocab_size=0"),  # was a model with no vocabulary
        ("block_size", -1, "block_size=-1"),
        ("n_embd", 8.0, "n_embd=8.0"),
        ("dropout", 1.0, r"dropout=1.0 must be in \[0, 1\)"),  # was accepted
    ],
)
def test_a_configuration_that_cannot_make_a_model_is_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**CFG.__dict__, field: value})
    with pytest.raises(ValueError, match=r"Dropout: p=1.5 must be in \[0, 1\)"):
        Dropout(1.5)


@pytest.mark.parametrize("sizes", [[4, 0, 3], [4, -2, 3], [4, 2.5, 3]])
def test_an_mlp_of_sizes_below_one_is_refused_by_name(sizes):
    with pytest.raises(ValueError, match=r"sizes are integers >= 1"):  # [4, 0, 3] was accepted
        MLPClassifier(sizes)


@pytest.mark.parametrize(
    "option, message",
    [
        ({"prefetch": 1.5}, r"prefetch must be an integer >= 0 .*got 1.5"),  # was a TypeError from a slice
        ({"param_dtype": "bogus"}, r"param_dtype='bogus': give a floating dtype"),  # was NumPy's TypeError
        ({"param_dtype": np.int32}, r"param_dtype=<class 'numpy.int32'>: give a floating dtype"),  # a ufunc's
        ({"reduce_dtype": "float8"}, r"reduce_dtype='float8': give a floating dtype"),
        # bfloat16 is a GPU's type: NumPy has no bfloat16 arithmetic (ml_dtypes' matmul gives float32)
        (
            {"param_dtype": "bfloat16"},
            r"bfloat16 computes on a GPU only .* on the CPU give float16 or float32",
        ),
    ],
)
def test_an_option_fully_shard_cannot_use_is_refused_by_name(comm, option, message):
    with pytest.raises(ValueError, match=message):
        fully_shard(GPT(CFG, seed=0), comm, units=[], **option)


@pytest.mark.parametrize("option", ["recompute", "reshard_after_forward"])
def test_a_per_unit_setting_for_a_module_that_is_no_unit_is_refused(comm, option):
    model = GPT(CFG, seed=0)  # the blocks are not made units: their setting was dropped silently
    with pytest.raises(ValueError, match=f"{option} names modules that are not units \\(\\['Block'\\]\\)"):
        fully_shard(model, comm, units=model.blocks[1:], **{option: {model.blocks[0]: True}})


@pytest.mark.mpi(min_size=2)
def test_clipping_on_one_rank_only_is_named_on_every_rank_before_the_reduction(comm):
    model = fully_shard(GPT(CFG, seed=0), comm, units=[])
    opt = AdamW(model, lr=1e-3)
    model(GOOD, GOOD).backward()
    with pytest.raises(ScheduleError, match="the gradient norm of clip_grad_norm"):
        if comm.rank == 0:
            opt.clip_grad_norm(1.0)  # a scalar all-reduce the other ranks do not make for this purpose
        opt.step()  # the others: their own norm's all-reduce is compared with rank 0's, and differs


@pytest.mark.mpi(min_size=2)
def test_units_reduced_in_another_order_on_one_rank_are_caught_at_the_step(comm):
    """Hot-path collectives (a unit's reduce-scatter) carry no fingerprint of their own: two units of
    one size reduced in swapped order on one rank pair a's gradient with b's. The schedule check in
    step() names it on every rank before the mixed gradients are used."""
    a, b = Unit("a", {"w": np.zeros(4)}, comm), Unit("b", {"v": np.zeros(4)}, comm)
    opt = SGD([a, b], lr=0.1)
    for unit in [a, b] if comm.rank == 0 else [b, a]:
        unit.start_reduce_grad({unit.layout.names[0]: np.ones(4)})
        unit.finish_reduce_grad()
    with pytest.raises(ScheduleError, match="ranks disagree on the sequence of collectives"):
        opt.step()


@pytest.mark.parametrize(
    "variable, value, why",
    [
        ("MPIFSDP_TIMEOUT", "nan", "MPIFSDP_TIMEOUT='nan': give"),
        ("MPIFSDP_TIMEOUT", "0", "MPIFSDP_TIMEOUT='0': give"),
        ("MPIFSDP_TIMEOUT", "-5", "MPIFSDP_TIMEOUT='-5': give"),
        ("MPIFSDP_TIMEOUT", "abc", "MPIFSDP_TIMEOUT='abc': give"),
        ("MPIFSDP_DEBUG", "maybe", "MPIFSDP_DEBUG='maybe': use 1/true/yes/on or 0/false/no/off"),
    ],
)
def test_environment_variables_are_validated_by_name(comm, monkeypatch, variable, value, why):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=why):
        Comm(threads=None)


def test_comm_arguments_are_validated_by_name(comm):
    with pytest.raises(ValueError, match=r"Comm\(debug='no'\): give True, False, or None"):
        Comm(threads=None, debug="no")  # a string was truthy: debug on
    with pytest.raises(TypeError, match=r"takes an mpi4py communicator, not 'world'"):
        Comm(mpi_comm="world")


def test_debug_false_means_off(comm, monkeypatch):
    monkeypatch.setenv("MPIFSDP_DEBUG", "false")
    assert Comm(threads=None).schedule.debug is False
    monkeypatch.setenv("MPIFSDP_DEBUG", "On")
    assert Comm(threads=None).schedule.debug is True


@pytest.mark.parametrize(
    "kwargs, why",
    [
        (dict(lr=math.nan), r"lr=nan \(a finite number >= 0\)"),
        (dict(lr=-1e-3), r"lr=-0.001"),
        (dict(betas=(1.0, 0.9)), r"betas=\(1.0, 0.9\) \(two numbers in \[0, 1\)\)"),
        (dict(eps=0.0), r"eps=0.0 \(a finite number > 0\)"),
        (dict(weight_decay=-0.1), r"weight_decay=-0.1"),
    ],
)
def test_optimizer_settings_are_validated(comm, kwargs, why):
    with pytest.raises(ValueError, match=why):
        AdamW(MLPClassifier([3, 2]), **kwargs)


def test_optimizer_misuse(comm):
    model = fully_shard(MLPClassifier([3, 4, 2], seed=0), comm, units=[])
    unit = sharded_model(model).units[0]
    with pytest.raises(ValueError, match=r"AdamW got \['root'\] more than once"):
        AdamW([unit, unit])
    with pytest.raises(TypeError, match=r"not Unit: pass a list, \[unit\]"):  # was "not iterable"
        AdamW(unit)
    with pytest.raises(TypeError, match="a Module, a list of Params or a list of Units, not int"):
        SGD(3, lr=0.1)
    names = ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]
    assert list(full_state_dict(unit)) == names  # a Unit alone: was an AttributeError about state_dict
    opt = AdamW(model, lr=1e-2)
    assert opt.step() is False and opt.step_count == 0  # no gradients yet: nothing, not a step
    model(np.ones((2, 3), np.float32), np.array([0, 1])).backward()
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
            opt.clip_grad_norm(bad)
    opt.lr = math.nan  # e.g. a broken schedule: named as such, not blamed on the gradients
    with pytest.raises(ValueError, match="AdamW.lr is nan"):
        opt.step()
    assert all(np.isfinite(v).all() for v in full_state_dict(model).values())


def test_masters_outgrowing_float16_are_named(comm):
    model = fully_shard(MLPClassifier([3, 4, 2], seed=0), comm, units=[], param_dtype=np.float16)
    sharded_model(model).units[0].shard[:3] = 1e5  # beyond float16's 65504
    with pytest.raises(FloatingPointError, match="parameter values no longer fit float16"):
        model(np.ones((2, 3), np.float16), np.array([0, 1]))


def test_a_loss_scaler_that_keeps_skipping_says_so(comm):
    model = fully_shard(MLPClassifier([3, 4, 2], seed=0), comm, units=[], param_dtype=np.float16)
    opt, scaler = AdamW(model), LossScaler(init_scale=2.0**4, max_skips_in_a_row=3)
    x, y = np.ones((2, 3), np.float16), np.array([0, 1])
    for step in range(3):
        scaler.scale(model(x, y)).backward()
        sharded_model(model).units[0].grad_shard[0] = np.inf  # every step overflows
        if step < 2:
            assert scaler.step(opt) is False
        else:
            with pytest.raises(
                NonFiniteError, match="the gradients overflow at loss scale 4 \\(3 steps in a row"
            ):
                scaler.step(opt)
        opt.zero_grad()


@pytest.mark.mpi(min_size=2)
def test_units_used_in_another_order_on_one_rank_are_named_at_the_gather(comm):
    """The framework-free path: a user's gather (`unsharded()`) is compared before it runs, so units
    used in another order on one rank are named on every rank before their gathers pair silently."""
    from mpifsdp import Unit

    a, b = Unit("a", {"w": np.ones(6)}, comm), Unit("b", {"w2": np.ones(6)}, comm)  # equal sizes
    with pytest.raises(ScheduleError, match=r"ranks disagree .*\(before other gather of unit '(a|b)'"):
        for unit in (a, b) if comm.rank == 0 else (b, a):
            with unit.unsharded() as p:
                grads = {name: np.ones_like(value) for name, value in p.items()}
            unit.reduce_grad(grads)


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


def test_units_that_are_not_submodules_and_a_second_fully_shard_are_refused(comm):
    model = MLPClassifier([3, 4, 2])
    with pytest.raises(ValueError, match="units must be submodules"):
        fully_shard(model, comm, units=[MLPClassifier([3, 2]).layers[0]])
    with pytest.raises(ValueError, match=r"units lists \['layers.0'\] more than once"):  # was: tied weights
        fully_shard(model, comm, units=[model.layers[0], model.layers[0]])
    fully_shard(model, comm, units=model.layers[:1])
    with pytest.raises(RuntimeError, match="already called on this model"):
        fully_shard(model, comm)
