"""Fine-tune a GPT that train_gpt.py trained, with low-rank adapters (LoRA), sharded. Reads top to bottom.

    mpiexec -n 2 python -m mpi4py examples/train_gpt.py --max_steps 500 --save_every 500
    mpiexec -n 4 python -m mpi4py examples/finetune_lora.py --base out/checkpoints --package email

The base checkpoint loads at any world size (by tensor name: the adapters change how parameters
divide into units). The base is frozen; each attention and MLP projection W gets a trainable
low-rank update, W + (alpha / rank) * A @ B with B = 0 at the start, so training starts exactly at
the base model. Only A and B are reduce-scattered and have AdamW state. At the end the adapters are
merged into the base weights and exported as one .safetensors file of the base model's layout, which
is loaded back into a plain GPT to check it. The last line is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

import mpifsdp
from mpifsdp import Param, checkpoint, ops, sharded_model
from mpifsdp.checkpoint import consolidated
from mpifsdp.data import TextData, rank_slice, stdlib_corpus_path
from mpifsdp.models import GPT, GPTConfig
from mpifsdp.nn.layers import Linear


class LoRALinear(Linear):
    """A Linear whose weight and bias are the base's (same names, so the base checkpoint loads into
    them) plus a low-rank update: x @ W + b + scale * (x @ A) @ B."""

    def __init__(self, base: Linear, rank: int, alpha: float, rng):
        self.weight, self.bias = base.weight, base.bias
        n_in, n_out = base.weight.shape
        dtype = base.weight.dtype
        self.lora_a = Param((rng.standard_normal((n_in, rank)) / math.sqrt(n_in)).astype(dtype))
        self.lora_b = Param(np.zeros((rank, n_out), dtype=dtype))
        self.scale = alpha / rank

    def forward(self, x, gelu_input: bool = False):
        low = ops.linear(ops.linear(x, self.lora_a, gelu_input=gelu_input), self.lora_b)
        return super().forward(x, gelu_input) + low * self.scale


PROJECTIONS = (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj"))


def add_adapters(model: GPT, rank: int, alpha: float, seed: int):
    """Freeze the base, then put a LoRALinear around every attention and MLP projection."""
    model.requires_grad_(False)
    rng = np.random.default_rng(seed)  # the same adapters on every rank
    for block in model.blocks:
        for part, name in PROJECTIONS:
            owner = getattr(block, part)
            setattr(owner, name, LoRALinear(getattr(owner, name), rank, alpha, rng))


def merge_adapters(model: GPT):
    """W += scale * A @ B in every projection, unit by unit (collective): each rank gathers one block's
    adapters and frozen base weights, merges, and keeps its own slice. The adapters stay as they are,
    so the model must not be run after this."""
    units = {u.name: u for u in sharded_model(model).units}
    for i, block in enumerate(model.blocks):
        adapters, base = units[f"blocks.{i}"], units[f"blocks.{i}:frozen"]
        with base.unsharded(writeback=True) as weights, adapters.unsharded() as low:
            for part, name in PROJECTIONS:
                prefix = f"blocks.{i}.{part}.{name}"
                scale = getattr(getattr(block, part), name).scale
                weights[f"{prefix}.weight"][...] += scale * (
                    low[f"{prefix}.lora_a"] @ low[f"{prefix}.lora_b"]
                )


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", default="out/checkpoints", help="a checkpoint, or a save_dir (its newest)")
    parser.add_argument("--package", default="email", help="the stdlib package whose sources to fine-tune on")
    parser.add_argument("--rank", type=int, default=8, help="adapter rank r")
    parser.add_argument(
        "--alpha", type=float, default=16.0, help="adapter scale alpha (the update is alpha/r)"
    )
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=16, help="global: split evenly over the ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval_batches", type=int, default=8)
    parser.add_argument("--log_every", type=int, default=50)
    parser.add_argument("--export", default="out/finetuned.safetensors")
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()
    least = dict(rank=1, max_steps=0, batch_size=1, eval_batches=1, log_every=1)
    wrong = [f"--{k} {getattr(args, k)} (must be >= {v})" for k, v in least.items() if getattr(args, k) < v]
    if wrong:
        parser.error("; ".join(wrong))
    try:  # before the fine-tune, not after it
        consolidated.require_export_path(args.export)
    except checkpoint.CheckpointError as exc:
        parser.error(f"--export: {exc}")
    return args


def main():
    args = parse_args()
    comm = mpifsdp.Comm()
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    newest = checkpoint.checkpoints(args.base)
    base_dir = newest[0] if newest else args.base
    saved = consolidated.saved_extra(base_dir).get("config")
    if not isinstance(saved, dict):  # a checkpoint save() wrote without the model's config
        raise SystemExit(
            f"finetune_lora: {base_dir} holds no model config (its extra has no 'config'): use a "
            "checkpoint train_gpt.py saved, or save yours with extra={'config': dataclasses.asdict(config)}"
        )
    config = GPTConfig(**{f.name: saved[f.name] for f in dataclasses.fields(GPTConfig) if f.name in saved})

    with mpifsdp.deferred_init():  # the base values come from the checkpoint, unit by unit
        model = GPT(config, seed=args.seed)
    add_adapters(model, args.rank, args.alpha, args.seed)
    mpifsdp.fully_shard(model, comm, units=model.blocks)
    not_loaded = consolidated.load_params(base_dir, model, allow_missing=lambda name: ".lora_" in name)
    plan = sharded_model(model).plan()
    say(
        f"base {base_dir}: {plan['params'] / 1e6:.2f} M parameters, {plan['trainable_params'] / 1e3:.1f} K "
        f"trainable in {len(not_loaded)} adapter tensors; {comm.size} rank(s)"
    )

    data = TextData(stdlib_corpus_path(args.package))
    data.check_fits(config.block_size)
    say(f"fine-tuning on the {args.package}/ package: {len(data.tokens) / 1e3:.0f} K byte tokens")

    def batch(split, index):
        x, y = data.global_batch(split, index, args.batch_size, config.block_size, seed=args.seed)
        return rank_slice(x, comm.rank, comm.size), rank_slice(y, comm.rank, comm.size)

    def evaluate(net) -> float:  # in evaluation mode: no dropout, so the loss depends on the parameters alone
        net.eval()
        with mpifsdp.no_grad():
            local = sum(net(*batch("val", i)).item() for i in range(args.eval_batches))
        net.train()
        return comm.all_reduce_scalar(local) / (comm.size * args.eval_batches)

    base_val = evaluate(model)  # B = 0: the base model's own loss on the new text
    say(f"base model: val loss {base_val:.4f} on {args.package}/")
    opt = mpifsdp.AdamW(model, lr=args.lr, weight_decay=0.0)  # steps the adapters only
    for step in range(args.max_steps):
        loss = model(*batch("train", step))
        loss.backward()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        if step % args.log_every == 0 or step == args.max_steps - 1:
            mean = comm.all_reduce_scalar(loss.item()) / comm.size
            say(f"step {step + 1:4d}/{args.max_steps} | loss {mean:.4f}")
    tuned_val = evaluate(model)
    say(f"fine-tuned: val loss {tuned_val:.4f} (base {base_val:.4f})")

    merge_adapters(model)
    Path(args.export).parent.mkdir(parents=True, exist_ok=True)
    path = consolidated.export_safetensors(args.export, model, include=lambda name: ".lora_" not in name)
    plain = GPT(config, seed=args.seed)  # the base model's layout, loaded from the export
    mpifsdp.fully_shard(plain, comm, units=plain.blocks)
    consolidated.load_safetensors(path, plain)
    exported_val = evaluate(plain)
    say(f"exported {path}: a plain GPT loaded from it has val loss {exported_val:.4f}")
    say(
        json.dumps(
            {
                "base_val_loss": round(base_val, 4),
                "finetuned_val_loss": round(tuned_val, 4),
                "exported_val_loss": round(exported_val, 4),
                "trainable_params": plan["trainable_params"],
                "params": plan["params"],
                "world_size": comm.size,
                "export": str(path),
            }
        )
    )


if __name__ == "__main__":
    main()
