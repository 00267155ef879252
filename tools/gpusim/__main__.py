"""Run a script with CuPy replaced by the NumPy stand-in (cupy_standin.py): the GPU branches of
mpifsdp, our raw kernels as their NumPy twins, on a CPU. The parity check of bench/gpu_check.py so
checks what the GPU path computes (the wiring of every kernel) before a device sees it:

    python -m gpusim bench/gpu_check.py parity
    python -m gpusim bench/gpu_check.py parity --sharded --transport nccl

--no-cudnn leaves cudnn out (as on a GPU without it): attention then runs as batched passes.
STANDIN_KERNELS=source runs the raw kernels' CUDA source (kernel_emulator.py) instead of their
twins; a source g++ cannot build then fails the run.
--gpus N gives the stand-in's node N GPUs (one a rank: NCCL across ranks, through MPI); then
--nccl-version CODE the version its NCCL reports (23000: 2.30, which lets ranks share a GPU):

    mpiexec -n 2 python -m mpi4py -m gpusim --gpus 2 bench/gpu_check.py parity --sharded --transport nccl
"""

import runpy
import sys
from pathlib import Path

from gpusim import cupy_standin, install


def _exit_if_a_kernel_source_failed_to_build():
    """With STANDIN_KERNELS=source a kernel g++ cannot build sends mpifsdp to its unfused passes, and
    the script may still pass: that run checked less than it claims, so it fails here."""
    emulator = sys.modules.get("gpusim.kernel_emulator")
    if emulator is not None and emulator.FAILED:
        print("\n\n".join(emulator.FAILED), file=sys.stderr)
        sys.exit(1)


def main(args: list[str]):
    no_cudnn = args[:1] == ["--no-cudnn"]
    args = args[no_cudnn:]
    if args[:1] == ["--gpus"]:
        cupy_standin.GPUS[0], args = int(args[1]), args[2:]
    if args[:1] == ["--nccl-version"]:  # ncclGetVersion's code: 23000 is 2.30, which lets ranks share a GPU
        cupy_standin.NCCL_VERSION[0], args = int(args[1]), args[2:]
    install(with_cudnn=not no_cudnn)
    script, *rest = args
    sys.argv = [script, *rest]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python script` has it: its helpers
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        _exit_if_a_kernel_source_failed_to_build()


if __name__ == "__main__":
    main(sys.argv[1:])
