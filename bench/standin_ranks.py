"""The GPU path across ranks, on a CPU (CuPy stood in for, MPI with host staging between ranks):
- a master beyond float16 in the last rank's shard only: a GPU's gathers check each rank's own
  shard as they cast it, so the others learn it at the optimizer's verdict; every rank raises at
  that step, naming the unit, and the next step, the master back in range, steps on every rank.
Prints one JSON line (rank 0); exits 1 where a rank saw otherwise.

    mpiexec -n 2 python -m mpi4py bench/standin_run.py bench/standin_ranks.py
"""

from __future__ import annotations

import json
import sys

import numpy as np

import mpifsdp
from mpifsdp import Unit


def overflow_on_one_rank(comm) -> list[str]:
    """This rank's outcome of two steps, the first with the last rank's master at 1e5."""
    xp = mpifsdp.array_module("cuda")
    unit = Unit("big", {"w": xp.ones(6 * comm.size, dtype=np.float32)}, comm, param_dtype=np.float16)
    opt = mpifsdp.AdamW([unit], lr=1e-3)
    outcomes = []
    for master in (1e5, 1.0):
        if comm.rank == comm.size - 1:
            unit.shard[:1] = master
        unit.unshard()  # FSDP's gather: this rank's shard cast and checked in one kernel
        unit.reshard()
        unit.reduce_grad({"w": xp.ones(6 * comm.size, dtype=np.float32)})
        try:
            opt.step()
            outcomes.append("stepped")
        except FloatingPointError as exc:
            outcomes.append("named" if "unit 'big'" in str(exc) else str(exc))
        opt.zero_grad()
    return outcomes


def main() -> int:
    comm = mpifsdp.Comm(device="cuda", transport="host")
    everyone = comm.allgather_object(overflow_on_one_rank(comm))
    ok = all(outcomes == ["named", "stepped"] for outcomes in everyone)
    if comm.rank == 0:
        print(
            json.dumps(
                {"check": "standin_ranks", "ranks": comm.size, "overflow_outcomes": everyone, "ok": ok}
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
