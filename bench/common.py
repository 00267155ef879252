"""Shared pieces of the benchmarks: the peer config, timing, peak RSS."""

from __future__ import annotations

import resource
import statistics
import time

import numpy as np

from mpifsdp.models import GPTConfig

# The configuration every benchmark (ours and the peers') uses.
PEER = dict(vocab_size=4096, n_embd=512, n_layer=8, n_head=8, block_size=128, batch_size=8)
SMALL = dict(vocab_size=4096, n_embd=256, n_layer=4, n_head=8, block_size=128, batch_size=8)
CONFIGS = {"peer": PEER, "small": SMALL}


def gpt_config(cfg: dict) -> GPTConfig:
    return GPTConfig(
        vocab_size=cfg["vocab_size"],
        block_size=cfg["block_size"],
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        n_embd=cfg["n_embd"],
        tie_weights=False,
    )


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def random_batch(cfg: dict, batch_size: int, seed: int = 0):
    """Random tokens from a fixed seed: (x, y) of shape (batch_size, block_size)."""
    rng = np.random.default_rng(seed)
    shape = (batch_size, cfg["block_size"])
    return rng.integers(0, cfg["vocab_size"], shape), rng.integers(0, cfg["vocab_size"], shape)


def train_step(model, opt, x, y):
    loss = model(x, y)
    loss.backward()
    opt.clip_grad_norm(1.0)
    opt.step()
    opt.zero_grad()
    return loss
