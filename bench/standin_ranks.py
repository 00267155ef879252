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

from standin_checks import overflow_outcomes

import mpifsdp


def main() -> int:
    comm = mpifsdp.Comm(device="cuda", transport="host")
    everyone = comm.allgather_object(overflow_outcomes(comm, fsdp_gather=True))
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
