"""Single-process training step of the peer-config GPT vs plain GEMMs of the same shapes.

Prints one JSON line: step time, achieved GFLOP/s, the GFLOP/s of xp.matmul running exactly the
GEMMs a step performs (measured in the same run), and their ratio (1.0 = zero framework overhead).
    python bench/bench_core.py [--config peer|small] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import CONFIGS, gpt_config, median_time, peak_rss_mib, random_batch, train_step  # noqa: E402

from mpifsdp.backend import array_module  # noqa: E402
from mpifsdp.models import GPT  # noqa: E402
from mpifsdp.optim import AdamW  # noqa: E402


def step_gemm_shapes(cfg: dict) -> list[tuple[int, int, int, int]]:
    """(batch, M, K, N) of every matmul in one forward + backward of the GPT."""
    B, T, C, L, V, H = (
        cfg[k] for k in ("batch_size", "block_size", "n_embd", "n_layer", "vocab_size", "n_head")
    )
    M, hs = B * T, C // H
    linears = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)] * L + [(C, V)]
    shapes = []
    for K, N in linears:  # forward, grad input, grad weight
        shapes += [(1, M, K, N), (1, M, N, K), (1, K, M, N)]
    for _ in range(L):  # attention: q k^T and att v forward; four GEMMs backward
        shapes += [(B * H, T, hs, T), (B * H, T, T, hs)] + [(B * H, T, T, hs), (B * H, T, hs, T)] * 2
    return shapes


def gemm_seconds(xp, shapes, dtype, repeats):
    rng = np.random.default_rng(0)
    pairs = [
        (
            xp.asarray(rng.standard_normal((b, m, k)), dtype=dtype),
            xp.asarray(rng.standard_normal((b, k, n)), dtype=dtype),
        )
        for b, m, k, n in shapes
    ]
    outs = [xp.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=dtype) for a, b in pairs]

    def run():
        for (a, b), out in zip(pairs, outs):
            xp.matmul(a, b, out=out)

    return median_time(run, repeats)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", choices=CONFIGS, default="peer")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    cfg = CONFIGS[args.config]
    xp = array_module(args.device)
    model = GPT(gpt_config(cfg), seed=0, device=args.device)
    opt = AdamW(model, lr=3e-4, weight_decay=0.1)  # torch's defaults otherwise, as the peer's
    x, y = (xp.asarray(a) for a in random_batch(cfg, cfg["batch_size"]))
    step_s = median_time(lambda: train_step(model, opt, x, y), args.steps)
    rss = peak_rss_mib()  # before the GEMM reference allocates its own arrays
    shapes = step_gemm_shapes(cfg)
    gemm_s = gemm_seconds(xp, shapes, np.float32, args.steps)
    gemm_flops = sum(2 * b * m * k * n for b, m, k, n in shapes)
    tokens = cfg["batch_size"] * cfg["block_size"]
    model_flops = model.flops_per_token(cfg["block_size"]) * tokens
    print(
        json.dumps(
            {
                "bench": "core",
                "config": args.config,
                "device": args.device,
                "params": model.num_params(),
                "step_s": round(step_s, 4),
                "tokens_per_s": round(tokens / step_s, 1),
                "step_gflops": round(model_flops / step_s / 1e9, 2),
                "gemm_gflops": round(gemm_flops / gemm_s / 1e9, 2),
                "gemm_s": round(gemm_s, 4),
                "step_vs_gemm": round(gemm_s / step_s, 3),
                "peak_rss_mib": round(rss, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
