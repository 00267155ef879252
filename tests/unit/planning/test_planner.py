"""The planner predicts what the runtime's ledgers count, exactly (the same formulas), at N = 1..4:
shard, gradient and optimizer bytes, the gathered peaks, every unit collective's elements per level,
and the activation bytes the tape keeps."""

import json
import subprocess
import sys

import numpy as np
import pytest

import mpifsdp.cuda.fused as gpu_fused
from mpifsdp import AdamW, fully_shard, sharded_model
from mpifsdp.autodiff.tensor import graph_nbytes
from mpifsdp.data import rank_slice
from mpifsdp.models import GPT, GPTConfig, gpt_units
from mpifsdp.planning.planner import Link, block_flops, gpt_activation_bytes, offloaded, plan

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=10, tie_weights=False)
ROWS = 4  # sequences per rank per micro-batch


def _batch(step, comm):
    rng = np.random.default_rng(step)
    x = rng.integers(0, 37, (ROWS * comm.size, 8))
    return rank_slice(x, comm.rank, comm.size), rank_slice(np.roll(x, 1, axis=1), comm.rank, comm.size)


def _run(comm, shard_size, prefetch, keep, grad_accum, no_sync):
    model = GPT(CFG, seed=0, dtype=np.float64)
    fully_shard(model, comm, units=model.blocks, prefetch=prefetch, reshard_after_forward=not keep,
                shard_size=shard_size)  # fmt: skip
    sharded = sharded_model(model)
    opt = AdamW(model, lr=1e-3)
    for step in range(2):
        for level in sharded.levels():
            level.ledger.reset()
        for j in range(grad_accum):
            sharded.set_requires_gradient_sync(not no_sync or j == grad_accum - 1)
            model(*_batch(10 * step + j, comm)).backward()
        opt.step()
        opt.zero_grad()
    return model, sharded


def _measured_traffic(sharded):
    names = [u.name for u in sharded.units]

    def total(ledger, op):
        return sum(ledger.total("elements", unit=n, op=op) for n in names)

    across = sharded.replicas.ledger if sharded.replicas is not None else None
    return {
        "in_group": {op: total(sharded.shard_comm.ledger, op) for op in ("all_gather", "reduce_scatter")},
        "across_groups": {"all_reduce": total(across, "all_reduce") if across else 0},
    }


SETUPS = [  # (shard_size or None, prefetch, keep gathered, grad_accum, no_sync)
    (None, 0, False, 1, False),
    (None, 1, False, 1, False),
    (None, 2, True, 1, False),
    (None, 1, False, 2, False),
    (None, 1, False, 3, True),
    ("half", 1, False, 1, False),
    ("one", 1, True, 2, True),
]


@pytest.mark.parametrize("setup", SETUPS, ids=str)
def test_predictions_equal_the_ledgers(comm, setup):
    shard, prefetch, keep, grad_accum, no_sync = setup
    size = {"half": max(1, comm.size // 2), "one": 1, None: None}[shard]
    if size is not None and comm.size % size:
        pytest.skip(f"{comm.size} ranks do not split into groups of {size}")
    model, sharded = _run(comm, size, prefetch, keep, grad_accum, no_sync)
    units, _ = gpt_units(CFG)
    want = plan(units, comm.size, shard_size=size, itemsize=8, prefetch=prefetch,
                reshard_after_forward=not keep, grad_accum=grad_accum, no_sync=no_sync)  # fmt: skip
    ledger, memory = sharded.ledger, want["memory_bytes"]
    got = {
        "param_shards": ledger.current["param_shard"],
        "grad_shards": ledger.current["grad_shard"],
        "optimizer": ledger.current["optim_state"],
        "gathered_params_peak": ledger.peak["gathered_params"],
        "gathered_grads_peak": ledger.peak["gathered_grads"],
    }
    assert got == {k: memory[k] for k in got}
    assert _measured_traffic(sharded) == want["traffic"]["elements"]


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("block_size", [8, 300])  # 300: the blocked attention keeps a log-sum-exp
def test_activation_bytes_are_the_tapes(comm, checkpoint, block_size):
    cfg = GPTConfig(vocab_size=37, block_size=block_size, n_layer=2, n_head=2, n_embd=8)
    model = GPT(cfg, seed=0, dtype=np.float64)
    fully_shard(model, comm, units=model.blocks, recompute=checkpoint)
    x = np.zeros((2 * comm.size, block_size), dtype=np.int64)
    x, y = rank_slice(x, comm.rank, comm.size), rank_slice(x, comm.rank, comm.size)
    assert graph_nbytes(model(x, y)) == gpt_activation_bytes(cfg, 2, 8, checkpoint)


def test_activation_bytes_on_a_gpu_differ_from_the_cpus_by_what_each_keeps():
    """The GPU's prediction is held to its tape on the GPU branches (tools/gpusim/standin_checks.py,
    planned_activations_are_the_tapes, run by tests/project/test_gpu_budget.py); against the CPU's it
    differs by what each keeps: the CPU's blocked attention (beyond 256 positions) each block's
    output and log-sum-exp; a GPU its LayerNorm outputs (two a block and the final one's, the first
    padded with a ones column: the folded qkv bias) and int64 copies of the host token ids, targets
    and positions instead of a one-byte mask."""
    cfg = GPTConfig(vocab_size=37, block_size=300, n_layer=2, n_head=2, n_embd=8)
    B, T, C, H, L = 2, cfg.block_size, cfg.n_embd, cfg.n_head, cfg.n_layer
    attention_kept = L * (B * T * C + B * H * T)
    norms_kept = (2 * L + 1) * B * T * C + L * B * T * (gpu_fused.folded_row_length(C) - C)
    indices = 8 * (2 * B * T + T + 1) - B * T  # the targets' copy ends with their valid count
    cpu, gpu = (gpt_activation_bytes(cfg, 2, 8, device=d) for d in ("cpu", "cuda"))
    assert cpu - gpu == 8 * (attention_kept - norms_kept) - indices
    unbiased = GPTConfig(vocab_size=37, block_size=300, n_layer=2, n_head=2, n_embd=8, bias=False)
    padding = 8 * L * B * T * (gpu_fused.folded_row_length(C) - C)  # no bias to fold
    assert (
        gpt_activation_bytes(cfg, 2, 8, device="cuda") - gpt_activation_bytes(unbiased, 2, 8, device="cuda")
        == padding
    )
    with pytest.raises(ValueError, match="'gpu' is not 'cpu' or 'cuda"):
        gpt_activation_bytes(cfg, 2, 8, device="gpu")


def test_time_model_and_the_command_line(tmp_path):
    units, _ = gpt_units(CFG)
    slow = plan(units, 8, ranks_per_node=4, flops=1e9, flops_per_step=1e9, inter=Link(1e-3, 1e6))
    fast = plan(units, 8, ranks_per_node=4, flops=1e9, flops_per_step=1e9, inter=Link(1e-6, 1e12))
    hybrid = plan(
        units, 8, ranks_per_node=4, shard_size=4, flops=1e9, flops_per_step=1e9, inter=Link(1e-3, 1e6)
    )
    assert fast["time_s"]["step"] == pytest.approx(1.0, rel=0.01)  # compute-bound
    assert slow["time_s"]["step"] > fast["time_s"]["step"]
    assert hybrid["traffic"]["bytes"]["across_groups"]["all_reduce"] > 0
    assert hybrid["time_s"]["comm_in_group"] < slow["time_s"]["comm_in_group"]  # fast links inside a node
    out = subprocess.run(
        [sys.executable, "-m", "mpifsdp", "plan", "--gpt", "n_layer=2", "n_embd=64", "--world", "4",
         "--ranks-per-node", "2", "--shard-size", "node", "--json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    result = json.loads(out)
    assert result["setup"]["shard_size"] == 2 and result["setup"]["replicas"] == 2
    assert 0 < block_flops(CFG, 2, repeats=1) < float("inf")  # what --probe takes as the compute rate
    bad = subprocess.run(
        [sys.executable, "-m", "mpifsdp", "plan", "--gpt", "bogus=1"], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "unknown fields ['bogus']" in bad.stderr
    maybe = subprocess.run(
        [sys.executable, "-m", "mpifsdp", "plan", "--gpt", "bias=maybe"], capture_output=True, text=True
    )  # read as False before
    assert maybe.returncode == 1 and "--gpt bias=maybe: bias takes a yes or a no" in maybe.stderr, (
        maybe.stderr
    )


def test_a_gpu_plan_counts_float32_gradients_and_the_next_units_bound_ahead():
    """plan --device cuda --compute-bytes 2 at 2 ranks: the gathered gradients at 4 bytes an element
    (Unit.full_grad_dtype), and three blocks' alive at once in backward, not two (the running one,
    the one reducing, and the next, bound ahead: UnitLifecycle.bind_grads_ahead); the gathered
    parameters as the CPU's plus every block's kept float16 cast of its shard (Unit.cast_target).
    On one rank a unit's full gradient is its gradient shard (Unit._grad_is_whole) and a block's
    kept cast its gathered parameters (Unit._gathers_nothing). The GPU runtime's ledgers are held
    to these in tools/gpusim/standin_checks.py."""
    config = ["n_layer=4", "n_embd=64"]
    command = [sys.executable, "-m", "mpifsdp", "plan", "--gpt", *config, "--compute-bytes", "2", "--json"]
    runs = {
        (device, world): json.loads(
            subprocess.run(
                [*command, "--world", str(world), "--ranks-per-node", str(world), "--device", device],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )["memory_bytes"]
        for device in ("cpu", "cuda")
        for world in (1, 2)
    }  # both --world and --ranks-per-node given: no MPI asked (inside an MPI run too)
    units, _ = gpt_units(GPTConfig(n_layer=4, n_embd=64))  # the command line's, its defaults otherwise
    root = sum(-(-u.numel // 2) * 2 for u in units if u.kept)  # padded to 2 shards
    block = max(-(-u.numel // 2) * 2 for u in units if not u.kept)
    assert runs["cpu", 2]["gathered_grads_peak"] == 2 * (root + 2 * block)
    assert runs["cuda", 2]["gathered_grads_peak"] == 4 * (root + 3 * block)
    assert (
        runs["cuda", 2]["gathered_params_peak"] == runs["cpu", 2]["gathered_params_peak"] + 2 * 4 * block // 2
    )
    root, block = sum(u.numel for u in units if u.kept), max(u.numel for u in units if not u.kept)
    assert runs["cuda", 1]["gathered_grads_peak"] == 0
    assert runs["cpu", 1]["gathered_params_peak"] == 2 * (root + 2 * block)
    assert runs["cuda", 1]["gathered_params_peak"] == 2 * (root + 4 * block)


@pytest.mark.parametrize(
    "bad, named",
    [
        ({"world_size": 0}, "world_size=0"),
        ({"world_size": -3}, "world_size=-3"),
        ({"grad_accum": 0}, "grad_accum=0"),
        ({"prefetch": -1}, "prefetch=-1"),
        ({"ranks_per_node": -1}, "ranks_per_node=-1"),
        ({"flops": -1.0}, "flops=-1.0"),
        ({"flops": float("nan")}, "flops=nan"),
        ({"itemsize": 0}, "itemsize=0"),
    ],
)
def test_plan_names_a_value_it_cannot_plan_for(bad, named):
    units, _ = gpt_units(CFG)
    kwargs = {"world_size": 4, **bad}
    with pytest.raises(ValueError, match=f"plan: invalid {named} "):
        plan(units, kwargs.pop("world_size"), **kwargs)
    with pytest.raises(ValueError, match="bandwidth -5.0 B/s > 0"):
        Link(1e-6, -5.0)
    with pytest.raises(ValueError, match="batch=0 "):
        gpt_activation_bytes(CFG, 0, 4)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--gpt", "n_layer=abc"], "--gpt n_layer=abc: n_layer takes an integer"),
        (["--gpt", "n_layer"], "--gpt n_layer: give KEY=VALUE pairs"),
        (["--dtype", "int8"], "--dtype int8: the shards' dtype is float16, float32 or float64"),
        (["--intra", "abc"], "--intra abc: give ALPHA_S,BYTES_PER_S"),
        (["--shard-size", "abc"], "--shard-size abc: give a group size"),
        (["--memory", "-5"], "--memory -5.0: give the device's bytes"),
        (["--batch", "0"], "--batch 0: sequences per rank per micro-batch, >= 1"),
        (["--compute-bytes=-2"], "--compute-bytes -2: bytes per gathered element"),
        (["--grad-accum", "0"], "--grad-accum 0 (>= 1)"),
    ],
)
def test_the_command_line_names_a_bad_argument(capsys, arguments, message):
    from mpifsdp.__main__ import main

    assert main(["plan", "--world", "4", "--ranks-per-node", "2", *arguments]) == 1
    assert message in capsys.readouterr().err


def test_the_table_says_when_compute_time_is_unknown(capsys):
    from mpifsdp.__main__ import main

    assert main(["plan", "--world", "4", "--ranks-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "compute                     unknown (give --flops FLOP_PER_S, or --probe)" in out
    assert "step                   >=" in out and "(communication alone)" in out
    assert main(["plan", "--world", "4", "--ranks-per-node", "2", "--flops", "1e12"]) == 0
    out = capsys.readouterr().out
    assert "unknown" not in out and "communication alone" not in out


def test_plan_cli_refuses_a_group_of_zero_and_says_when_memory_does_not_fit():
    """--shard-size 0 planned plain FSDP without a word; --memory 1 said nothing outside --json."""
    zero = subprocess.run(
        [sys.executable, "-m", "mpifsdp", "plan", "--world", "4", "--shard-size", "0"],
        capture_output=True,
        text=True,
    )
    assert zero.returncode == 1 and "--shard-size 0: give a group size (ranks, >= 1)" in zero.stderr, (
        zero.stderr
    )
    small = subprocess.run(
        [sys.executable, "-m", "mpifsdp", "plan", "--world", "4", "--ranks-per-node", "4", "--memory", "1"],
        capture_output=True,
        text=True,
    )
    assert small.returncode == 0 and "DOES NOT FIT in --memory" in small.stdout, small.stdout + small.stderr


def test_a_model_of_any_size_is_counted_in_exact_integers():
    """plan of a 2.4e21-parameter GPT reported the count modulo 2**64 (an int64 product of a deferred
    parameter's shape) and every byte figure with it, silently. Sizes are Python integers."""
    C, L, V, T = 10**10, 2, 16, 4
    units, _ = gpt_units(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=1, n_embd=C))
    params = L * (12 * C * C + 13 * C) + V * C + T * C + 2 * C  # blocks, embeddings, the last LayerNorm
    assert sum(u.numel for u in units) == params
    result = plan(units, 8)
    assert result["setup"]["params"] == params
    padded = -(-params // 8) * 8  # each unit is padded to a multiple of 8: the sum of theirs is above
    memory = result["memory_bytes"]
    assert params // 8 * 4 <= memory["param_shards"] <= (padded // 8 + 3) * 4  # 3 units, float32
    assert memory["optimizer"] == 2 * memory["param_shards"] == 2 * memory["grad_shards"]


def test_the_plan_places_each_offload_and_counts_disk_offload_as_the_optimizer_does(comm, tmp_path):
    """plan's offloaded(): "disk" puts the moments' bytes on disk and two buffers a kind of the
    largest shard in memory, exactly what AdamW's DiskStates holds at N ranks (its files' regions
    each page-aligned); "optimizer" moves the masters, moments and a gradient copy to the host and
    keeps param_dtype shards on the device, "optimizer+params" those too."""
    config = GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=16)
    units, _ = gpt_units(config)
    planned = plan(units, comm.size, itemsize=4, compute_itemsize=2)
    disk = offloaded(planned, "disk")
    model = GPT(config, seed=0)
    fully_shard(model, comm, units=model.blocks, offload="disk", offload_dir=tmp_path)
    opt = AdamW(model)
    ledger = sharded_model(model).ledger
    assert ledger.current["optim_state"] == disk["device"]["optimizer"]
    assert ledger.report()["on_disk"] == {"optim_state": opt.on_disk.nbytes}
    regions = 2 * len(opt.on_disk.counts)  # each kind's region of each group starts on a page
    assert disk["disk"] <= opt.on_disk.nbytes < disk["disk"] + 4096 * regions
    memory = planned["memory_bytes"]
    host = offloaded(planned, "optimizer")
    assert host["host"] == memory["param_shards"] + memory["optimizer"] + memory["grad_shards"]
    assert host["device"]["param_shards"] == memory["param_shards"] // 2 and host["device"]["optimizer"] == 0
    both = offloaded(planned, "optimizer+params")
    assert (
        both["host"] == host["host"] + host["device"]["param_shards"] and both["device"]["param_shards"] == 0
    )
    for placed in (disk, host, both):
        assert placed["device"]["total"] == sum(v for k, v in placed["device"].items() if k != "total")
    del opt


def test_the_plan_says_which_offload_a_model_needs_to_fit(capsys):
    """--memory where the model does not fit: the first offload with which it would, named, on a
    GPU (an ~8.6B GPT on a 141 GB H200: offload='optimizer') and on a CPU ('disk'); --offload's
    columns."""
    from mpifsdp.__main__ import main

    gpu = ["--gpt", "n_layer=42", "n_embd=4096", "n_head=32", "block_size=2048", "vocab_size=32768"]
    one = ["--world", "1", "--ranks-per-node", "1", "--batch", "1"]  # as given: printed on every rank
    gpu += [*one, "--device", "cuda", "--compute-bytes", "2", "--recompute"]
    assert main(["plan", *gpu, "--memory", "141e9"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT in --memory" in out and "would fit with offload='optimizer'" in out
    assert main(["plan", *one, "--memory", "1.9e7"]) == 0
    assert "fits with offload='disk'" in capsys.readouterr().out
    assert main(["plan", *one, "--offload", "disk"]) == 0
    out = capsys.readouterr().out
    assert "with offload='disk'" in out and "disk" in out and "compute memory" in out
    assert main(["plan", *one, "--offload", "nvme"]) == 1
    assert "--offload nvme: on --device cpu, one of ('disk',)" in capsys.readouterr().err
    assert main(["plan", *one, "--device", "cuda", "--offload", "disk"]) == 1  # a GPU's go to host memory
    assert "a GPU offloads to host memory" in capsys.readouterr().err
