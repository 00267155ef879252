"""offload="disk" against training in memory: one JSON line of step seconds (each, taking turns, the
median of --steps rounds), their ratio, the optimizer's step alone in each and its rate (GB/s of the
bytes AdamW reads and writes: 28 a parameter) beside this machine's memory copy rate, and the bytes
on disk. Where the files fit the page cache (states smaller than the free memory) the offloaded
step is bound by the copies through it and the one I/O thread, not by the disk.

    python bench/bench_offload.py [--width 2048] [--layers 8] [--steps 5] [--dir DIRECTORY]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
from common import provenance

import mpifsdp
from mpifsdp.models.mlp import MLPClassifier


def _trainer(comm, width: int, layers: int, directory):
    """(a step, the optimizer's step alone: each returns its seconds; the optimizer)."""
    model = MLPClassifier([width] * (layers + 1) + [10], seed=0)
    offload = dict(offload="disk", offload_dir=directory) if directory else {}
    mpifsdp.fully_shard(model, comm, units=model.layers[:-1], **offload)
    opt = mpifsdp.AdamW(model, lr=1e-4)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, width)).astype(np.float32), rng.integers(0, 10, 8)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        model(x, y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        return t2 - t0, t2 - t1

    return step, opt


def copy_rate_gbs(nbytes: int = 256 * 2**20) -> float:
    """This machine's memory copy rate (read + write bytes a second, best of 3)."""
    a, b = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(3))
    return 2 * nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the states go (default: a temporary directory)")
    args = ap.parse_args()
    comm = mpifsdp.Comm()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        runs = {
            "memory": _trainer(comm, args.width, args.layers, None),
            "disk": _trainer(comm, args.width, args.layers, directory),
        }
        times = {name: [] for name in runs}
        for _ in range(args.steps + 1):  # the first round warms both
            for name, (step, _) in runs.items():
                times[name].append(step())
        params = sum(g.numel for g in runs["memory"][1].groups)
        line = {"bench": "offload", "params": params, "disk_bytes": runs["disk"][1].on_disk.nbytes}
        for name, rows in times.items():
            line[f"{name}_step_s"] = round(statistics.median(t for t, _ in rows[1:]), 4)
            line[f"{name}_optimizer_s"] = round(opt_s := statistics.median(o for _, o in rows[1:]), 4)
            line[f"{name}_adamw_gbs"] = round(28 * params / opt_s / 1e9, 2)
        line["disk_over_memory"] = round(line["disk_step_s"] / line["memory_step_s"], 3)
        line["memory_copy_gbs"] = round(copy_rate_gbs(), 2)
        print(json.dumps({**line, "provenance": provenance()}), flush=True)


if __name__ == "__main__":
    main()
