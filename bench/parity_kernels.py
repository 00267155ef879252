"""The parity tests under several OpenBLAS kernels and world sizes: is the measured bound portable?

Machines differ in CPU and BLAS kernel, and a kernel change moves float32's last bits. OpenBLAS lets
one machine run the kernels of others (OPENBLAS_CORETYPE, set for the child processes alone), so
this runs tests/features/test_parity.py at N = 1..4 under each kernel and prints, per kernel, one JSON line
with the worst ratio of a sharded run's error to its bound (tests/tolerance.py; must stay <= 1). A
kernel this CPU cannot run (mpifsdp.base.machine: SkylakeX needs AVX-512) is not run; the last line
names the kernels checked and, with the reason, those that were not.

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

from mpifsdp.base.machine import OTHER_KERNELS, openblas_kernel_problem

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", default=list(OTHER_KERNELS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 3, 4])
    args = parser.parse_args()
    not_checked = {}
    for kernel in args.kernels:
        if problem := openblas_kernel_problem(kernel):
            not_checked[kernel] = problem
            print(json.dumps({"kernel": kernel, "not_checked": problem}), flush=True)
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
    checked = [k for k in args.kernels if k not in not_checked]
    print(json.dumps({"summary": True, "checked": checked, "not_checked": not_checked}), flush=True)


if __name__ == "__main__":
    main()
