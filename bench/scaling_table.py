"""docs/scaling.md's tables: the planner's predictions for GPT-2 1.5B, a 7B and a 70B decoder on
nodes of 8 GPUs with 80 GB each, FSDP vs HSDP (groups of one node), 8 to 1,024 GPUs. Prints markdown.
    python bench/scaling_table.py
Assumptions (stated in the output): bfloat16 gathers and gradients, fp32 shards and AdamW state
(16 B per shard element), one sequence per GPU with full activation checkpointing, links of 150 GB/s
and 5 us inside a node and 25 GB/s and 20 us between nodes per GPU, 400 TFLOP/s achieved per GPU.
"""

from __future__ import annotations

from mpifsdp.models import GPTConfig, gpt_units
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


def predict(config, world, shard_size, flops=FLOPS, intra=INTRA, inter=INTER):
    units, model = gpt_units(config)
    tokens = config.block_size  # one sequence per GPU
    return plan(
        units, world, shard_size=shard_size, ranks_per_node=NODE, itemsize=4, compute_itemsize=2,
        flops=flops, flops_per_step=flops_per_step(model, config.block_size, tokens, recompute=True),
        activation_bytes=gpt_activation_bytes(config, 1, 2, recompute=True, device="cuda"),
        intra=intra, inter=inter,
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


def main():
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
