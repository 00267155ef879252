"""Single-process training step of the peer-config GPT vs plain GEMMs of the same shapes, and vs torch.

Prints one JSON line: step time, achieved GFLOP/s, the GFLOP/s of xp.matmul running exactly the
GEMMs a step performs, and their ratio (1.0 = zero framework overhead); where torch is installed (not
a dependency), the same model's single-process step in torch with the same threads
(bench/torch_fsdp2.py's GPT). The three take turns, one round each per --steps (interleaved_times):
ratios are medians of per-round ratios, with their range, so a machine whose speed drifts during
the run compares like with like. --profile adds one line per primitive: its forward and
backward seconds per step and share of the step, largest first, with the bytes of the arrays each
phase reads and writes (forward_mib, backward_mib: the least traffic it can have) and their rate
(gb_per_s); "outside" is everything else (optimizer, clipping, Python).
    python bench/bench_core.py [--config peer|small] [--set block_size=1024 ...] [--steps 5] [--profile]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import numpy as np
from common import (  # noqa: E402
    add_config_arguments,
    config_from,
    gemm_runner,
    gpt_config,
    interleaved_times,
    peak_rss_mib,
    random_batch,
    step_gemm_shapes,
    synchronizer,
    train_step,
)

from mpifsdp import AdamW  # noqa: E402
from mpifsdp.autodiff.tape import profile  # noqa: E402
from mpifsdp.base.backend import array_module  # noqa: E402
from mpifsdp.base.threads import elementwise_threads  # noqa: E402
from mpifsdp.models import GPT  # noqa: E402


def torch_step_runner(cfg: dict, device: str = "cpu"):
    """A function running the same model's single-process training step in torch on `device` (None
    where torch is not installed). float32 on a GPU stays IEEE float32 (torch's default: no TF32), as
    CuPy's."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch
    from torch_fsdp2 import GPT as TorchGPT

    torch.set_num_threads(elementwise_threads())  # ours: all cores, or OMP_NUM_THREADS where set
    torch.manual_seed(0)
    model = TorchGPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    x, y = (torch.from_numpy(a).to(device) for a in random_batch(cfg, cfg["batch_size"]))

    def step():
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if device != "cpu":
            torch.cuda.synchronize()

    return step


def print_profile(model, opt, x, y, steps: int, synchronize):
    """Per primitive: forward and backward seconds per step, and their share of the profiled steps'
    own time (this machine's speed drifts between the timed rounds and these steps)."""
    with profile() as costs:
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step(model, opt, x, y)
        synchronize()
        step_s = (time.perf_counter() - t0) / steps
    rows = sorted(costs.items(), key=lambda kv: -(kv[1]["forward_s"] + kv[1]["backward_s"]))
    inside = 0.0
    for name, c in rows:
        fwd, bwd = c["forward_s"] / steps, c["backward_s"] / steps
        inside += fwd + bwd
        line = {"primitive": name, "forward_s": round(fwd, 4), "backward_s": round(bwd, 4)}
        line |= {"share": round((fwd + bwd) / step_s, 3), "calls": c["forward_calls"] // steps}
        line["forward_mib"] = round(c["forward_bytes"] / steps / 2**20, 1)
        line["backward_mib"] = round(c["backward_bytes"] / steps / 2**20, 1)
        # the least memory traffic over the time: near the memory's bandwidth, a pass bound by it
        moved = (c["forward_bytes"] + c["backward_bytes"]) / steps
        line["gb_per_s"] = round(moved / max(fwd + bwd, 1e-9) / 1e9, 1)
        print(json.dumps(line))
    print(
        json.dumps(
            {
                "primitive": "outside",
                "step_s": round(step_s, 4),
                "seconds": round(step_s - inside, 4),
                "share": round(1 - inside / step_s, 3),
            }
        )
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    add_config_arguments(ap)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", action="store_true", help="also time every primitive")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch row even if torch is installed")
    args = ap.parse_args()
    cfg = config_from(args)
    xp = array_module(args.device)
    model = GPT(gpt_config(cfg), seed=0, device=args.device)
    opt = AdamW(model, lr=3e-4, weight_decay=0.1)  # torch's defaults otherwise, as the peer's
    x, y = (xp.asarray(a) for a in random_batch(cfg, cfg["batch_size"]))
    synchronize = synchronizer(xp)

    def step():
        train_step(model, opt, x, y)
        synchronize()

    for _ in range(2):  # the second step holds the optimizer state created at the end of the first
        step()
    rss = peak_rss_mib()  # the training step's: before the GEMM reference and torch allocate theirs
    shapes = step_gemm_shapes(cfg)
    runs = {"step": step, "gemm": gemm_runner(xp, shapes, np.float32)}
    torch_step = None if args.no_torch else torch_step_runner(cfg, args.device)
    if torch_step:
        runs["torch"] = torch_step
    times = interleaved_times(runs, args.steps)
    step_s, gemm_s = (statistics.median(times[k]) for k in ("step", "gemm"))
    per_round = {"step_vs_gemm": [g / s for g, s in zip(times["gemm"], times["step"])]}
    if torch_step:
        per_round["step_vs_torch"] = [s / t for s, t in zip(times["step"], times["torch"])]
    ratios = {k: round(statistics.median(v), 3) for k, v in per_round.items()}
    spread = {k: [round(min(v), 3), round(max(v), 3)] for k, v in per_round.items()}
    if args.profile:
        print_profile(model, opt, x, y, args.steps, synchronize)
    gemm_flops = sum(2 * b * m * k * n for b, m, k, n in shapes)
    tokens = cfg["batch_size"] * cfg["block_size"]
    model_flops = model.flops_per_token(cfg["block_size"]) * tokens
    torch_s = torch_step and statistics.median(times["torch"])
    print(
        json.dumps(
            {
                "bench": "core",
                "config": args.config,
                "set": args.set,
                "device": args.device,
                "threads": elementwise_threads(),
                "params": model.num_params(),
                "step_s": round(step_s, 4),
                "tokens_per_s": round(tokens / step_s, 1),
                "step_gflops": round(model_flops / step_s / 1e9, 2),
                "gemm_gflops": round(gemm_flops / gemm_s / 1e9, 2),
                "gemm_s": round(gemm_s, 4),
                "step_vs_gemm": ratios["step_vs_gemm"],
                "peak_rss_mib": round(rss, 1),
                "block_size": cfg["block_size"],
                "torch_step_s": torch_s and round(torch_s, 4),
                "step_vs_torch": ratios.get("step_vs_torch"),
                "ratio_range": spread,
                "rounds": args.steps,
            }
        )
    )


if __name__ == "__main__":
    main()
