"""Sharded training step at N = 1, 2, 4 vs the single-process step and vs PyTorch FSDP2, same run.

For each N: mpifsdp (BLAS threads per rank = cores / N); the same step with communication replaced by
local copies (exposed communication = the difference); the single-process unsharded step on the same
global batch with all cores; and, where torch is installed, the same model under PyTorch FSDP2 with
gloo (bench/torch_fsdp2.py). One JSON line per run, then one summary line per N and a final one.
    python bench/bench_fsdp.py [--config peer|small] [--set block_size=1024 batch_size=2 ...] [--steps 5]
        [--sizes 1,2,4] [--prefetch 1] [--repeats 1]
With --repeats R the four runs of each N take turns R times and each ratio is the median of the
per-round ratios, with its range: on a machine whose speed drifts, a ratio of runs minutes apart
can be off by 1.5x (measured here: FSDP2 at N = 2 took 7.7 s in one run, 12.2 s in the next).
On machines that set OPENBLAS_CORETYPE for old OpenBLAS builds, run it as
`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_fsdp.py` (make bench does).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from common import (  # noqa: E402
    add_config_arguments,
    blas_kernel,
    config_arguments,
    config_from,
    current_rss_mib,
    gemm_runner,
    gpt_config,
    peak_rss_mib,
    random_batch,
    run_json,
    step_gemm_shapes,
    train_step,
    turn_order,
)


def worker(args):
    """One measured run: sharded under mpiexec, or unsharded in a single process (--unsharded)."""
    import numpy as np
    from mpi4py import MPI

    import mpifsdp
    from mpifsdp.autodiff.tensor import graph_nbytes
    from mpifsdp.data import rank_slice
    from mpifsdp.models import GPT

    cfg = config_from(args)
    world = MPI.COMM_WORLD  # the ranks' timing and memory, whatever the Comm
    if args.local_comm:  # the step without communication: each rank alone at N's shapes, copies of its own
        comm = mpifsdp.PhantomComm(world.Get_size(), world.Get_rank())
    else:
        comm = mpifsdp.Comm()
    baseline = current_rss_mib()  # the interpreter, numpy, mpi4py: before any model
    N = comm.size
    if args.unsharded:
        model = GPT(gpt_config(cfg), seed=0)
    else:
        with mpifsdp.deferred_init():  # built unit by unit by fully_shard
            model = GPT(gpt_config(cfg), seed=0)
    global_batch = cfg["batch_size"] * (args.ranks_equivalent if args.unsharded else N)
    x, y = random_batch(cfg, global_batch)
    if not args.unsharded:
        mpifsdp.fully_shard(model, comm, units=model.blocks, prefetch=args.prefetch)
        x, y = rank_slice(x, comm.rank, N), rank_slice(y, comm.rank, N)
    opt = mpifsdp.AdamW(model, lr=3e-4, weight_decay=0.1)  # torch's defaults otherwise, as the peer's

    def timed(fn) -> float:
        world.Barrier()
        t0 = time.perf_counter()
        fn()
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    # Warm-up: buffers, caches and the optimizer state (from the first step on). With --gemm, the
    # peak RSS is read before the GEMM reference's operands exist, so it is the training step's.
    for _ in range(2 if args.gemm else 1):
        train_step(model, opt, x, y)
    rss = max(world.allgather(peak_rss_mib())) if args.gemm else None
    gemm = None
    if args.gemm:  # the GEMMs of one rank's share of the batch, on every rank at once, as in the step
        shapes = step_gemm_shapes({**cfg, "batch_size": global_batch // (1 if args.unsharded else N)})
        gemm = gemm_runner(np, shapes, np.float32)
    times, gemm_times = [], []
    for i in range(args.steps):  # with --gemm, step and GEMMs take turns: a ratio per round
        if i == args.steps - 1:
            comm.ledger.reset()
        times.append(timed(lambda: train_step(model, opt, x, y)))
        if gemm:
            gemm_times.append(timed(gemm))
    rss = rss or max(world.allgather(peak_rss_mib()))
    comm_bytes = comm.ledger.total("bytes")  # of the last timed step
    loss = model(x, y)  # one more forward, to weigh what the tape keeps
    activations = graph_nbytes(loss) / 2**20
    loss.backward()
    sharded = mpifsdp.sharded_model(model)
    runtime = (sharded.ledger.peak_total if sharded else 16 * model.num_params()) / 2**20
    if comm.rank == 0:
        tokens = global_batch * cfg["block_size"]
        step_s = float(np.median(times))
        formula = baseline + runtime + activations
        impl = (
            "single-process" if args.unsharded else ("mpifsdp-local-copies" if args.local_comm else "mpifsdp")
        )
        print(
            json.dumps(
                {
                    "impl": impl,
                    "config": args.config,
                    "set": args.set,
                    "world_size": 1 if args.unsharded else N,
                    "global_batch": global_batch,
                    "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "0")),
                    "blas": blas_kernel(),
                    "step_s": round(step_s, 4),
                    "tokens_per_s": round(tokens / step_s, 1),
                    "peak_rss_mib_per_rank": round(rss, 1),
                    "comm_bytes_per_step": comm_bytes,
                    "rss_terms_mib": {
                        "interpreter": round(baseline, 1),
                        "shards_and_gathered_peak": round(runtime, 1),
                        "activations": round(activations, 1),
                        "sum": round(formula, 1),
                    },
                    "rss_vs_terms": round(rss / formula, 3),
                }
                | (
                    {
                        "gemm_s": round(float(np.median(gemm_times)), 4),
                        "step_vs_gemm": round(float(np.median(np.divide(gemm_times, times))), 3),
                    }
                    if gemm
                    else {}
                )
            ),
            flush=True,
        )


def round_ratios(rounds: dict) -> dict:
    """Each comparison's ratio in every round (runs of one round ran minutes, not hours, apart)."""
    ours = rounds["ours"]
    ratios = {
        "step_vs_single": [o["step_s"] / s["step_s"] for o, s in zip(ours, rounds["single"])],
        "exposed_comm_fraction": [
            max(0.0, 1 - local["step_s"] / o["step_s"]) for o, local in zip(ours, rounds["local"])
        ],
    }
    if "torch" in rounds:
        pairs = list(zip(ours, rounds["torch"]))
        ratios["tokens_per_s_vs_torch"] = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in pairs]
        ratios["peak_rss_vs_torch"] = [
            o["peak_rss_mib_per_rank"] / t["peak_rss_mib_per_rank"] for o, t in pairs
        ]
    return ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    add_config_arguments(ap)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="rounds in which the runs take turns")
    ap.add_argument("--no-torch", action="store_true", help="skip PyTorch FSDP2 even if torch is installed")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gemm", action="store_true", help=argparse.SUPPRESS)  # growth_table.py
    ap.add_argument("--unsharded", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--local-comm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks-equivalent", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    cores = os.cpu_count() or 1
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    me = [sys.executable, "-m", "mpi4py", __file__, "--worker"]
    me += [*config_arguments(args), "--steps", str(args.steps), "--prefetch", str(args.prefetch)]
    with_torch = not args.no_torch and importlib.util.find_spec("torch") is not None
    final = {"bench": "fsdp", "config": args.config, "set": args.set, "cores": cores, "torch": with_torch}
    for n in map(int, args.sizes.split(",")):
        threads = max(1, cores // n)
        runs = {
            "ours": ([mpiexec, "-n", str(n), *me], threads),
            "local": ([mpiexec, "-n", str(n), *me, "--local-comm"], threads),
            "single": ([*me, "--unsharded", "--ranks-equivalent", str(n)], cores),
        }
        if with_torch:
            torch_cmd = [
                sys.executable,
                str(Path(__file__).parent / "torch_fsdp2.py"),
                *config_arguments(args),
            ]
            runs["torch"] = ([mpiexec, "-n", str(n), *torch_cmd, "--steps", str(args.steps)], threads)
        rounds = {name: [] for name in runs}
        for r in range(args.repeats):  # the runs take turns: each round compares like with like
            for name in turn_order(list(runs), r):
                cmd, run_threads = runs[name]
                port = ["--port", str(random.randint(20000, 40000))] if name == "torch" else []
                rounds[name].append(run_json([*cmd, *port], run_threads))
        summary = {"world_size": n, "rounds": args.repeats}
        for key, values in round_ratios(rounds).items():
            summary[key] = round(statistics.median(values), 3)
            if args.repeats > 1:
                summary[key + "_range"] = [round(min(values), 3), round(max(values), 3)]
        summary["rss_vs_terms"] = rounds["ours"][-1]["rss_vs_terms"]
        print(json.dumps({"bench": "fsdp-summary", **summary}), flush=True)
        final[f"N{n}"] = summary
    print(json.dumps(final))


if __name__ == "__main__":
    main()
