"""GPU checks in one run (make gpu-check), printing JSON lines; never part of CI.

python bench/gpu_check.py preflight         # CuPy, the GPU, NCCL, the MPI library: what is there
python bench/gpu_check.py parity            # CPU-NumPy vs GPU-CuPy, same seeds, one process
mpiexec -n 2 python -m mpi4py bench/gpu_check.py parity --sharded   # 2 ranks on one GPU: host staging
mpiexec -n 1 python -m mpi4py bench/gpu_check.py parity --sharded --transport nccl
mpiexec -n 4 python -m mpi4py bench/gpu_check.py parity --sharded --shard-size 2   # HSDP 2 x 2, host staging
mpiexec -n 2 python -m mpi4py bench/gpu_check.py replay --transport nccl   # replayed == eager, bit for bit
Each parity check exits 1 when an error passes its bound; make gpu-check fails if any step fails.
python bench/gpu_check.py speed --config peer|gpu350m|gpu13b [--dtype float16|bfloat16] [--prefetch 0]
    [--graph] [--kernels]                   # --graph: from one CUDA graph, the passes, then the whole step;
                                            # --kernels: one step's GPU kernels by time (torch's CUPTI)
    [--phantom 8 --recompute auto]          # rank 0 of an 8-way job alone (mpifsdp.PhantomComm)
python bench/gpu_check.py attention         # cuDNN's fused attention against the batched passes, timed
python bench/gpu_check.py roofline          # the step's GEMMs' TFLOP/s and the copy bandwidth
python bench/gpu_check.py columns           # the column-sum kernels at the step's shapes, by blocks
--device cpu runs any check on the CPU in place of the GPU: a dry run of the script without one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import types

import numpy as np
from common import (  # noqa: E402
    CONFIGS,
    gpt_config,
    median_time,
    provenance,
    random_batch,
    step_gemm_shapes,
    synchronizer,
    train_step,
)

import mpifsdp  # noqa: E402
from mpifsdp import sharded_model  # noqa: E402
from mpifsdp.autodiff.tape import profile  # noqa: E402
from mpifsdp.base.accounting import HOST_SYNCS  # noqa: E402
from mpifsdp.base.checks import bfloat16, float_dtype  # noqa: E402
from mpifsdp.comm.launcher import library  # noqa: E402
from mpifsdp.comm.transport import mpi_cuda_support  # noqa: E402
from mpifsdp.cuda import sdpa as gpu_attention  # noqa: E402
from mpifsdp.data import rank_slice  # noqa: E402
from mpifsdp.models import GPT, gpt_units  # noqa: E402
from mpifsdp.planning import planner  # noqa: E402
from mpifsdp.planning.calibration import attention_flops, mfu  # noqa: E402
from mpifsdp.planning.planner import gpt_activation_bytes, gpt_loss_gradient_bytes  # noqa: E402

SMALL_GPT = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, block_size=16, batch_size=4)
# ~350 M parameters: GPT-2 medium's shape with a 32 K vocabulary
CONFIGS = {
    **CONFIGS,
    "gpu350m": dict(vocab_size=32768, n_embd=1024, n_layer=24, n_head=16, block_size=1024, batch_size=8),
    # ~13 B parameters (206 GB of fp32 states: 26 GB a rank of 8): a model that needs sharding
    "gpu13b": dict(vocab_size=32768, n_embd=5120, n_layer=40, n_head=40, block_size=2048, batch_size=4),
    "tiny": SMALL_GPT,  # a dry run of a check's code (the stand-in's float16 GEMMs are slow NumPy loops)
}
# H200 SXM: dense fp16/bf16 (the datasheet's 1,979 is "with sparsity"; an NVL is 835); fp32 without TF32
PEAK_TFLOPS = {"float16": 989.4, "bfloat16": 989.4, "float32": 60.0}


F64_BOUND = 1e-10  # float64 CPU vs GPU losses, relative: only summation order differs (~1e-15 per op)


def emit(row: dict):
    """One JSON line of a check, with what it stands on (common.provenance: commit, source digest,
    libraries) and, on a GPU, which one and the dense peaks its MFU divides by (PEAK_TFLOPS: an
    H200's)."""
    where = {"gpu": _GPU[0], "mfu_peak_tflops": PEAK_TFLOPS} if _GPU else {}  # the MFU's denominators
    print(json.dumps({**row, **where, "provenance": provenance()}), flush=True)


_GPU: list = []  # the GPU's name, once a check found one


def _losses(device, dtype, global_batch, comm=None, reverse=False, shard_size=None):
    """3 training steps of a small GPT on `device`; the global batch's loss per step. With comm: sharded,
    each rank its slice, the loss the ranks' mean (shard_size: hybrid sharding, groups of that many
    ranks). reverse: the batch's rows reversed (the probe)."""
    model = GPT(gpt_config(SMALL_GPT), seed=0, dtype=dtype, device=device)
    if comm is not None:
        mpifsdp.fully_shard(model, comm, units=model.blocks, shard_size=shard_size)
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


def _nccl_version(path: str) -> str | None:
    """The version a libnccl file reports (ncclGetVersion: major * 10000 + minor * 100 + patch since
    2.9), loaded on its own (RTLD_LOCAL: the copies do not clash); None where it does not load."""
    import ctypes

    try:
        code = ctypes.c_int()
        if ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    major, rest = divmod(code.value, 10000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _loaded(library: str) -> list:
    """The files of `library` this process has loaded (CuPy's NCCL, once imported)."""
    with open("/proc/self/maps") as maps:
        return mpifsdp.base.backend.mapped_paths(maps, library)


def every_libnccl() -> list[dict]:
    """Every libnccl this machine has, and its version: the nvidia-nccl wheel's, torch's, CuPy's own,
    the system's and CUDA's (which one a run loads decides whether ranks may share a GPU: 2.30 and
    later, backend.nccl_shares_gpus)."""
    import glob
    import site

    roots = [
        *site.getsitepackages(),
        site.getusersitepackages(),
        *os.environ.get("LD_LIBRARY_PATH", "").split(":"),
    ]
    roots += [
        "/usr/lib",
        "/usr/lib64",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/local/lib",
        "/usr/local/cuda/lib64",
    ]
    paths = set()
    for root in filter(None, roots):
        for depth in ("", "*/", "*/*/", "*/*/*/"):  # site-packages/nvidia/nccl/lib, torch/lib
            paths.update(os.path.realpath(p) for p in glob.glob(f"{root}/{depth}libnccl.so*"))
    return [{"path": p, "version": _nccl_version(p)} for p in sorted(paths)]


def preflight(args):
    """What the GPU run stands on, before anything is measured: fails when CuPy cannot run a kernel."""
    from mpi4py import MPI

    info = {"check": "preflight", "mpi": library(MPI),
            "mpi_cuda_aware": (aware := mpi_cuda_support())[0], "mpi_cuda_aware_by": aware[1]}  # fmt: skip
    if args.device != "cpu":
        cp = mpifsdp.array_module(args.device)
        a = cp.arange(1 << 20, dtype=cp.float32)
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        info.update(
            cupy=cp.__version__,
            cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
            memory_gib=round(props["totalGlobalMem"] / 2**30, 1),
            kernel_ok=bool(float((a * 2).sum()) == float(np.arange(1 << 20, dtype=np.float64).sum() * 2)),
            nccl=mpifsdp.base.backend.nccl().get_version() if mpifsdp.base.backend.nccl_available() else None,
            nccl_loaded=_loaded("libnccl.so"),
            cudnn=gpu_attention.version(),
            bfloat16=bfloat16() is not None,  # ml_dtypes, which CuPy's bfloat16 is
        )
    info["libnccl"] = every_libnccl()
    # CuPy's NCCL lets ranks share this GPU (2.30 and later): make gpu-check runs 2 ranks over it
    info["nccl_multi_rank_gpu"] = (info.get("nccl") or 0) >= mpifsdp.base.backend.NCCL_SHARES_GPUS
    emit(info)
    if info.get("kernel_ok") is False:
        sys.exit(1)


def parity(args):
    """CPU-NumPy vs GPU-CuPy from the same seeds, float64 and float32; exits 1 beyond the bounds.

    float64: relative error <= F64_BOUND. float32: the bound of tests/tolerance.py, measured on this
    machine: 8x the CPU run's own reordering noise (the same run with the batch's rows reversed)
    plus 16 ulps: a GPU's kernels reorder sums, and nothing else may differ."""
    comm = mpifsdp.Comm(device=args.device, transport=args.transport) if args.sharded else None
    global_batch = 4 * (comm.size if comm else 1)
    results, ok = {}, True
    for dtype in (np.float64, np.float32):
        cpu = _losses("cpu", dtype, global_batch)
        gpu = _losses(args.device, dtype, global_batch, comm, shard_size=args.shard_size)
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
        where = {"ranks": comm.size if comm else 1, "transport": comm.transport.name if comm else None,
                 "shard_size": args.shard_size}  # fmt: skip
        emit({"check": "parity", "sharded": args.sharded, **where, "ok": ok, **results})
    if not ok:
        sys.exit(1)


def _replayed_or_eager(comm, how: str, dtype, steps: int = 4) -> tuple[list, list]:
    """(losses, this rank's shards) after `steps` steps of a small GPT in `dtype` through a LossScaler
    with clipping: how="eager", "passes" (forward and backward replayed from one CUDA graph) or
    "whole" (the optimizer's step in the graph too)."""
    model = GPT(gpt_config(SMALL_GPT), seed=0, device=comm.device)
    mpifsdp.fully_shard(model, comm, units=model.blocks, param_dtype=dtype, reduce_dtype=np.float32)
    opt, scaler = mpifsdp.AdamW(model, lr=1e-3), mpifsdp.LossScaler(init_scale=256.0)

    def passes(x, y):
        loss = model(x, y)
        scaler.scale(loss).backward()
        return loss

    whole = dict(optimizer=opt, scaler=scaler, max_norm=1.0) if how == "whole" else {}
    run = passes if how == "eager" else mpifsdp.GraphedPasses(model, passes, **whole)
    losses = []
    for step in range(steps):
        x, y = random_batch(SMALL_GPT, SMALL_GPT["batch_size"] * comm.size, seed=step)
        loss = run(rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size))
        if how != "whole":
            scaler.step(opt, max_norm=1.0)
            opt.zero_grad()
        losses.append(loss.item())
    return losses, [mpifsdp.to_numpy(u.shard) for u in sharded_model(model).units]


def replay(args):
    """Steps whose forward and backward are replayed from one CUDA graph against the same steps run
    eagerly, over this job's transport (NCCL: its collectives inside the graph), float16 and bfloat16:
    every loss and this rank's shards bit for bit, on every rank; and with the whole step in the
    graph, within a few float32 roundings (its bias corrections come from the device's pow, within
    2 ulp of the host's in double, so a hyperparameter's float32 rounding may differ); exits 1
    otherwise."""
    comm = mpifsdp.Comm(device=args.device, transport=args.transport)
    results, ok = {}, True
    for dtype in [np.float16, *([bfloat16()] if bfloat16() is not None else [])]:
        (eager_losses, eager), (losses, shards), (whole_losses, whole) = (
            _replayed_or_eager(comm, how, dtype) for how in ("eager", "passes", "whole")
        )
        same = losses == eager_losses and all(np.array_equal(a, b) for a, b in zip(shards, eager))
        off = max(float(np.max(np.abs(a - b) / (np.max(np.abs(b)) or 1))) for a, b in zip(whole, eager))
        close = off <= 1e-5 and np.allclose(whole_losses, eager_losses, rtol=1e-5, atol=0)
        same, close = (all(comm.allgather_object(v)) for v in (same, close))
        results[np.dtype(dtype).name] = {"losses": losses, "eager_losses": eager_losses, "equal": same}
        results[np.dtype(dtype).name] |= {"whole_step_losses": whole_losses, "whole_step_max_rel": off}
        results[np.dtype(dtype).name] |= {"whole_step_close": close}
        ok &= same and close
    if comm.rank == 0:
        emit({"check": "replay", "ranks": comm.size, "transport": comm.transport.name, "ok": ok, **results})
    if not ok:
        sys.exit(1)


def _param_dtype(args):
    """--dtype as fully_shard's param_dtype: None for float32 (the masters' own)."""
    return None if args.dtype == "float32" else float_dtype("--dtype", args.dtype)


def _speed_model(args, cfg):
    """(comm, model, param dtype) of a speed check. --phantom N: rank 0 of an N-way job, alone
    (PhantomComm: N's shards, gathers and reductions, the peers stand-ins), the model built deferred,
    each unit made once and sharded as the real job's ranks do (a 13B fits one GPU only so)."""
    if args.phantom:
        comm = mpifsdp.PhantomComm(args.phantom, 0, device=args.device)
        with mpifsdp.deferred_init():
            model = GPT(gpt_config(cfg), seed=0, device=comm.device)
    else:
        comm = mpifsdp.Comm(device=args.device, transport=args.transport)
        model = GPT(gpt_config(cfg), seed=0, device=comm.device)
    dtype = _param_dtype(args)
    mpifsdp.fully_shard(model, comm, units=model.blocks, param_dtype=dtype, reduce_dtype=np.float32,
                        prefetch=args.prefetch, recompute=args.recompute)  # fmt: skip
    return comm, model, dtype


def _planned_pool(args, cfg, comm, dtype) -> dict:
    """The memory the planner gives one rank of this run (its shards, gathered units, the tape's
    activations and the loss's gradient) in MiB, to hold the device's pool against."""
    itemsize = np.dtype(dtype or np.float32).itemsize
    config, batch = gpt_config(cfg), cfg["batch_size"]
    device = "cpu" if args.device == "cpu" else "cuda"
    beside = {
        "activation_bytes": gpt_activation_bytes(config, batch, itemsize, args.recompute, device=device),
        "loss_gradient_bytes": gpt_loss_gradient_bytes(config, batch, itemsize),
    }
    want = planner.plan(gpt_units(config)[0], comm.size, itemsize=4, compute_itemsize=itemsize,
                        gpu=device != "cpu", prefetch=args.prefetch, **beside)  # fmt: skip
    return {"plan_total_mib": round(want["memory_bytes"]["total"] / 2**20, 1)}


def _exposed(comm, one_step, step_s: float) -> dict:
    """One more step with every collective's wait timed (Comm.time_waits: on a GPU the compute
    stream's stall at each wait, by its events; on the CPU the host blocked): the exposed
    communication a step, its share of the median step, and by unit (the overlap each one gets)."""
    comm.count_stalls()  # (the device is synchronized: every earlier timed wait is done)
    comm.ledger.reset()
    comm.time_waits = True
    try:
        one_step()  # it synchronizes at its end: each timed wait's events are done
    finally:
        comm.time_waits = False
    comm.count_stalls()
    by_unit = comm.ledger.exposed_by_unit()
    exposed = sum(by_unit.values())
    return {
        "exposed_comm_s": round(exposed, 5),
        "exposed_comm_fraction": round(exposed / step_s, 4),
        "exposed_comm_s_by_unit": {unit or "(other)": round(s, 5) for unit, s in by_unit.items()},
    }


def _recompute(args, cfg) -> bool:
    """--recompute as a bool: auto recomputes only where the plan without it, at 1.15 times (the pool
    against the plan), would not fit the device's memory (recomputing costs a forward a step)."""
    if args.recompute != "auto":
        return args.recompute == "yes"
    if args.device == "cpu":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        cp = mpifsdp.array_module(args.device)
        memory = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["totalGlobalMem"]
    dtype = _param_dtype(args)
    ranks = types.SimpleNamespace(size=args.phantom or 1)
    without = _planned_pool(argparse.Namespace(**{**vars(args), "recompute": False}), cfg, ranks, dtype)
    return 1.15 * without["plan_total_mib"] * 2**20 > memory


def speed(args):
    cfg = CONFIGS[args.config]
    args.recompute = _recompute(args, cfg)
    comm, model, dtype = _speed_model(args, cfg)
    xp = mpifsdp.array_module(comm.device)
    opt = mpifsdp.AdamW(model, lr=1e-4)
    scaler = mpifsdp.LossScaler() if args.dtype == "float16" else None  # bfloat16 has float32's range
    # the batch on the host, as a loader gives it: its checks read nothing back from the device
    x, y = (rank_slice(a, comm.rank, comm.size) for a in random_batch(cfg, cfg["batch_size"] * comm.size))
    synchronize = synchronizer(xp)

    def passes(x, y):
        loss = model(x, y)
        (scaler.scale(loss) if scaler else loss).backward()
        return loss

    def step(run, sync=True, whole=False):
        loss = run(x, y)
        if whole:  # the graph held the optimizer's step
            if sync:
                synchronize()
            return loss
        if scaler:
            scaler.step(opt, max_norm=1.0)
        else:
            if dtype is not None:
                opt.clip_grad_norm(1.0)
            opt.step()
        opt.zero_grad()
        if sync:
            synchronize()
        return loss

    def steady_s(run) -> float:
        """A step's seconds with args.steps of them back to back and one sync at the end, as a
        training loop runs them (the next step's host work overlapping this one's optimizer on the
        device): the per-step times above also hold the host's time before a step's first kernel."""
        synchronize()
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(run, sync=False)
        synchronize()
        return (time.perf_counter() - t0) / args.steps

    times, loss = _timed(lambda: step(passes), args.steps, 1, synchronize, comm)
    step_s = float(np.median(times))
    ranks_here = 1 if args.phantom else comm.size  # a phantom's peers compute nothing
    tokens = cfg["batch_size"] * cfg["block_size"] * ranks_here
    # all ranks' tokens over the GPUs they share (make gpu-check: one node, ranks mod GPUs)
    gpus = min(ranks_here, xp.cuda.runtime.getDeviceCount()) if xp is not np else 1
    tflops = model.flops_per_token(cfg["block_size"]) * tokens / step_s / 1e12 / gpus
    sharded = sharded_model(model)
    plan = sharded.plan()
    formula = plan["persistent"] + 2 * plan["largest_unit"] + plan["root_unit"]
    itemsize = np.dtype(dtype or np.float32).itemsize
    activations = gpt_activation_bytes(
        gpt_config(cfg), cfg["batch_size"], itemsize, args.recompute, device=comm.device
    )
    activations += gpt_loss_gradient_bytes(gpt_config(cfg), cfg["batch_size"], itemsize)
    per_gpu = tokens / gpus  # PaLM's MFU counts attention's products whole, llm.c's their causal half
    model_flops = model.flops_per_token(cfg["block_size"]) * per_gpu
    util = mfu(model_flops, attention_flops(gpt_config(cfg), per_gpu), step_s, PEAK_TFLOPS[args.dtype] * 1e12)
    result = {
        "check": "speed",
        "config": args.config,
        "dtype": args.dtype,
        "ranks": comm.size,
        "phantom": bool(args.phantom),  # rank 0 of `ranks`, alone: its peers stood in for
        "transport": comm.transport.name,
        "prefetch": args.prefetch,
        "recompute": args.recompute,
        "params": plan["params"],
        "step_s": round(step_s, 4),
        "steps_s": [round(t, 4) for t in times],
        "last_loss": float(loss.item()),
        "tokens_per_s": round(tokens / step_s, 1),
        "tflops": round(tflops, 2),
        "mfu": round(util["palm"], 4),
        "mfu_causal": round(util["causal"], 4),
        "steady_step_s": round(steady_s(passes), 4),
        # CuPy's pool keeps what it once held: its size is the step's high-water mark
        "device_pool_mib": None if xp is np else round(xp.get_default_memory_pool().total_bytes() / 2**20, 1),
        "formula_mib_without_activations": round(formula / 2**20, 1),
        "plan_mib_with_activations": round((formula + activations) / 2**20, 1),  # the pool's yardstick
        **(planned := _planned_pool(args, cfg, comm, dtype)),
    }
    if result["device_pool_mib"] is not None:
        result["pool_over_plan"] = round(result["device_pool_mib"] / planned["plan_total_mib"], 3)
    result.update(_exposed(comm, lambda: step(passes), step_s))
    if comm.rank == 0:  # before the graph is tried: a capture that fails loses no eager figure
        emit(result)
    if args.graph:  # the same model's steps, forward and backward replayed from one CUDA graph
        graphed = mpifsdp.GraphedPasses(model, passes)
        runs = (lambda: step(graphed), lambda: step(graphed, sync=False))
        line = _graph_line("speed_graphed", runs, args.steps, synchronize, comm, result, step_s)
        if comm.rank == 0:
            emit({**line, "graph_pool_mib": round(graphed.pool_bytes() / 2**20, 1)})
        if args.kernels and comm.rank == 0:
            emit({"check": "kernels", "run": "graphed", **_kernel_times(lambda: step(graphed))})
        del graphed  # its pool (the passes' activations) given back before the whole step's is made
        gc.collect()
        if xp is not np:
            xp.get_default_memory_pool().free_all_blocks()
        clip = 1.0 if scaler or dtype is not None else None  # as step() clips
        whole = mpifsdp.GraphedPasses(model, passes, optimizer=opt, scaler=scaler, max_norm=clip)
        runs = (lambda: step(whole, whole=True), lambda: step(whole, sync=False, whole=True))
        line = _graph_line("speed_whole_step", runs, args.steps, synchronize, comm, result, step_s)
        if comm.rank == 0:
            emit({**line, "graph_pool_mib": round(whole.pool_bytes() / 2**20, 1)})
        if args.kernels and comm.rank == 0:
            emit({"check": "kernels", "run": "whole_step", **_kernel_times(runs[0])})
    if args.kernels and comm.rank == 0:
        emit({"check": "kernels", "run": "eager", **_kernel_times(lambda: step(passes))})
    if args.profile:
        with profile() as costs:
            step(passes)
        top = sorted(costs.items(), key=lambda kv: -(kv[1]["forward_s"] + kv[1]["backward_s"]))
        seconds = {name: [round(c["forward_s"], 4), round(c["backward_s"], 4)] for name, c in top[:8]}
        if comm.rank == 0:
            emit({"check": "profile", "config": args.config, "fwd_bwd_s": seconds})


def _graph_line(check: str, runs, steps: int, synchronize, comm, eager: dict, step_s: float) -> dict:
    """The speed of steps from one CUDA graph (the passes', or the whole step's: GraphedPasses given
    the optimizer): runs = (a step and its sync, a step alone). Each step synchronized, then `steps`
    back to back with one sync at the end (what a training loop runs: the next step's host work
    overlapping this one's device work), MFU both ways from the eager line's, and the host syncs a
    step (a whole step's: its verdict's one read, a step late)."""
    times, _ = _timed(runs[0], steps, 2, synchronize, comm)
    whole_s = float(np.median(times))
    synchronize()
    comm.barrier()
    HOST_SYNCS.reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        runs[1]()
    synchronize()
    steady = (time.perf_counter() - t0) / steps
    return {
        "check": check,
        "step_s": round(whole_s, 4),
        "steps_s": [round(t, 4) for t in times],
        "speedup": round(step_s / whole_s, 3),
        "mfu": round(eager["mfu"] * step_s / whole_s, 4),
        "mfu_causal": round(eager["mfu_causal"] * step_s / whole_s, 4),
        "steady_step_s": round(steady, 4),
        "steady_mfu": round(eager["mfu"] * step_s / steady, 4),
        "steady_mfu_causal": round(eager["mfu_causal"] * step_s / steady, 4),
        "host_syncs_per_step": round(HOST_SYNCS.total() / steps, 2),
    }


def _kernel_times(step, top: int = 25) -> dict:
    """One step's GPU kernels, by the device's own clock: CUPTI, through PyTorch's profiler (on the lent
    machine: never a dependency), which records every kernel of the process, CuPy's, cuBLAS's,
    cuDNN's and NCCL's too, graph replays included. The `top` kernels by total time, and the sum of
    all against the step's wall time (the rest: the device idle, waiting on the host)."""
    try:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as cupti_profile
    except ImportError:
        return {"error": "no torch here: the kernel breakdown needs its profiler (CUPTI)"}
    step()  # warm, outside the trace
    start = time.perf_counter()
    try:
        with cupti_profile(activities=[ProfilerActivity.CUDA]) as traced:
            step()
        wall_ms, averaged = 1000 * (time.perf_counter() - start), traced.key_averages()
    except Exception as exc:  # a profiler that cannot trace here loses no other figure
        return {"error": f"{type(exc).__name__}: {exc}"}

    def device_ms(event) -> float:
        return (getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)) / 1000

    events = sorted(averaged, key=device_ms, reverse=True)
    kernels = [[e.key[:90], e.count, round(device_ms(e), 3)] for e in events[:top]]
    return {"wall_ms": round(wall_ms, 2), "kernels_ms": round(sum(map(device_ms, events)), 2), "top": kernels}


def _timed(step, steps: int, warm: int, synchronize, comm) -> tuple[list, object]:
    """(seconds of each of `steps` steps after `warm` untimed ones, the last step's result)."""
    times = []
    for i in range(steps + warm):
        synchronize()
        comm.barrier()
        t0 = time.perf_counter()
        result = step()
        if i >= warm:
            times.append(time.perf_counter() - t0)
    return times, result


def gemm(args):
    """The GEMM ceiling a step stands on: one MLP-sized product (8192 x 1024 x 4096) by the array
    module alone, by mpifsdp's linear primitive (forward and VJP), and by torch where installed."""
    from mpifsdp import Tensor, ops

    xp = mpifsdp.array_module(args.device)
    synchronize = synchronizer(xp)
    M, K, N = 8192, 1024, 4096
    rows = []
    for dtype in (np.float32,) if xp is np else (np.float32, np.float16):  # NumPy has no fast float16
        rng = np.random.default_rng(0)
        a = xp.asarray(rng.standard_normal((M, K), dtype=np.float32), dtype=dtype)
        w = xp.asarray(rng.standard_normal((K, N), dtype=np.float32) / 32, dtype=dtype)
        x, wt = Tensor(a, requires_grad=True), Tensor(w, requires_grad=True)

        def primitive_step(x=x, wt=wt):
            ops.linear(x, wt).sum().backward()

        def timed(fn, flops):
            seconds = min(median_time(lambda: (fn(), synchronize()), 3) for _ in range(2))
            return round(flops / seconds / 1e12, 2)

        row = {"dtype": np.dtype(dtype).name, "shape": [M, K, N]}
        row["matmul_tflops"] = timed(lambda a=a, w=w: a @ w, 2 * M * K * N)
        row["linear_fwd_bwd_tflops"] = timed(primitive_step, 6 * M * K * N)
        b = Tensor(xp.zeros(N, dtype=dtype), requires_grad=True)
        row["gelu_linear_bias_fwd_bwd_tflops"] = timed(
            lambda x=x, wt=wt, b=b: ops.linear(x, wt, b, gelu_input=True).sum().backward(), 6 * M * K * N
        )
        row["torch_matmul_tflops"] = _torch_gemm_tflops(args.device, dtype, M, K, N)
        rows.append(row)
    emit({"check": "gemm", "rows": rows})


def attention(args):
    """Causal attention at the config's shape (gpu350m: B 8, 16 heads, T 1024, head 64), float16:
    forward and backward through cuDNN's fused SDPA and through the batched passes (MPIFSDP_FUSED=0's
    path), milliseconds and TFLOP/s of the causal half of the T x T work (its first use ran the check).
    Each figure: REPEATS calls queued between two syncs, median of 5 (one call and a sync timed the
    host: 100-110 TFLOP/s forward, where the same kernels ran at ~229 inside a CUDA graph)."""
    from mpifsdp import Tensor, ops

    xp = mpifsdp.array_module(args.device)
    synchronize = synchronizer(xp)
    c = CONFIGS[args.config]
    B, H, T, D = c["batch_size"], c["n_head"], c["block_size"], c["n_embd"] // c["n_head"]
    rng = np.random.default_rng(0)
    qkv = xp.asarray(rng.standard_normal((B, T, 3 * H * D), dtype=np.float32), dtype=np.float16)
    g = xp.asarray(rng.standard_normal((B, T, H * D), dtype=np.float32), dtype=np.float16)
    flops = 2 * 2 * B * H * T * T * D / 2  # two products, causal half

    def run(backward: bool):
        x = Tensor(qkv, requires_grad=backward)
        y = ops.attention_qkv(x, H)
        if backward:
            y.backward(g)

    row = {"check": "attention", "shape": [B, H, T, D], "cudnn_version": gpu_attention.version()}
    for path, fused in (("cudnn", "1"), ("batched", "0")):
        os.environ["MPIFSDP_FUSED"] = fused
        fwd = median_time(lambda: ([run(False) for _ in range(REPEATS)], synchronize()), 5) / REPEATS
        both = median_time(lambda: ([run(True) for _ in range(REPEATS)], synchronize()), 5) / REPEATS
        row[path] = {"forward_ms": round(fwd * 1e3, 3), "backward_ms": round((both - fwd) * 1e3, 3),
                     "forward_tflops": round(flops / fwd / 1e12, 1),
                     "backward_tflops": round(2.5 * flops / max(both - fwd, 1e-9) / 1e12, 1)}  # fmt: skip
    os.environ.pop("MPIFSDP_FUSED")
    emit(row)


def roofline(args):
    """What the config's step stands on: TFLOP/s of each distinct GEMM of its step (the block's and
    the head's, float16; attention's are cuDNN's) and the device's copy bandwidth (TB/s), against
    which the step's time is read. Each GEMM also as the backward writes weight gradients (float32
    out through gemm_into), and with one more K or M row (_gemm_variants). Each figure: REPEATS GEMMs
    queued between two syncs, median of 5."""
    xp = mpifsdp.array_module(args.device)
    synchronize = synchronizer(xp)
    rng = np.random.default_rng(0)
    shapes = [s for s in dict.fromkeys(step_gemm_shapes(CONFIGS[args.config])) if s[0] == 1]
    rows = []
    for _, m, k, n in shapes:
        a = xp.asarray(rng.standard_normal((m, k + 8), dtype=np.float32), dtype=np.float16)
        t = xp.asarray(rng.standard_normal((k, m + 8), dtype=np.float32), dtype=np.float16)
        w = xp.asarray(rng.standard_normal((k + 1, n), dtype=np.float32), dtype=np.float16)
        row = {"shape": [m, k, n]}
        for name, run in _gemm_variants(a, t, w, m, k).items():
            seconds = median_time(lambda run=run: ([run() for _ in range(REPEATS)], synchronize()), 5)
            row[name] = round(2 * m * k * n * REPEATS / seconds / 1e12, 1)
        rows.append(row)
    block = xp.empty(1 << 28, dtype=np.float16)  # 512 MiB
    into = xp.empty_like(block)
    seconds = median_time(lambda: (xp.copyto(into, block), synchronize()), 5)
    copy_tbs = round(2 * block.nbytes / seconds / 1e12, 2)  # read + write
    emit({"check": "roofline", "config": args.config, "gemms_float16": rows, "copy_tb_s": copy_tbs})


def columns(args):
    """The raw kernels that add columns across thread blocks (layer_norm_backward, gelu_and_grad_sums)
    at the config's shapes in float16, microseconds a call and the GB/s of their rows' traffic, for
    several counts of thread blocks (the adding blocks' share grows with them); the row kernels
    without column sums beside them (layer_norm_forward, gelu_bias_rows)."""
    from mpifsdp.base import kernels
    from mpifsdp.cuda import kernels as gpu_kernels
    from mpifsdp.cuda import layer_norm as gpu_layer_norm

    xp = mpifsdp.array_module(args.device)
    synchronize = synchronizer(xp)
    c = CONFIGS[args.config]
    n, C = c["batch_size"] * c["block_size"], c["n_embd"]
    rng = np.random.default_rng(0)

    def rows(width):
        return xp.asarray(rng.standard_normal((n, width), dtype=np.float32), dtype=np.float16)

    def microseconds(run, nbytes):
        seconds = median_time(lambda: ([run() for _ in range(REPEATS)], synchronize()), 5) / REPEATS
        return {"us": round(seconds * 1e6, 1), "gb_s": round(nbytes / seconds / 1e9)}

    x, g, add = rows(C), rows(C), rows(C)
    w, b = (xp.asarray(rng.standard_normal(C), dtype=np.float16) for _ in range(2))
    out, gx = xp.empty_like(x), xp.empty_like(x)
    mean, rstd = (xp.empty((n, 1), np.float32) for _ in range(2))  # the rows' statistics: float32
    sums = [xp.empty(C, np.float32) for _ in range(3)]
    ln = gpu_layer_norm._kernels(x, w, b, out, stats=(mean, rstd))
    assert gpu_layer_norm.forward(x, w, b, 1e-5, out, mean, rstd)  # its first-use check, and the statistics
    assert gpu_layer_norm.backward(g, x, w, mean, rstd, gx, sums[0], sums[1], add, sums[2])
    row = {"check": "columns", "config": args.config, "rows": n}
    row["layer_norm_forward"] = microseconds(
        lambda: gpu_layer_norm._forward(ln, x, w, b, out, mean, rstd, 1e-5), 2 * x.nbytes
    )
    for blocks in (256, 512, 1024, 2048):
        row[f"layer_norm_backward_{blocks}_blocks"] = microseconds(
            lambda blocks=blocks: gpu_layer_norm._backward(
                ln, xp, g, x, w, mean, rstd, gx, sums[0], sums[1], add, sums[2], max_blocks=blocks
            ),
            4 * x.nbytes,
        )
    h, xh, gh, bias = (
        rows(4 * C),
        rows(4 * C),
        rows(4 * C),
        xp.asarray(rng.standard_normal(4 * C), np.float16),
    )
    wide_sums = xp.empty(4 * C, np.float32)
    assert gpu_kernels.gelu_and_grad_sums_into(h, gh, xh, wide_sums, bias)
    gelu_sums = gpu_kernels._gelu_family_kernel(xh, "gelu_and_grad_sums", gpu_kernels._gelu_sums_probe)
    for blocks in (264, 396, 512, 1024):
        row[f"gelu_and_grad_sums_{blocks}_blocks"] = microseconds(
            lambda blocks=blocks: gpu_kernels._gelu_sums_launch(
                gelu_sums, xp, h, gh, xh, wide_sums, bias, blocks
            ),
            4 * xh.nbytes,
        )
    row["gelu_bias_rows"] = microseconds(lambda: gpu_kernels.gelu_bias_into(h, xh, bias), 2 * xh.nbytes)
    row["max_sum_blocks"] = kernels.MAX_SUM_BLOCKS
    emit(row)


REPEATS = 10  # GEMMs queued between two syncs: the launch and the sync's own time spread over them


def _gemm_variants(a, t, w, m: int, k: int) -> dict:
    """roofline's ways to multiply a's first k columns (or t's first m columns, transposed) by w's
    first k rows (name -> call): as CuPy's matmul; as the forward (added into a float16 output the
    LayerNorm kernel wrote the bias into); as the backward writes weight gradients (float32 out
    through gemm_into, against CuPy's float16 product cast after); with one more K row from a padded
    operand (a bias folded into the forward GEMM: an odd K) and one more M row (the backward's weight
    and bias gradients in one GEMM: an odd M)."""
    from mpifsdp.cuda.gemm import gemm_into

    xp = mpifsdp.base.backend.array_module_of(a)
    n = w.shape[1]
    out16, out, out_m = (
        xp.zeros((m, n), np.float16),
        xp.empty((m, n), np.float32),
        xp.empty((m + 1, n), np.float32),
    )
    return {
        "tflops": lambda: a[:, :k] @ w[:k],
        "float16_out_added_tflops": lambda: gemm_into(a[:, :k], w[:k], out16, accumulate=True),
        "float32_out_tflops": lambda: gemm_into(a[:, :k], w[:k], out),
        "float16_then_cast_tflops": lambda: (a[:, :k] @ w[:k]).astype(np.float32),
        "one_more_k_float32_out_tflops": lambda: gemm_into(a[:, : k + 1], w, out),
        "one_more_m_float32_out_tflops": lambda: gemm_into(t[:, : m + 1].T, w[:k], out_m),
    }


def _torch_gemm_tflops(device, dtype, M, K, N):
    try:
        import torch
    except ImportError:
        return None
    dev = "cuda" if device != "cpu" else "cpu"
    a = torch.randn(M, K, device=dev).to(getattr(torch, np.dtype(dtype).name))
    w = torch.randn(K, N, device=dev).to(a.dtype)

    def run():
        a @ w
        if dev == "cuda":
            torch.cuda.synchronize()

    return round(2 * M * K * N / median_time(run, 5) / 1e12, 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    names = ["preflight", "parity", "replay", "speed", "gemm", "attention", "roofline", "columns"]
    ap.add_argument("check", choices=names)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the check without a GPU")
    ap.add_argument("--sharded", action="store_true")
    ap.add_argument("--shard-size", type=int, default=None, help="parity: hybrid sharding's group size")
    ap.add_argument("--transport", choices=["nccl", "cuda-aware-mpi", "host"], default=None)
    ap.add_argument("--config", choices=CONFIGS, default="peer")
    ap.add_argument("--dtype", default="float32", choices=sorted(PEAK_TFLOPS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prefetch", type=int, default=1, help="units gathered ahead (0: no overlap)")
    ap.add_argument("--profile", action="store_true", help="speed: one more step, timed per primitive")
    ap.add_argument("--graph", action="store_true", help="speed: then the same steps from one CUDA graph")
    ap.add_argument("--kernels", action="store_true", help="speed: one step's GPU kernels by time (CUPTI)")
    ap.add_argument("--phantom", type=int, default=0, metavar="N", help="speed: rank 0 of N, alone")
    ap.add_argument("--recompute", choices=["no", "yes", "auto"], default="no",
                    help="speed: every block's forward run again (auto: only where the plan without it "
                    "would not fit the device, its pool at 1.15 times the plan)")  # fmt: skip
    args = ap.parse_args()
    if args.device != "cpu":  # every line names the GPU it was measured on
        cp = mpifsdp.array_module(args.device)
        _GPU.append(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode())
    checks = {"preflight": preflight, "parity": parity, "speed": speed, "gemm": gemm, "attention": attention}
    checks["replay"] = replay
    checks.update(roofline=roofline, columns=columns)
    checks[args.check](args)


if __name__ == "__main__":
    main()
