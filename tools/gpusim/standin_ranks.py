"""The GPU path across ranks, on a CPU (CuPy stood in for, MPI with host staging between ranks):
- a master beyond float16 in the last rank's shard only: a GPU's gathers check each rank's own
  shard as they cast it, so the others learn it at the optimizer's verdict; every rank raises at
  that step, naming the unit, and the next step, the master back in range, steps on every rank;
- a bad token id in the last rank's device batch only (checked on the device, read with the step's
  verdict): every rank raises at that step's verdict, and the next step, a good batch, steps;
- over NCCL (the stand-in's, through MPI), a GPT's forward and backward replayed from a CUDA graph
  (GraphedPasses) give the eager steps' losses and parameters bit for bit on every rank, in FSDP
  and in HSDP (groups of one rank: the all-reduce across groups in the graph); and a rank
  that runs an evaluation the others do not is named on every rank by the schedule check before
  the replay, not left to pair the graph's collectives with another's;
- the whole step in one graph (GraphedPasses(..., optimizer=, scaler=, max_norm=)): the eager steps'
  losses, parameters and counts bit for bit on every rank, in FSDP and HSDP; a bad token id in the
  last rank's batch stops every rank a step late (the norm's all-reduce carries the failed check),
  each naming it, with no update after it;
- HSDP on the GPU branch over NCCL (groups of one rank, sync_params, float64): the CPU's losses,
  with the all-reduce across groups and the broadcast on NCCL, never MPI on device memory.
Prints one JSON line (rank 0); exits 1 where a rank saw otherwise.

    mpiexec -n 2 python -m mpi4py -m gpusim tools/gpusim/standin_ranks.py
"""

from __future__ import annotations

import json
import sys

import numpy as np

import mpifsdp
from gpusim import cupy_standin
from gpusim.standin_checks import bad_batch_outcomes, overflow_outcomes
from gpusim.standin_graphs import _evaluate, graphed_after_capture, replays_equal_eager_steps
from gpusim.standin_whole_step import _stopped_a_step_late, graphed_steps_equal_eager_ones
from mpifsdp.data import rank_slice
from mpifsdp.models import GPT, GPTConfig


def a_rank_ahead_is_named_before_the_replay(comm) -> str:
    """ "named" where this rank raised ScheduleError: the last rank runs an evaluation (a forward
    under no_grad) that the others do not, then every rank calls the graph."""
    model, _, _, graphed, batches = graphed_after_capture(3)
    try:
        if comm.rank == comm.size - 1:
            _evaluate(model, None, 0)
        graphed(*batches[2])
    except mpifsdp.ScheduleError:
        return "named"
    return "replayed"


def a_bad_batch_on_the_last_rank_stops_every_rank(comm) -> bool:
    """A token id beyond the vocabulary in the last rank's batch of a whole-step graph: every rank
    raises at its next call, the last naming the value, the others the rank, nothing updated."""
    last = comm.rank == comm.size - 1

    def spoil(model, weight, batch):
        if last:
            batch[0][1, 3] = 10**4

    return _stopped_a_step_late(spoil, ValueError, "outside [0," if last else f"rank(s) [{comm.size - 1}]")


def _hsdp_losses(device: str) -> list:
    """3 float64 steps of a GPT under HSDP in groups of one rank (each gradient shard all-reduced
    across the groups), every rank's initial values rank 0's (sync_params: a broadcast)."""
    comm = mpifsdp.Comm(device=device, transport="nccl" if device == "cuda" else None)
    config = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config, seed=comm.rank, dtype=np.float64, device=comm.device)
    mpifsdp.fully_shard(model, comm, units=model.blocks, shard_size=1, sync_params=True)
    opt, rng, losses = mpifsdp.AdamW(model, lr=1e-3), np.random.default_rng(0), []
    for _ in range(3):
        x, y = (rank_slice(rng.integers(0, 64, (4, 8)), comm.rank, comm.size) for _ in range(2))
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def hsdp_over_nccl() -> dict:
    """HSDP's all-reduce across groups and sync_params' broadcast move device memory over NCCL (an
    MPI that is not CUDA-aware must never be handed it), and train as the CPU does."""
    cpu = _hsdp_losses("cpu")
    cupy_standin.LAUNCHES.clear()
    gpu = _hsdp_losses("cuda")
    launched = {kind for (_, kind), n in cupy_standin.LAUNCHES.items() if n}
    err = max(abs(a - b) / abs(b) for a, b in zip(gpu, cpu))
    return {"losses_as_the_cpus": err <= 1e-12, "over_nccl": {"nccl allReduce", "nccl broadcast"} <= launched}


def main() -> int:
    comm = mpifsdp.Comm(device="cuda", transport="host")
    cupy_standin.GPUS[0] = comm.size  # one GPU a rank: NCCL
    everyone = comm.allgather_object(overflow_outcomes(comm, fsdp_gather=True))
    bad_batch = comm.allgather_object(bad_batch_outcomes(comm))
    graphed = comm.allgather_object(replays_equal_eager_steps(False, True, _evaluate))
    graphed += comm.allgather_object(replays_equal_eager_steps(False, True, _evaluate, shard_size=1))
    graphed += comm.allgather_object(graphed_steps_equal_eager_ones())
    graphed += comm.allgather_object(graphed_steps_equal_eager_ones(shard_size=1))
    stopped = comm.allgather_object(a_bad_batch_on_the_last_rank_stops_every_rank(comm))
    ahead = comm.allgather_object(a_rank_ahead_is_named_before_the_replay(comm))
    hsdp = comm.allgather_object(hsdp_over_nccl())
    ok = all(outcomes == ["named", "stepped"] for outcomes in everyone + bad_batch)
    ok = ok and all(all(r.values()) for r in graphed + hsdp) and ahead == ["named"] * comm.size
    ok = ok and all(stopped)
    if comm.rank == 0:
        report = {"overflow_outcomes": everyone, "bad_batch_outcomes": bad_batch}
        report = {**report, "graphed_steps": graphed, "a_rank_ahead": ahead, "hsdp_over_nccl": hsdp}
        report = {**report, "a_bad_batch_stops_every_rank_a_step_late": stopped, "ok": ok}
        print(json.dumps({"check": "standin_ranks", "ranks": comm.size, **report}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
