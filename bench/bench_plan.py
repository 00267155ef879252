"""The planner's predicted step time vs the measured step, after probing this machine, at N = 1, 2, 4.

For each N, one mpiexec job: every rank probes (Allgather and Reduce_scatter alpha and bandwidth,
the FLOP rate of one transformer block's forward and backward, all ranks at once so shared cores are
shared as in training), plans the peer
config, then trains it and measures the median step and the peak RSS (against the plan's memory
plus the interpreter's own). One JSON line per N, then a summary.
    python bench/bench_plan.py [--sizes 1,2,4] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from common import (  # noqa: E402
    PEER,
    current_rss_mib,
    gpt_config,
    peak_rss_mib,
    random_batch,
    run_json,
    train_step,
)


def worker(steps: int):
    import numpy as np

    import mpifsdp
    from mpifsdp.data import rank_slice
    from mpifsdp.models import GPT, gpt_units
    from mpifsdp.planning import planner

    comm = mpifsdp.Comm()
    baseline = current_rss_mib()  # the interpreter, NumPy, MPI: what no plan of the model counts
    fits = planner.probe(comm)
    link = (
        planner.Link(fits["all_gather"]["alpha"], fits["all_gather"]["bandwidth"]) if fits else planner.Link()
    )
    config = gpt_config(PEER)
    flops = planner.block_flops(config, PEER["batch_size"])  # all ranks at once: shared cores shared
    units, shapes = gpt_units(config)
    tokens = PEER["batch_size"] * PEER["block_size"]
    predicted = planner.plan(
        units, comm.size, flops=flops, intra=link, inter=link,
        flops_per_step=planner.flops_per_step(shapes, PEER["block_size"], tokens),
        activation_bytes=planner.gpt_activation_bytes(config, PEER["batch_size"], 4),
    )  # fmt: skip
    with mpifsdp.deferred_init():
        model = GPT(config, seed=0)
    mpifsdp.fully_shard(model, comm, units=model.blocks)
    opt = mpifsdp.AdamW(model, lr=3e-4)
    x, y = random_batch(PEER, PEER["batch_size"] * comm.size)
    x, y = rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)
    times = []
    for i in range(steps + 1):
        comm.barrier()
        start = time.perf_counter()
        train_step(model, opt, x, y)
        if i:
            times.append(max(comm.allgather_object(time.perf_counter() - start)))
    rss = max(comm.allgather_object(peak_rss_mib()))
    if comm.rank == 0:
        measured = float(np.median(times))
        memory = baseline + predicted["memory_bytes"]["total"] / 2**20
        step = predicted["time_s"]["step"]
        line = {
            "world_size": comm.size, "predicted_step_s": round(step, 3),
            "measured_step_s": round(measured, 3),
            "predicted_vs_measured": round(step / measured, 3),
            "block_gflops_per_rank": round(flops / 1e9, 1),
            "predicted_rss_mib": round(memory, 1), "peak_rss_mib": round(rss, 1),
            "rss_vs_predicted": round(rss / memory, 3), "probe": fits, "predicted": predicted["time_s"],
        }  # fmt: skip
        print(json.dumps(line), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.steps)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    ratios = {}
    for n in map(int, args.sizes.split(",")):
        cmd = [mpiexec, "-n", n, sys.executable, "-m", "mpi4py", __file__, "--worker", "--steps", args.steps]
        line = run_json(cmd, max(1, (os.cpu_count() or 1) // n))
        ratios[f"N{n}"] = {k: line[k] for k in ("predicted_vs_measured", "rss_vs_predicted")}
    print(json.dumps({"bench": "plan", **ratios}))


if __name__ == "__main__":
    main()
