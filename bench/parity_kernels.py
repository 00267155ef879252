"""The parity tests under several OpenBLAS kernels and world sizes: is the measured bound portable?

Machines differ in CPU and BLAS kernel, and a kernel change moves float32's last bits. OpenBLAS lets
one machine run the kernels of others (OPENBLAS_CORETYPE, set for the child processes alone), so
this runs tests/features/test_parity.py at N = 1..4 under each kernel and prints, per kernel, one JSON line
with the worst ratio of a sharded run's error to its bound (tests/tolerance.py; must stay <= 1).

    python bench/parity_kernels.py [--kernels Haswell SkylakeX ...] [--sizes 1 2 3 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LINE = re.compile(r"^PARITY N=(\d+) (\S+) (\S+) (\S+) ratio=([0-9.]+)", re.M)


def run(kernel: str, size: int) -> tuple[int, list]:
    env = {**os.environ, "OPENBLAS_CORETYPE": kernel, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    env.pop("OPENBLAS_L2_SIZE", None)
    pytest = [str(BIN / "python"), "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]
    pytest.append("tests/features/test_parity.py")
    if size > 1:
        pytest = [str(BIN / "mpiexec"), "-n", str(size), str(BIN / "python"), "-m", "mpi4py", *pytest[1:]]
    done = subprocess.run(pytest, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return done.returncode, [(*m[:4], float(m[4])) for m in LINE.findall(done.stdout)]


def runs_here(kernel: str) -> bool:
    """Whether this CPU can run `kernel` at all (SkylakeX needs AVX-512: elsewhere it crashes)."""
    probe = "import numpy as np; a = np.ones((64, 64), np.float32); assert (a @ a)[0, 0] == 64"
    env = {**os.environ, "OPENBLAS_CORETYPE": kernel}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kernels = ["Haswell", "SkylakeX", "Zen", "Sandybridge", "Prescott"]
    parser.add_argument("--kernels", nargs="+", default=kernels)
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 3, 4])
    args = parser.parse_args()
    for kernel in args.kernels:
        if not runs_here(kernel):
            print(json.dumps({"kernel": kernel, "runs_on_this_cpu": False}), flush=True)
            continue
        results, failed = [], []
        for size in args.sizes:
            rc, lines = run(kernel, size)
            results += lines
            if rc != 0 or not lines:
                failed.append(size)
        worst = max(results, key=lambda r: r[4], default=None)
        by_dtype = {
            d: max((r[4] for r in results if r[2] == d), default=None) for d in ("float32", "float64")
        }
        print(json.dumps({
            "kernel": kernel, "sizes": args.sizes, "tests": len(results), "failed_sizes": failed,
            "worst_ratio_to_bound": worst[4] if worst else None,
            "worst_case": " ".join(map(str, worst[:4])) if worst else None,
            "worst_by_dtype": by_dtype,
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
