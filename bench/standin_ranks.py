"""The GPU path across ranks, on a CPU (CuPy stood in for, MPI with host staging between ranks):
- a master beyond float16 in the last rank's shard only: a GPU's gathers check each rank's own
  shard as they cast it, so the others learn it at the optimizer's verdict; every rank raises at
  that step, naming the unit, and the next step, the master back in range, steps on every rank;
- a bad token id in the last rank's device batch only (checked on the device, read with the step's
  verdict): every rank raises at that step's verdict, and the next step, a good batch, steps.
Prints one JSON line (rank 0); exits 1 where a rank saw otherwise.

    mpiexec -n 2 python -m mpi4py bench/standin_run.py bench/standin_ranks.py
"""

from __future__ import annotations

import json
import sys

from standin_checks import bad_batch_outcomes, overflow_outcomes

import mpifsdp


def main() -> int:
    comm = mpifsdp.Comm(device="cuda", transport="host")
    everyone = comm.allgather_object(overflow_outcomes(comm, fsdp_gather=True))
    bad_batch = comm.allgather_object(bad_batch_outcomes(comm))
    ok = all(outcomes == ["named", "stepped"] for outcomes in everyone + bad_batch)
    if comm.rank == 0:
        report = {"overflow_outcomes": everyone, "bad_batch_outcomes": bad_batch, "ok": ok}
        print(json.dumps({"check": "standin_ranks", "ranks": comm.size, **report}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
