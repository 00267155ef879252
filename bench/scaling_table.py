"""docs/scaling.md's tables: the planner's predictions for GPT-2 1.5B, a 7B and a 70B decoder on
nodes of 8 GPUs with 80 GB each, FSDP vs HSDP (groups of one node), 8 to 1,024 GPUs. Prints markdown.
    python bench/scaling_table.py
    python bench/scaling_table.py --calibrated [--calibrate GPU_CHECK_LOG] [--json]
--calibrated: the second table, the compute rate a device measured (planning/calibration.py: the
H200's, or the last speed line of a make gpu-check log, of --calibrate-config gpu13b for the 13B
rank 0's), NCCL's published link figures, GPT-2 1.5B,
the 13B and the 70B at 8, 64 and 512 GPUs, FSDP and HSDP, step time, tokens/s and MFU in both
conventions, the comm-bound cases marked; --json: one JSON line a row instead.
Assumptions (stated in the output): bfloat16 gathers and gradients, fp32 shards and AdamW state
(16 B per shard element), one sequence per GPU with full activation checkpointing, links of 150 GB/s
and 5 us inside a node and 25 GB/s and 20 us between nodes per GPU, 400 TFLOP/s achieved per GPU.
"""

from __future__ import annotations

import argparse
import json

from mpifsdp.models import GPTConfig, gpt_units
from mpifsdp.planning.calibration import H200_370M, LINKS, Calibration, attention_flops, mfu
from mpifsdp.planning.planner import Link, flops_per_step, gpt_activation_bytes, plan

MODELS = {
    "GPT-2 1.5B (T=1024)": GPTConfig(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "7B (T=4096)": GPTConfig(
        vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096, tie_weights=False
    ),
    "70B (T=8192)": GPTConfig(
        vocab_size=128256, block_size=8192, n_layer=80, n_head=64, n_embd=8192, tie_weights=False
    ),
}
GPUS = (8, 64, 512, 1024)
NODE, MEMORY, FLOPS = 8, 80e9, 400e12
INTRA, INTER = Link(5e-6, 150e9), Link(20e-6, 25e9)


def predict(config, world, shard_size, flops=FLOPS, intra=INTRA, inter=INTER, *, batch=1, recompute=True,
            **more):  # fmt: skip
    """plan() for `batch` sequences a GPU, bfloat16 gathers, fp32 states; `more`: plan's other
    keywords (gpu, overlap)."""
    units, model = gpt_units(config)
    tokens = batch * config.block_size
    return plan(
        units, world, shard_size=shard_size, ranks_per_node=NODE, itemsize=4, compute_itemsize=2,
        flops=flops, flops_per_step=flops_per_step(model, config.block_size, tokens, recompute),
        activation_bytes=gpt_activation_bytes(config, batch, 2, recompute, device="cuda"),
        intra=intra, inter=inter, **more,
    )  # fmt: skip


def row(name, config, world, label, shard, **links):
    r = predict(config, world, shard, **links)
    mem, t, b = r["memory_bytes"], r["time_s"], r["traffic"]["bytes"]
    crosses = (shard or world) > NODE  # the group's gathers run between nodes
    inside = sum(b["in_group"].values()) * (not crosses)
    between = sum(b["in_group"].values()) * crosses + sum(b["across_groups"].values())
    fits = "yes" if mem["total"] <= MEMORY else "**no**"
    return (
        f"| {name} | {world} | {label} | {mem['total'] / 1e9:.1f} | {fits} | {inside / 1e9:.1f} | "
        f"{between / 1e9:.1f} | {t['step']:.2f} | {t['exposed_comm'] / t['step']:.0%} | "
        f"{config.block_size / t['step']:,.0f} |"
    )


CALIBRATED_MODELS = {  # name: (config, sequences per GPU: one, and the measured run's 8,192 tokens)
    "GPT-2 1.5B (T=1024)": (MODELS["GPT-2 1.5B (T=1024)"], (1, 8)),
    "13B (T=2048)": (
        GPTConfig(vocab_size=32768, block_size=2048, n_layer=40, n_head=40, n_embd=5120),
        (1, 4),
    ),
    "70B (T=8192)": (MODELS["70B (T=8192)"], (1,)),
}
H200_MEMORY = 141e9
COMM_BOUND = 0.5  # exposed communication above half the step: the links, not the GPU, set the pace


def calibrated(name, config, world, shard, calibration, batch) -> dict:
    """One prediction with a device's measured rate and overlap and NCCL's link figures: per GPU
    memory, step, exposed share, tokens/s and MFU in both conventions. Blocks are recomputed only
    where the activations would not fit an H200 beside the rest (recomputing costs a forward)."""
    _, model = gpt_units(config)
    tokens = batch * config.block_size

    def predicted(recompute):
        return predict(
            config, world, shard, calibration.flops, LINKS["nvlink-h100"], LINKS["ib-400g"], batch=batch,
            recompute=recompute, gpu=True, overlap=calibration.overlap,
        )  # fmt: skip

    recompute = predicted(False)["memory_bytes"]["total"] > 0.9 * H200_MEMORY
    r = predicted(recompute)
    t = r["time_s"]
    attention = attention_flops(config, tokens)
    util = mfu(flops_per_step(model, config.block_size, tokens), attention, t["step"], calibration.peak)
    return {
        "bench": "scaling",
        "model": name,
        "gpus": world,
        "sharding": "FSDP" if shard is None else f"HSDP {shard}",
        "batch_per_gpu": batch,
        "recompute": recompute,
        "memory_gb": round(r["memory_bytes"]["total"] / 1e9, 1),
        "fits_h200": r["memory_bytes"]["total"] <= H200_MEMORY,
        "step_s": round(t["step"], 3),
        "exposed_comm_share": round(t["exposed_comm"] / t["step"], 3),
        "comm_bound": t["exposed_comm"] > COMM_BOUND * t["step"],
        "tokens_per_s_per_gpu": round(tokens / t["step"], 1),
        "mfu": round(util["palm"], 3),
        "mfu_causal": round(util["causal"], 3),
        "calibration": calibration.source,
    }


def calibrated_table(calibration, as_json: bool):
    rows = [
        calibrated(name, config, world, shard, calibration, batch)
        for name, (config, batches) in CALIBRATED_MODELS.items()
        for batch in batches
        for world in (8, 64, 512)
        for shard in (None, NODE)
        if shard is None or world > shard
    ]
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    print(
        "| model | GPUs | sharding | batch | recompute | memory/GPU GB | step s | exposed comm "
        "| tokens/s/GPU | MFU | MFU causal |"
    )
    print("| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        bound = " **comm-bound**" if r["comm_bound"] else ""
        print(
            f"| {r['model']} | {r['gpus']} | {r['sharding']} | {r['batch_per_gpu']} | "
            f"{'yes' if r['recompute'] else 'no'} | {r['memory_gb']}"
            f"{'' if r['fits_h200'] else ' **does not fit**'} | "
            f"{r['step_s']:.2f} | "
            f"{r['exposed_comm_share']:.0%}{bound} | {r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | "
            f"{r['mfu_causal']:.1%} |"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calibrated", action="store_true", help="the table calibrated by a device's figures")
    ap.add_argument("--calibrate", help="make gpu-check's log: its last speed line's rate")
    ap.add_argument(
        "--calibrate-config", default=None, help="--calibrate: the last speed line of this config"
    )
    ap.add_argument("--json", action="store_true", help="--calibrated: one JSON line a row")
    args = ap.parse_args()
    if args.calibrated:
        calibration = H200_370M
        if args.calibrate:
            with open(args.calibrate) as log:
                calibration = Calibration.from_lines(log, config=args.calibrate_config)
        calibrated_table(calibration, args.json)
        return
    print(
        "| model | GPUs | sharding | memory/GPU GB | fits 80 GB | GB/step inside nodes "
        "| GB/step between nodes | step s | comm share | tokens/s/GPU |"
    )
    print("| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, config in MODELS.items():
        for world in GPUS:
            print(row(name, config, world, "FSDP", None))
            for group in (NODE, 64):
                if world > group:
                    print(row(name, config, world, f"HSDP {group}", group))
    # torchtitan's published row: Llama 3 70B, FSDP2, 64 A100 80GB, batch 1, full activation
    # checkpointing, 331 tokens/s/GPU at 51.7 % MFU. Its hardware rate, recompute included, is
    # 0.517 * 4/3 of 312 TFLOP/s; A100 links: 300 GB/s NVLink, 25 GB/s (200 Gb/s) between nodes.
    a100 = dict(flops=312e12 * 0.517 * 4 / 3, intra=Link(5e-6, 300e9), inter=Link(20e-6, 25e9))
    print(row("70B vs torchtitan (A100)", MODELS["70B (T=8192)"], 64, "FSDP", None, **a100))


if __name__ == "__main__":
    main()
