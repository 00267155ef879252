"""The GPU path against the CPU's, on a CPU (run under bench/standin_run.py), sharded, float64:
- the flat gradient shards after one backward, and after three micro-batches accumulated with
  no_sync (the first backward writes into the zeroed gradients, the later ones must add);
- the parameters after three steps through a LossScaler with clipping (on a GPU the unscale and the
  clip are folded into AdamW's kernel; on the CPU they are passes of their own);
- a host (NumPy) batch against the same batch on the device: the same gradients, bit for bit (host
  token ids and targets are checked on the host and copied once);
- float16 gathers whose backward sends the cast its forward kept against ones that cast again: the
  same parameters after 3 steps, bit for bit;
- a master beyond float16 named at the step through the NaN/Inf flag kernel, and the next step,
  the master back in range, not (the flag keeps its old token: it is never zeroed).
Prints one JSON line; exits 1 beyond the bound.

    python bench/standin_run.py bench/standin_checks.py
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


def _sharded_gpt(device: str):
    comm = mpifsdp.Comm(device=device, transport="nccl" if device == "cuda" else None)
    keys = ("vocab_size", "n_embd", "n_layer", "n_head", "block_size")
    model = GPT(GPTConfig(**{k: CONFIG[k] for k in keys}), seed=0, dtype=np.float64, device=device)
    mpifsdp.fully_shard(model, comm, units=model.blocks)
    return model, mpifsdp.array_module(device), sharded_model(model)


def shards(device: str, micro_batches: int, host_batch: bool = False) -> list[np.ndarray]:
    """Every unit's gradient shard after `micro_batches` backwards (the last one reducing)."""
    model, xp, sharded = _sharded_gpt(device)
    place = np.asarray if host_batch else xp.asarray
    for step in range(micro_batches):
        x, y = random_batch(CONFIG, 4, seed=step)
        sharded.set_requires_gradient_sync(step == micro_batches - 1)
        model(place(x), place(y)).backward()
    return [to_numpy(unit.flat_grad()) for unit in sharded.trainable_units]


def scaled_steps(device: str) -> list[np.ndarray]:
    """Every unit's parameter shard after 3 AdamW steps through a LossScaler that clips (max_norm
    below the gradients' norm, so every step clips)."""
    model, xp, sharded = _sharded_gpt(device)
    opt, scaler = mpifsdp.AdamW(model, lr=1e-2, weight_decay=0.1), mpifsdp.LossScaler(init_scale=2.0**10)
    for step in range(3):
        x, y = random_batch(CONFIG, 4, seed=step)
        scaler.scale(model(xp.asarray(x), xp.asarray(y))).backward()
        assert scaler.step(opt, max_norm=0.05)
        opt.zero_grad()
    return [to_numpy(unit.shard) for unit in sharded.trainable_units]


def float16_steps(keep_casts: bool) -> list[np.ndarray]:
    """Every unit's master shard after 3 AdamW steps of a float16-gathering GPT on the device, its
    backward gathers sending the forward's kept casts (keep_casts) or casting again."""
    from mpifsdp.fsdp import lifecycle
    from mpifsdp.fsdp import model as fsdp_model

    comm = mpifsdp.Comm(device="cuda", transport="nccl")
    keys = ("vocab_size", "n_embd", "n_layer", "n_head", "block_size")
    model = GPT(GPTConfig(**{k: CONFIG[k] for k in keys}), seed=0, device="cuda")
    mpifsdp.fully_shard(model, comm, units=model.blocks, param_dtype=np.float16, reduce_dtype=np.float32)
    opt, xp = mpifsdp.AdamW(model, lr=1e-2), mpifsdp.array_module("cuda")
    never = lambda phase, reshard: (False, False)  # noqa: E731
    kept = lifecycle.casts_kept
    lifecycle.casts_kept = fsdp_model.casts_kept = kept if keep_casts else never
    try:
        for step in range(3):
            x, y = random_batch(CONFIG, 4, seed=step)
            model(xp.asarray(x), xp.asarray(y)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        lifecycle.casts_kept = fsdp_model.casts_kept = kept
    return [to_numpy(unit.shard) for unit in sharded_model(model).trainable_units]


def overflow_named_once() -> bool:
    """Step 1 with a master of 1e5 (beyond float16) raises naming its unit; step 2, the master back
    at 1, does not."""
    from mpifsdp import Unit

    comm = mpifsdp.Comm(device="cuda", transport="nccl")
    xp = mpifsdp.array_module("cuda")
    unit = Unit("big", {"w": xp.ones(6, dtype=np.float32)}, comm, param_dtype=np.float16)
    opt = mpifsdp.AdamW([unit], lr=1e-3)
    outcomes = []
    for master in (1e5, 1.0):
        unit.shard[:2] = master
        with unit.unsharded():
            pass
        unit.reduce_grad({"w": xp.ones(6, dtype=np.float32)})
        try:
            opt.step()
            outcomes.append("stepped")
        except FloatingPointError as exc:
            outcomes.append("named" if "unit 'big'" in str(exc) else str(exc))
        opt.zero_grad()
    return outcomes == ["named", "stepped"]


def _relative_error(gpu, cpu) -> float:
    return max(float(np.abs(g - c).max()) for g, c in zip(gpu, cpu)) / max(
        float(np.abs(c).max()) for c in cpu
    )


def main() -> int:
    result = {"check": "standin_checks"}
    for micro_batches in (1, 3):
        err = _relative_error(shards("cuda", micro_batches), shards("cpu", micro_batches))
        result[f"grads_after_{micro_batches}_backwards"] = {"max_rel_err": err, "bound": BOUND}
    err = _relative_error(shards("cuda", 1, host_batch=True), shards("cuda", 1))
    result["host_batch_against_device_batch"] = {"max_rel_err": err, "bound": 0.0}
    err = _relative_error(float16_steps(keep_casts=True), float16_steps(keep_casts=False))
    result["float16_kept_casts_against_fresh_casts"] = {"max_rel_err": err, "bound": 0.0}
    err = _relative_error(scaled_steps("cuda"), scaled_steps("cpu"))
    result["params_after_3_scaled_clipped_steps"] = {"max_rel_err": err, "bound": BOUND}
    result["overflow_named_then_cleared"] = overflow_named_once()
    ok = all(r["max_rel_err"] <= r["bound"] for r in result.values() if isinstance(r, dict))
    ok = ok and result["overflow_named_then_cleared"]
    print(json.dumps({**result, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
