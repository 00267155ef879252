"""Deterministic mode's cost: its step against the normal step at the same N, same run, and the
bytes its reductions move against the normal reduce-scatter's (docs/determinism.md).

    mpiexec -n N python bench/bench_deterministic.py [--config peer|small] [--steps 3] [--chunk 1,4]
        [--chunk-threads 1]

One JSON line per chunk size at rank 0: median step seconds of both modes (alternating, so drift
hits both), their ratio, and the reduction bytes per step of each mode. Targets (issue 31): ratio
<= 1.25 at N = 2, bytes <= 2x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import add_config_arguments, config_from, gpt_config, random_batch  # noqa: E402

from mpifsdp import AdamW, Comm, fully_shard, sharded_model  # noqa: E402
from mpifsdp.data import rank_slice  # noqa: E402
from mpifsdp.models import GPT  # noqa: E402


def _built(comm, cfg, chunk=None, chunk_threads=1):
    """The normal mode's model and optimizer, or (chunk: an int) deterministic mode's."""
    model = GPT(gpt_config(cfg), seed=0)
    options = {} if chunk is None else dict(deterministic=True, chunk_size=chunk, chunk_threads=chunk_threads)
    fully_shard(model, comm, units=model.blocks, **options)
    return model, AdamW(model, lr=1e-4)


def _step(comm, model, opt, x, y):
    sharded = sharded_model(model)
    local = [rank_slice(a, comm.rank, comm.size) for a in (x, y)]
    comm.ledger.reset()
    start = time.perf_counter()
    if sharded.deterministic:
        for chunk in sharded.chunks(*local):
            model(*chunk).backward()
    else:
        model(*local).backward()
    opt.clip_grad_norm(1.0)
    opt.step()
    opt.zero_grad()
    seconds = comm.allgather_object(time.perf_counter() - start)
    return max(seconds), comm.ledger.total("bytes", op="reduce_scatter")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_arguments(ap)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--chunk", default="1,4", help="chunk sizes (sequences) to measure")
    ap.add_argument("--chunk-threads", type=int, default=1, help="BLAS threads a chunk's GEMMs run on")
    args = ap.parse_args()
    cfg, comm = config_from(args), Comm()
    x, y = random_batch(cfg, cfg["batch_size"])
    for chunk in (int(c) for c in args.chunk.split(",")):
        if (cfg["batch_size"] // chunk) % comm.size or cfg["batch_size"] % chunk:
            continue
        runs = {"normal": _built(comm, cfg), "deterministic": _built(comm, cfg, chunk, args.chunk_threads)}
        times, nbytes = {k: [] for k in runs}, {}
        for step in range(args.steps + 1):  # the first of each is warm-up
            for name, (model, opt) in runs.items():
                seconds, nbytes[name] = _step(comm, model, opt, x, y)
                if step:
                    times[name].append(seconds)
        if comm.rank == 0:
            median = {k: statistics.median(v) for k, v in times.items()}
            print(json.dumps({
                "bench": "deterministic", "config": args.config, "world_size": comm.size, "chunk": chunk,
                "chunk_threads": args.chunk_threads,
                "normal_s": round(median["normal"], 4), "deterministic_s": round(median["deterministic"], 4),
                "ratio": round(median["deterministic"] / median["normal"], 3),
                "reduce_bytes_normal": nbytes["normal"],
                "reduce_bytes_deterministic": nbytes["deterministic"],
                "bytes_ratio": round(nbytes["deterministic"] / max(1, nbytes["normal"]), 3),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
