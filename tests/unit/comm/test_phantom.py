"""PhantomComm: rank k of an N-way job in one process (comm/phantom.py). Its first step equals a
one-rank job's on the same batch (the peers' stand-ins their true initial slices), its ledgers are
what the planner says rank k of N holds and sends, and what it cannot stand in for is refused."""

import numpy as np
import pytest
from mpi4py import MPI

from mpifsdp import AdamW, Comm, PhantomComm, fully_shard, sharded_model
from mpifsdp.models import GPT, GPTConfig, gpt_units
from mpifsdp.planning.planner import plan

# blocks of 1330 elements and a root of 470: shards pad at N = 3, 4 and 8
CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10, tie_weights=True)
LR = 1e-2


def _one_step(comm):
    """(loss, {unit: shard after one AdamW step}, sharded model) of the tiny GPT on one fixed batch."""
    model = GPT(CFG, seed=3, dtype=np.float64)
    fully_shard(model, comm, units=model.blocks)
    opt = AdamW(model, lr=LR, weight_decay=0.1)
    rng = np.random.default_rng(0)
    loss = model(rng.integers(0, 37, (4, 8)), rng.integers(0, 37, (4, 8)))
    loss.backward()
    opt.step()
    return float(loss.item()), {u.name: u.shard.copy() for u in opt.groups}, sharded_model(model)


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_a_phantom_ranks_first_step_is_a_one_rank_jobs(size):
    """Every rank k of N: the same loss, and its slice of the parameters after the step equals the
    one-rank job's. A power-of-two N scales the reduction exactly (N g / N = g); at N = 3 the
    mean's rounding (one ulp of each gradient) moves AdamW's first update (lr sign(g)) by a few ulps."""
    one_loss, one, _ = _one_step(Comm(MPI.COMM_SELF, threads=None))
    exact = size & (size - 1) == 0
    for rank in range(size):
        loss, mine, sharded = _one_step(PhantomComm(size, rank, peers="initial", threads=None))
        assert loss == one_loss
        for unit in sharded.units:
            lo, hi = unit.layout.shard_range(rank)
            want = one[unit.name][lo : min(hi, unit.layout.numel)]
            got = mine[unit.name][: want.size]
            bound = 0.0 if exact else 8 * np.finfo(np.float64).eps * max(LR, float(abs(want).max()))
            assert np.abs(got - want).max() <= bound, (size, rank, unit.name)
            assert not mine[unit.name][want.size :].any()  # the padding stays zero


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("peers", ["mine", "initial"])
def test_a_phantoms_ledgers_are_what_the_plan_says_rank_k_of_n_holds_and_sends(size, peers):
    """The shards, gradients and moments, the gathered peaks and every unit's gathered and
    reduce-scattered elements at N's shapes: the planner's figures for one rank of N, exactly."""
    _, _, sharded = _one_step(PhantomComm(size, size - 1, peers=peers, threads=None))
    want = plan(gpt_units(CFG)[0], size, itemsize=8)
    ledger, memory = sharded.ledger, want["memory_bytes"]
    assert [ledger.current["param_shard"], ledger.current["grad_shard"], ledger.current["optim_state"]] == [
        memory["param_shards"],
        memory["grad_shards"],
        memory["optimizer"],
    ]
    assert [ledger.peak["gathered_params"], ledger.peak["gathered_grads"]] == [
        memory["gathered_params_peak"],
        memory["gathered_grads_peak"],
    ]
    names = [u.name for u in sharded.units]
    counted = {
        op: sum(sharded.shard_comm.ledger.total("elements", unit=n, op=op) for n in names)
        for op in ("all_gather", "reduce_scatter")
    }
    assert counted == want["traffic"]["elements"]["in_group"]


def test_a_phantom_whose_peers_are_its_own_shard_gathers_copies_of_it():
    """peers="mine": each slot of a gather holds this rank's shard (no memory kept for the peers)."""
    comm = PhantomComm(4, 1, threads=None)
    send = np.arange(5, dtype=np.float32)
    full = np.full(20, np.nan, dtype=np.float32)
    comm.all_gather(send, full, unit="u", phase="forward")
    assert (full.reshape(4, 5) == send).all()
    grad = np.arange(20, dtype=np.float32)
    shard = np.empty(5, dtype=np.float32)
    comm.reduce_scatter(grad, shard, unit="u", phase="backward")
    assert (shard == 4 * grad[5:10]).all()  # four equal gradients' sum of rank 1's slot
    assert comm.all_reduce_scalar(2.5) == 10.0 and comm.allgather_object("x") == ["x"] * 4


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"size": 0}, "size=0"),
        ({"size": 4, "rank": 4}, "rank=4"),
        ({"size": 2, "rank": -1}, "rank=-1"),
        ({"size": 2, "peers": "theirs"}, "peers='theirs'"),
        ({"size": 2, "transport": "nccl"}, "give no transport"),
    ],
)
def test_a_phantom_names_what_it_cannot_stand_in_for(kwargs, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        PhantomComm(**kwargs)


def test_a_phantom_refuses_hybrid_sharding_by_name():
    with pytest.raises(ValueError, match="cannot split"):
        fully_shard(GPT(CFG, seed=0), PhantomComm(4, threads=None), shard_size=2)


def test_a_phantom_refuses_checkpoints_and_what_another_rank_alone_computed(tmp_path):
    """A checkpoint of rank k alone would lack its peers' files (and rank 0's manifest), and one
    loaded would leave the peers' slices stale: saving, loading, exporting and loading a
    .safetensors file are refused by name before anything is written; so is an object only the
    root computed, broadcast to a phantom rank that is not the root (it would read nothing)."""
    from mpifsdp import CheckpointError, checkpoint

    comm = PhantomComm(4, 1, threads=None)
    model = GPT(CFG, seed=3, dtype=np.float64)
    fully_shard(model, comm, units=model.blocks)
    from mpifsdp.checkpoint.consolidated import export_safetensors, load_safetensors

    for action in (checkpoint.save, checkpoint.load, export_safetensors, load_safetensors):
        with pytest.raises(CheckpointError, match="runs one rank of its job alone"):
            action(tmp_path / "ckpt", model)
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="broadcast_object from rank 0, which is a stand-in"):
        comm.broadcast_object("rank 0's", root=0)
    assert comm.broadcast_object({"mine": 1}, root=1) == {"mine": 1}


def test_each_units_exposed_wait_is_counted_by_unit(comm):
    """The ledger's waits by (unit, phase): every unit's gathers and reduce-scatter are waited on and
    counted under its name (the host blocked, on the CPU), and they sum to at most the step's wait_s
    (which also holds the optimizer's exchanges). On a GPU the compute stream's stalls are timed
    instead (Comm.time_waits: tools/gpusim/standin_phantom.py)."""
    model = GPT(CFG, seed=3, dtype=np.float64)
    fully_shard(model, comm, units=model.blocks)
    opt = AdamW(model, lr=LR)
    sharded = sharded_model(model)
    sharded.comm.ledger.reset()
    rng = np.random.default_rng(comm.rank)
    model(rng.integers(0, 37, (2, 8)), rng.integers(0, 37, (2, 8))).backward()
    opt.step()
    ledger = sharded.comm.ledger
    by_unit = ledger.exposed_by_unit()
    assert {u.name for u in sharded.units} <= set(by_unit), by_unit
    assert {phase for (_, phase) in ledger.waits} >= {"forward", "backward"}
    # each blocked time is added to both: the sums differ only by their additions' rounding
    rounding = len(ledger.waits) * np.finfo(np.float64).eps * ledger.wait_s
    assert all(s >= 0 for s in by_unit.values()) and sum(by_unit.values()) <= ledger.wait_s + rounding
    assert ledger.report()["exposed_s_by_unit"] == by_unit


def test_a_phantom_gathers_only_parameters_and_one_model_and_counts_what_it_keeps():
    """Its peers' initial slices stand in for their parameters only: a gather of any other vector
    (gradients, moments, full_state_dict) is refused by name, not returned with stand-ins in it; a
    second model whose units reuse the names is refused (its gathers would mix two models); the
    peers' slices it keeps are in the memory ledger ((N - 1) shards a unit, "phantom_peers"), and
    the watchdog's reports name the rank it stands for."""
    from mpifsdp import full_state_dict

    comm = PhantomComm(4, 2, peers="initial", threads=None)
    model = GPT(CFG, seed=3, dtype=np.float64)
    fully_shard(model, comm, units=model.blocks)
    sharded = sharded_model(model)
    unit = sharded.units[0]
    with pytest.raises(ValueError, match="stands in for its peers"):
        unit.gather(unit.grad_shard)
    with pytest.raises(ValueError, match="stands in for its peers"):
        full_state_dict(model)
    other = GPT(CFG, seed=4, dtype=np.float64)
    with pytest.raises(ValueError, match="was made on it already"):
        fully_shard(other, comm, units=other.blocks)
    kept = sum(3 * u.shard.nbytes for u in sharded.units)
    assert sharded.ledger.current["phantom_peers"] == kept and comm.schedule.rank == 2
    light = GPT(CFG, seed=3, dtype=np.float64)
    fully_shard(light, PhantomComm(4, 2, threads=None), units=light.blocks)  # peers="mine": keeps nothing
    assert sharded_model(light).ledger.current.get("phantom_peers", 0) == 0
