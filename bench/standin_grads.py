"""The GPU path's gradients against the CPU's, on a CPU (run under bench/standin_run.py): a sharded
float64 GPT's flat gradient shards after one backward, and after three micro-batches accumulated
with no_sync (where the first backward writes into the zeroed gradients and the later ones add).
Prints one JSON line; exits 1 beyond the bound.

    python bench/standin_run.py bench/standin_grads.py
"""

from __future__ import annotations

import json
import sys

import numpy as np
from common import random_batch

import mpifsdp
from mpifsdp import sharded_model
from mpifsdp.base.backend import to_numpy
from mpifsdp.models import GPT, GPTConfig

CONFIG = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, block_size=16, batch_size=4)
BOUND = 1e-12  # float64, relative to the largest gradient: only summation order differs


def shards(device: str, micro_batches: int) -> list[np.ndarray]:
    """Every unit's gradient shard after `micro_batches` backwards (the last one reducing)."""
    comm = mpifsdp.Comm(device=device, transport="nccl" if device == "cuda" else None)
    keys = ("vocab_size", "n_embd", "n_layer", "n_head", "block_size")
    model = GPT(GPTConfig(**{k: CONFIG[k] for k in keys}), seed=0, dtype=np.float64, device=device)
    mpifsdp.fully_shard(model, comm, units=model.blocks)
    xp, sharded = mpifsdp.array_module(device), sharded_model(model)
    for step in range(micro_batches):
        x, y = random_batch(CONFIG, 4, seed=step)
        sharded.set_requires_gradient_sync(step == micro_batches - 1)
        model(xp.asarray(x), xp.asarray(y)).backward()
    return [to_numpy(unit.flat_grad()) for unit in sharded.trainable_units]


def main() -> int:
    result, ok = {"check": "standin_grads"}, True
    for micro_batches in (1, 3):
        cpu, gpu = shards("cpu", micro_batches), shards("cuda", micro_batches)
        scale = max(float(np.abs(c).max()) for c in cpu)
        err = max(float(np.abs(g - c).max()) for g, c in zip(gpu, cpu)) / scale
        result[f"micro_batches_{micro_batches}"] = {"max_rel_err": err, "bound": BOUND}
        ok &= err <= BOUND
    print(json.dumps({**result, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
