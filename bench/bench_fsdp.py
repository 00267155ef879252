"""Sharded training step at N = 1, 2, 4 vs the single-process unsharded step on the same global batch.

Each configuration runs as its own job, BLAS threads per rank = cores / N (the unsharded reference
uses all cores), in one invocation so the figures are comparable. One JSON line per run, then a
summary line with the ratios to the reference.
    python bench/bench_fsdp.py [--config peer|small] [--steps 5] [--sizes 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import CONFIGS, gpt_config, peak_rss_mib, random_batch, train_step  # noqa: E402


def worker(args):
    """One measured run: sharded under mpiexec, or unsharded in a single process (--unsharded)."""
    import numpy as np
    from mpi4py import MPI

    import mpifsdp
    from mpifsdp.data import rank_slice
    from mpifsdp.models import GPT

    cfg = CONFIGS[args.config]
    comm = mpifsdp.Comm()
    N = comm.size
    model = GPT(gpt_config(cfg), seed=0)
    global_batch = cfg["batch_size"] * (args.ranks_equivalent if args.unsharded else N)
    x, y = random_batch(cfg, global_batch)
    if not args.unsharded:
        mpifsdp.fully_shard(model, comm, units=model.blocks)
        x, y = rank_slice(x, comm.rank, N), rank_slice(y, comm.rank, N)
    opt = mpifsdp.AdamW(model, lr=3e-4, weight_decay=0.1)
    times = []
    for i in range(args.steps + 1):  # the first step warms buffers and caches
        comm.mpi.Barrier()
        t0 = time.perf_counter()
        if i == args.steps:
            comm.ledger.reset()
        train_step(model, opt, x, y)
        dt = comm.mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i:
            times.append(dt)
    step_s = float(np.median(times))
    rss = max(comm.allgather_object(peak_rss_mib()))
    if comm.rank == 0:
        tokens = global_batch * cfg["block_size"]
        print(
            json.dumps(
                {
                    "impl": "single-process" if args.unsharded else "mpifsdp",
                    "config": args.config,
                    "world_size": 1 if args.unsharded else N,
                    "global_batch": global_batch,
                    "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "0")),
                    "step_s": round(step_s, 4),
                    "tokens_per_s": round(tokens / step_s, 1),
                    "peak_rss_mib_per_rank": round(rss, 1),
                    "comm_bytes_per_step": comm.ledger.total("bytes"),
                }
            ),
            flush=True,
        )


def run(cmd, threads):
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = out.strip().splitlines()[-1]
    print(line, flush=True)
    return json.loads(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", choices=CONFIGS, default="peer")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--unsharded", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks-equivalent", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    cores = os.cpu_count() or 1
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    me = [sys.executable, "-m", "mpi4py", __file__, "--worker"]
    me += ["--config", args.config, "--steps", str(args.steps)]
    summary = {"bench": "fsdp", "config": args.config, "cores": cores}
    for n in map(int, args.sizes.split(",")):
        sharded = run([mpiexec, "-n", str(n), *me], max(1, cores // n))
        single = run([*me, "--unsharded", "--ranks-equivalent", str(n)], cores)
        summary[f"N{n}_step_vs_single"] = round(sharded["step_s"] / single["step_s"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
