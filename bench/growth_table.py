"""How the cost grows with the model: the sharded step at d_model 256/512/768/1024 (layers 4/8/12/16,
heads of 64) and N = 1, 2, 4 ranks, each with the GEMM-only time of one rank's step beside it.

Every rank keeps the peer config's batch (8 sequences of 128 per rank) and gets cores / N BLAS
threads, as bench_fsdp.py; the GEMM-only time is the same rank's GEMMs (xp.matmul on operands of the
step's shapes) on all ranks at once, taking turns with the steps (`bench_fsdp.py --worker --gemm`),
so the two share the machine the same way; `step_vs_gemm` is the median of the per-round ratios.
`step_vs_gemm` = GEMM time / step time: what is left is the framework (elementwise passes, Python)
and exposed communication. Prints one JSON line per run, then a Markdown table.
    python bench/growth_table.py [--steps 2] [--sizes 1,2,4] [--widths 256,512,768,1024]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common import run_json  # noqa: E402

HEAD_SIZE = 64  # and one layer per 64 features: 4/8/12/16 layers at 256/512/768/1024


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--widths", default="256,512,768,1024")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    bench_fsdp = str(Path(__file__).parent / "bench_fsdp.py")
    rows = []
    for width in map(int, args.widths.split(",")):
        layers = width // HEAD_SIZE
        settings = [f"n_embd={width}", f"n_layer={layers}", f"n_head={width // HEAD_SIZE}"]
        for n in map(int, args.sizes.split(",")):
            cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", bench_fsdp, "--worker", "--gemm"]
            run = run_json([*cmd, "--set", *settings, "--steps", str(args.steps)], max(1, cores // n))
            rows.append((width, layers, n, run))
    print("| d_model | layers | N | step s | tokens/s | peak RSS/rank MiB | GEMM-only s | step_vs_gemm |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for width, layers, n, run in rows:
        cells = [width, layers, n, run["step_s"], run["tokens_per_s"], run["peak_rss_mib_per_rank"]]
        print("| " + " | ".join(map(str, [*cells, run["gemm_s"], run["step_vs_gemm"]])) + " |")


if __name__ == "__main__":
    main()
