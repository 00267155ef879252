"""GPU checks in one run (make gpu-check), printing JSON lines; never part of CI.

python bench/gpu_check.py parity            # CPU-NumPy vs GPU-CuPy, same seeds, one process
mpiexec -n 2 python -m mpi4py bench/gpu_check.py parity --sharded   # 2 ranks on one GPU: host staging
mpiexec -n 1 python -m mpi4py bench/gpu_check.py parity --sharded --transport nccl
Each parity check exits 1 when an error passes its bound; make gpu-check fails if any step fails.
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
from mpifsdp import sharded_model  # noqa: E402
from mpifsdp.data import rank_slice  # noqa: E402
from mpifsdp.models import GPT  # noqa: E402

# ~350 M parameters: GPT-2 medium's shape with a 32 K vocabulary
CONFIGS = {
    **CONFIGS,
    "gpu350m": dict(vocab_size=32768, n_embd=1024, n_layer=24, n_head=16, block_size=1024, batch_size=8),
}
PEAK_TFLOPS = {"float16": 790.0, "float32": 60.0}  # H200: dense bf16/fp16 measured by others; fp32 (no TF32)


SMALL_GPT = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, block_size=16, batch_size=4)
F64_BOUND = 1e-10  # float64 CPU vs GPU losses, relative: only summation order differs (~1e-15 per op)


def _losses(device, dtype, global_batch, comm=None, reverse=False, transport_comm=None):
    """3 training steps of a small GPT on `device`; the global batch's loss per step. With comm: sharded,
    each rank its slice, the loss the ranks' mean. reverse: the batch's rows reversed (the probe)."""
    model = GPT(gpt_config(SMALL_GPT), seed=0, dtype=dtype, device=device)
    if comm is not None:
        mpifsdp.fully_shard(model, comm, units=model.blocks)
    opt = mpifsdp.AdamW(model, lr=1e-2)
    xp = mpifsdp.array_module(device)
    out = []
    for step in range(3):
        x, y = random_batch(SMALL_GPT, global_batch, seed=step)
        if reverse:
            x, y = x[::-1].copy(), y[::-1].copy()
        if comm is not None:
            x, y = rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)
        loss = train_step(model, opt, xp.asarray(x), xp.asarray(y)).item()
        out.append(loss if comm is None else comm.all_reduce_scalar(loss) / comm.size)
    return np.array(out)


def parity(args):
    """CPU-NumPy vs GPU-CuPy from the same seeds, float64 and float32; exits 1 beyond the bounds.

    float64: relative error <= F64_BOUND. float32: the bound of tests/tolerance.py, measured on this
    machine: 8x the CPU run's own reordering noise (the same run with the batch's rows reversed)
    plus 16 ulps: a GPU's kernels reorder sums, and nothing else may differ."""
    comm = mpifsdp.Comm(device="cuda", transport=args.transport) if args.sharded else None
    global_batch = 4 * (comm.size if comm else 1)
    results, ok = {}, True
    for dtype in (np.float64, np.float32):
        cpu = _losses("cpu", dtype, global_batch)
        gpu = _losses("cuda", dtype, global_batch, comm)
        err = float(np.max(np.abs(gpu - cpu) / np.abs(cpu)))
        if dtype == np.float64:
            limit = F64_BOUND
        else:
            probe = float(
                np.max(np.abs(_losses("cpu", dtype, global_batch, reverse=True) - cpu) / np.abs(cpu))
            )
            limit = 8 * probe + 16 * float(np.finfo(dtype).eps)
        ok &= err <= limit
        results[np.dtype(dtype).name] = {"cpu": cpu.tolist(), "gpu": gpu.tolist(), "max_rel_err": err,
                                         "bound": limit}  # fmt: skip
    if comm is None or comm.rank == 0:
        where = {"ranks": comm.size if comm else 1, "transport": comm.transport.name if comm else None}
        print(json.dumps({"check": "parity", "sharded": args.sharded, **where, "ok": ok, **results}))
    if not ok:
        sys.exit(1)


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
    sharded = sharded_model(model)
    plan = sharded.plan()
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
    ap.add_argument("--transport", choices=["nccl", "cuda-aware-mpi", "host"], default=None)
    ap.add_argument("--config", choices=CONFIGS, default="peer")
    ap.add_argument("--dtype", default="float32", choices=sorted(PEAK_TFLOPS))
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    parity(args) if args.check == "parity" else speed(args)


if __name__ == "__main__":
    main()
