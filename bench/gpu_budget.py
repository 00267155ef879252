"""The GPU step's budget, counted on a CPU: kernel launches and host syncs of one fp16 FSDP training
step (NCCL transport, LossScaler, 1 rank) of a narrow 24-layer GPT with the 370M model's structure
(the same heads x T / C and vocab / C; counts depend on structure, not width), with CuPy replaced
by tools/gpusim/cupy_standin.py. One JSON line:

    python bench/gpu_budget.py [--host-profile 20]
    {"launches_per_step": ..., "launches_per_layer": ..., "host_syncs_per_step": ...,
     "host_syncs_in_step": ..., "syncs": {phase: {kind: n}}, "launches_by_phase": {...},
     "device_batch_syncs_in_passes": ...}

host_syncs_in_step: inside forward, backward and the optimizer step (the issue 30 budget: 0);
host_syncs_per_step adds reading the loss for logging (budget: 2 in all). host_ms_per_step: the
step's Python on the host (its wall time less the stand-in's NumPy work, which a GPU would do), on
this machine: what the host needs to issue one step, whatever the GPU's speed; CuPy's own cost per
call (a few microseconds, a device's figure) comes on top. device_batch_syncs_in_passes: forward
and backward's host syncs when the batch is already on the device (its checks run there; budget 0).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import gpusim  # noqa: E402  (tools/gpusim: make install puts it in the venv)
from gpusim import cupy_standin  # noqa: E402

cp = gpusim.install()
sys.path.insert(0, str(Path(__file__).parent))  # bench/host_profile.py, when imported from elsewhere
import host_profile  # noqa: E402
import numpy as np  # noqa: E402

import mpifsdp  # noqa: E402
from mpifsdp.models import GPT, GPTConfig  # noqa: E402

LAYERS = 24
HOST_STEPS = 5  # steps timed for the host's share (median)
PROFILED_STEPS = 20  # steps sampled by --host-profile


def step(model, opt, scaler, x, y) -> float:
    phase = cupy_standin.PHASE
    phase[0] = "forward"
    loss = model(x, y)
    phase[0] = "backward"
    scaler.scale(loss).backward()
    phase[0] = "optimizer"
    scaler.step(opt, max_norm=1.0)
    opt.zero_grad()
    phase[0] = "logging"
    return loss.item()


def steady_step(**scaler_settings):
    """(model, opt, scaler, x, y) of the budget's step, two steps in: the first builds and checks
    kernels, and its loss scale overflows (skipped), so the second allocates AdamW's moments."""
    comm = mpifsdp.Comm(device="cuda", transport="nccl", threads=None)
    config = GPTConfig(vocab_size=2048, block_size=64, n_layer=LAYERS, n_head=16, n_embd=64)
    model = GPT(config, seed=0, device=comm.device)
    mpifsdp.fully_shard(model, comm, units=model.blocks, param_dtype=np.float16, reduce_dtype=np.float32)
    opt, scaler = mpifsdp.AdamW(model, lr=1e-4), mpifsdp.LossScaler(**scaler_settings)
    rng = np.random.default_rng(0)
    # the batch as a data loader gives it, on the host: its checks read nothing back from the device
    x, y = (rng.integers(0, config.vocab_size, (2, 64)) for _ in range(2))
    for _ in range(2):
        step(model, opt, scaler, x, y)
    return model, opt, scaler, x, y


def _syncs_in_passes_with_a_device_batch(model, opt, scaler, x, y) -> int:
    """Host syncs in forward and backward of one step whose batch is already on the device: its ids
    and targets are checked there, the verdict read with the step's (base/deferred.py)."""
    import cupy

    cupy_standin.SYNCS.clear()
    step(model, opt, scaler, cupy.asarray(x), cupy.asarray(y))
    return sum(n for (phase, _), n in cupy_standin.SYNCS.items() if phase in ("forward", "backward"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="add the N functions the host spends most of its time in (bench/host_profile.py)",
    )
    args = ap.parse_args()  # fmt: skip
    model, opt, scaler, x, y = steady_step()
    host_s = []
    for _ in range(HOST_STEPS):  # the last one's launches and syncs are counted
        cupy_standin.LAUNCHES.clear()
        cupy_standin.SYNCS.clear()
        cupy_standin.DEVICE_S[0] = 0.0
        start = time.perf_counter()
        step(model, opt, scaler, x, y)
        host_s.append(time.perf_counter() - start - cupy_standin.DEVICE_S[0])
    launches = sum(cupy_standin.LAUNCHES.values())
    syncs: dict = collections.defaultdict(dict)
    for (phase, kind), n in sorted(cupy_standin.SYNCS.items()):
        syncs[phase][kind] = n
    by_phase = collections.Counter()
    for (phase, _), n in cupy_standin.LAUNCHES.items():
        by_phase[phase] += n
    in_step = sum(n for (phase, _), n in cupy_standin.SYNCS.items() if phase != "logging")
    device_batch = _syncs_in_passes_with_a_device_batch(model, opt, scaler, x, y)
    profile = {}
    if args.host_profile:  # after the counted and timed steps: the sampler's thread slows the host
        run = lambda: [step(model, opt, scaler, x, y) for _ in range(PROFILED_STEPS)]  # noqa: E731
        profile = {"host_profile": host_profile.sampled(run, args.host_profile)}
    print(json.dumps({
        "bench": "gpu_budget", "layers": LAYERS, "launches_per_step": launches,
        "launches_per_layer": round(launches / LAYERS, 1),
        "host_syncs_per_step": sum(cupy_standin.SYNCS.values()), "host_syncs_in_step": in_step,
        "syncs": syncs, "launches_by_phase": dict(by_phase),
        "device_batch_syncs_in_passes": device_batch,
        "host_ms_per_step": round(1000 * statistics.median(host_s), 1), **profile,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
