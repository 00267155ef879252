"""Shared pieces of the benchmarks: the peer config, timing, peak RSS, a figure's provenance. The one
import helper: every script runs as `python bench/<script>.py`, so Python puts bench/ first on sys.path and
`from common import ...` finds this file (no sys.path edits)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import subprocess
import time

import numpy as np

from mpifsdp.base.accounting import current_rss_bytes, peak_rss_bytes
from mpifsdp.models import GPTConfig

# The configuration every benchmark (ours and the peers') uses.
PEER = dict(vocab_size=4096, n_embd=512, n_layer=8, n_head=8, block_size=128, batch_size=8)
SMALL = dict(vocab_size=4096, n_embd=256, n_layer=4, n_head=8, block_size=128, batch_size=8)
CONFIGS = {"peer": PEER, "small": SMALL}


def add_config_arguments(ap):
    """--config NAME and --set KEY=VALUE ... (e.g. --set block_size=1024 batch_size=2 n_layer=16)."""
    ap.add_argument("--config", choices=CONFIGS, default="peer")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override config entries")


def config_from(args) -> dict:
    cfg = dict(CONFIGS[args.config])
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in cfg or not value.isdigit():
            raise SystemExit(f"--set {item}: give KEY=INTEGER with KEY one of {sorted(cfg)}")
        cfg[key] = int(value)
    return cfg


def config_arguments(args) -> list[str]:
    """The same configuration, as arguments for another benchmark process."""
    return ["--config", args.config, *(["--set", *args.set] if args.set else [])]


def gpt_config(cfg: dict) -> GPTConfig:
    return GPTConfig(
        vocab_size=cfg["vocab_size"],
        block_size=cfg["block_size"],
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        n_embd=cfg["n_embd"],
        tie_weights=False,
    )


def synchronizer(xp):
    """A function that waits for the device's queued work (a no-op on the CPU): GPU kernels run
    asynchronously, so a timer stopped without it measures only their launches."""
    if xp is np:
        return lambda: None
    return xp.cuda.Device().synchronize


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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


def gemm_runner(xp, shapes, dtype):
    """A function running every GEMM of `shapes`, on operands made once per distinct shape (random
    values: a GPU multiplies zeros faster)."""
    rng = np.random.default_rng(0)
    operands = {}
    for shape in dict.fromkeys(shapes):
        b, m, k, n = shape
        a = xp.asarray(rng.standard_normal((b, m, k), dtype=np.float32), dtype=dtype)
        w = xp.asarray(rng.standard_normal((b, k, n), dtype=np.float32), dtype=dtype)
        operands[shape] = (a, w, xp.empty((b, m, n), dtype=dtype))
    pairs = [operands[shape][:2] for shape in shapes]
    outs = [operands[shape][2] for shape in shapes]
    synchronize = synchronizer(xp)

    def run():
        for (a, b), out in zip(pairs, outs):
            xp.matmul(a, b, out=out)
        synchronize()

    return run


def turn_order(names: list, round_index: int) -> list:
    """`names` rotated by the round: each takes every place in turn, so none always runs first."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def interleaved_times(runs: dict, rounds: int) -> dict:
    """Seconds of each function per round, the functions taking turns (the first rotating each
    round) after one warm-up each: on a machine whose speed drifts from minute to minute, each round
    compares them under the same conditions, so ratios are taken per round."""
    names = list(runs)
    for run in runs.values():
        run()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in turn_order(names, r):
            time.sleep(0.05)  # BLAS and OpenMP threads of the previous run stop spinning
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def peak_rss_mib() -> float:
    return peak_rss_bytes() / 2**20


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


def current_rss_mib() -> float:
    return current_rss_bytes() / 2**20


def blas_kernel() -> str:
    from threadpoolctl import threadpool_info

    info = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    return f"{info[0].get('internal_api')}/{info[0].get('architecture')}" if info else "unknown"


def run_json(cmd, threads: int) -> dict:
    """Run a measurement with `threads` BLAS threads per process; print and return its last JSON line."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
    result = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    line = result.stdout.strip().splitlines()[-1]
    print(line, flush=True)
    return json.loads(line)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def provenance() -> dict:
    """What a measured figure stands on, for every JSON line a device check prints: the commit and
    whether the tree differed from it (None where there is no git: the lent device gets a copy
    without .git, so MPIFSDP_COMMIT=<sha> given to make gpu-check says it), the digest of the source
    that ran (mpifsdp/ and bench/: it names the code where the commit cannot), and the libraries'
    versions. Figures kept without these could not be tied to the code they measured (issue 50)."""
    import mpi4py
    import mpi4py.MPI

    from mpifsdp.comm.launcher import library

    def git(*args):
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    ours = git("rev-parse", "--show-toplevel") == os.path.realpath(ROOT)  # not a repository above a copy
    commit = git("rev-parse", "HEAD") if ours else None
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    digest = hashlib.blake2b(digest_size=8)
    for folder in ("mpifsdp", "bench"):
        for here, dirs, files in sorted(os.walk(os.path.join(ROOT, folder))):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith((".py", ".cu", ".sh"))):
                path = os.path.join(here, name)
                digest.update(os.path.relpath(path, ROOT).encode())
                with open(path, "rb") as file:
                    digest.update(file.read())
    return {
        "commit": commit or os.environ.get("MPIFSDP_COMMIT"),
        "dirty": None if status is None else bool(status),
        "source": digest.hexdigest(),
        "numpy": np.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi": library(mpi4py.MPI),
    }
