"""GPU checks in one run (make gpu-check), printing JSON lines; never part of CI.

python bench/gpu_check.py parity            # CPU-NumPy vs GPU-CuPy, same seeds, one process
mpiexec -n 2 python -m mpi4py bench/gpu_check.py parity --sharded   # 2 ranks on one GPU: host staging
python bench/gpu_check.py speed --config peer|gpu350m [--dtype float16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import CONFIGS, gpt_config, random_batch, train_step  # noqa: E402

import mpifsdp  # noqa: E402
from mpifsdp.data import rank_slice  # noqa: E402
from mpifsdp.fsdp import fsdp_group  # noqa: E402
from mpifsdp.models import GPT  # noqa: E402

# ~350 M parameters: GPT-2 medium's shape with a 32 K vocabulary
CONFIGS = {
    **CONFIGS,
    "gpu350m": dict(vocab_size=32768, n_embd=1024, n_layer=24, n_head=16, block_size=1024, batch_size=8),
}
PEAK_TFLOPS = {"float16": 790.0, "float32": 60.0}  # H200: dense bf16/fp16 measured by others; fp32 (no TF32)


def parity(args):
    small = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, block_size=16, batch_size=4)
    comm = mpifsdp.Comm(device="cuda") if args.sharded else None
    losses = {}
    for device in ("cpu", "cuda"):
        model = GPT(gpt_config(small), seed=0, device=device)
        if args.sharded and device == "cuda":
            mpifsdp.fully_shard(model, comm, units=model.blocks)
        opt = mpifsdp.AdamW(model, lr=1e-2)
        xp = mpifsdp.array_module(device)
        out = []
        for step in range(3):
            x, y = random_batch(small, 4 * (comm.size if comm else 1), seed=step)
            if args.sharded and device == "cuda":
                x, y = rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)
            loss = train_step(model, opt, xp.asarray(x), xp.asarray(y))
            out.append(loss.item())
        losses[device] = out
    if comm is None or comm.rank == 0:
        err = (
            max(abs(a - b) / abs(a) for a, b in zip(losses["cpu"], losses["cuda"]))
            if not args.sharded
            else None
        )
        print(json.dumps({"check": "parity", "sharded": args.sharded, "losses": losses, "max_rel_err": err,
                          "transport": comm.transport.name if comm else None}))  # fmt: skip


def speed(args):
    import cupy as cp

    cfg = CONFIGS[args.config]
    comm = mpifsdp.Comm(device="cuda")
    model = GPT(gpt_config(cfg), seed=0, device=comm.device)
    dtype = None if args.dtype == "float32" else np.dtype(args.dtype)
    mpifsdp.fully_shard(model, comm, units=model.blocks, param_dtype=dtype, reduce_dtype=np.float32)
    opt = mpifsdp.AdamW(model, lr=1e-4)
    scaler = mpifsdp.LossScaler() if dtype is not None else None
    x, y = (
        cp.asarray(rank_slice(a, comm.rank, comm.size))
        for a in random_batch(cfg, cfg["batch_size"] * comm.size)
    )
    times = []
    for i in range(args.steps + 1):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        loss = model(x, y)
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt, max_norm=1.0)
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        cp.cuda.Device().synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    tokens = cfg["batch_size"] * cfg["block_size"]
    tflops = model.flops_per_token(cfg["block_size"]) * tokens / step_s / 1e12
    group = fsdp_group(model)
    plan = group.plan()
    formula = plan["persistent"] + 2 * plan["largest_unit"] + plan["root_unit"]
    result = {
        "check": "speed",
        "config": args.config,
        "dtype": args.dtype,
        "params": plan["params"],
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "tflops": round(tflops, 2),
        "mfu": round(tflops / PEAK_TFLOPS[args.dtype], 4),
        "peak_device_mib": round(cp.get_default_memory_pool().total_bytes() / 2**20, 1),
        "formula_mib_without_activations": round(formula / 2**20, 1),
    }
    if comm.rank == 0:
        print(json.dumps(result))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("check", choices=["parity", "speed"])
    ap.add_argument("--sharded", action="store_true")
    ap.add_argument("--config", choices=CONFIGS, default="peer")
    ap.add_argument("--dtype", default="float32", choices=sorted(PEAK_TFLOPS))
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    parity(args) if args.check == "parity" else speed(args)


if __name__ == "__main__":
    main()
