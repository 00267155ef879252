"""Training features at their cost: gradient accumulation both ways, and activation checkpointing.

One JSON line per run, then a summary. Each run is its own mpiexec job (peak RSS is per process):
  accumulation: peer config at N = 2, a global batch of 16 in one step vs 64 = 4 micro-batches of 16
                (each micro-batch reduce-scattered, or no_sync until the last);
  checkpointing: peer config at T = 1024, batch 2 per rank, N = 1 and 2, with and without
                fully_shard(recompute=True).
    python bench/bench_training.py [--steps 3] [--only accumulation|checkpointing]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from common import PEER, gpt_config, peak_rss_mib, random_batch, run_json  # noqa: E402


def measure(args):
    """The worker: `steps` timed optimizer steps (after one warm-up) of one configuration."""
    import numpy as np
    from mpi4py import MPI

    import mpifsdp
    from mpifsdp.autodiff.tensor import graph_nbytes
    from mpifsdp.data import rank_slice
    from mpifsdp.models import GPT

    cfg = {**PEER, "block_size": args.block_size, "batch_size": args.micro_batch}
    comm = mpifsdp.Comm()
    with mpifsdp.deferred_init():
        model = GPT(gpt_config(cfg), seed=0)
    mpifsdp.fully_shard(model, comm, units=model.blocks, recompute=args.checkpoint)
    sharded = mpifsdp.sharded_model(model)
    opt = mpifsdp.AdamW(model, lr=3e-4, weight_decay=0.1)
    micro = [random_batch(cfg, args.micro_batch * comm.size, seed=j) for j in range(args.grad_accum)]
    micro = [(rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)) for x, y in micro]
    times = []
    for step in range(args.steps + 1):
        comm.mpi.Barrier()
        t0 = time.perf_counter()
        comm.ledger.reset()
        for j, (x, y) in enumerate(micro):
            sharded.set_requires_gradient_sync(args.accum_sync == "reduce" or j == len(micro) - 1)
            (model(x, y) / len(micro)).backward()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        if step:
            times.append(comm.mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    comm_bytes = comm.ledger.total("bytes")
    held = graph_nbytes(model(*micro[0])) / 2**20  # what the tape keeps after one forward
    rss = max(comm.allgather_object(peak_rss_mib()))
    if comm.rank == 0:
        step_s = float(np.median(times))
        tokens = args.grad_accum * args.micro_batch * comm.size * args.block_size
        line = {
            "world_size": comm.size, "block_size": args.block_size,
            "sequences_per_step": tokens // args.block_size,
            "grad_accum": args.grad_accum, "accum_sync": args.accum_sync, "checkpoint": args.checkpoint,
            "step_s": round(step_s, 3), "tokens_per_s": round(tokens / step_s, 1),
            "peak_rss_mib_per_rank": round(rss, 1), "activations_after_forward_mib": round(held, 1),
            "peak_gathered_grads_mib": round(sharded.ledger.peak["gathered_grads"] / 2**20, 1),
            "comm_mib_per_step": round(comm_bytes / 2**20, 1),
        }  # fmt: skip
        print(json.dumps(line), flush=True)


RUNS = {
    "accumulation": [
        dict(ranks=2, block_size=128, micro_batch=8, grad_accum=1),
        dict(ranks=2, block_size=128, micro_batch=8, grad_accum=4, accum_sync="reduce"),
        dict(ranks=2, block_size=128, micro_batch=8, grad_accum=4, accum_sync="no_sync"),
    ],
    "checkpointing": [
        dict(ranks=n, block_size=1024, micro_batch=2, checkpoint=c) for n in (1, 2) for c in (False, True)
    ],
}


def launch(run: dict, steps: int) -> dict:
    ranks = run["ranks"]
    flags = ["--block-size", run["block_size"], "--micro-batch", run["micro_batch"]]
    flags += ["--grad-accum", run.get("grad_accum", 1), "--accum-sync", run.get("accum_sync", "reduce")]
    flags += ["--steps", steps] + (["--checkpoint"] if run.get("checkpoint") else [])
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [mpiexec, "-n", ranks, sys.executable, "-m", "mpi4py", __file__, "--worker", *flags]
    return run_json(cmd, max(1, (os.cpu_count() or 1) // ranks))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", choices=sorted(RUNS))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--block-size", type=int, default=128, help=argparse.SUPPRESS)
    ap.add_argument("--micro-batch", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--grad-accum", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--accum-sync", default="reduce", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return measure(args)
    results = {
        name: [launch(r, args.steps) for r in runs]
        for name, runs in RUNS.items()
        if args.only in (None, name)
    }
    summary = {"bench": "training"}
    if "accumulation" in results:
        one, reduce, no_sync = results["accumulation"]
        summary["accum4_tokens_per_s_vs_batch16"] = round(reduce["tokens_per_s"] / one["tokens_per_s"], 3)
        summary["no_sync_tokens_per_s_vs_reduce"] = round(no_sync["tokens_per_s"] / reduce["tokens_per_s"], 3)
        summary["no_sync_rss_vs_reduce"] = round(
            no_sync["peak_rss_mib_per_rank"] / reduce["peak_rss_mib_per_rank"], 3
        )
    if "checkpointing" in results:
        for n, (plain, ckpt) in zip((1, 2), zip(*[iter(results["checkpointing"])] * 2)):
            summary[f"N{n}_checkpoint_step_vs_plain"] = round(ckpt["step_s"] / plain["step_s"], 3)
            summary[f"N{n}_checkpoint_rss_vs_plain"] = round(
                ckpt["peak_rss_mib_per_rank"] / plain["peak_rss_mib_per_rank"], 3
            )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
