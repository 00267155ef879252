"""The peer model written in torch.nn under PyTorch FSDP2 (fully_shard per block + root), gloo on CPU.

The yardstick for bench_fsdp.py, launched by it under mpiexec (rank and size come from the launcher's
PMI environment). torch is NOT a dependency of mpifsdp: this file runs only where torch is installed.
    mpiexec -n 2 python bench/torch_fsdp2.py --config peer --port 29512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from common import add_config_arguments, config_from, peak_rss_mib, random_batch  # noqa: E402
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg["n_embd"]
        self.wte, self.wpe = nn.Embedding(cfg["vocab_size"], C), nn.Embedding(cfg["block_size"], C)
        self.blocks = nn.ModuleList(Block(C, cfg["n_head"]) for _ in range(cfg["n_layer"]))
        self.ln_f, self.lm_head = nn.LayerNorm(C), nn.Linear(C, cfg["vocab_size"], bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    add_config_arguments(ap)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--port", type=int, default=29512)
    args = ap.parse_args()
    rank, world = int(os.environ.get("PMI_RANK", 0)), int(os.environ.get("PMI_SIZE", 1))
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    cfg = config_from(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    x, y = (
        torch.from_numpy(a[rank * cfg["batch_size"] : (rank + 1) * cfg["batch_size"]])
        for a in random_batch(cfg, cfg["batch_size"] * world)
    )
    times = []
    for i in range(args.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i:
            times.append(float(dt))
    rss = torch.tensor([peak_rss_mib()])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        step_s = statistics.median(times)
        tokens = cfg["batch_size"] * world * cfg["block_size"]
        print(json.dumps({
            "impl": "torch-fsdp2", "config": args.config, "world_size": world,
            "global_batch": cfg["batch_size"] * world, "threads_per_rank": threads,
            "step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s, 1),
            "peak_rss_mib_per_rank": round(float(rss), 1),
        }), flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
