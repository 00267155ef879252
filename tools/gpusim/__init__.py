"""gpusim: a GPU stood in for on a CPU, to check mpifsdp's GPU path before a device sees it.

cupy_standin.py is CuPy on NumPy (launches, streams, CUDA graphs' capture and replay, NCCL across
MPI ranks, device memory counted, cuBLAS's C API); cudnn_standin.py is cuDNN's fused attention as a
NumPy twin; kernel_emulator.py builds mpifsdp's raw kernels' CUDA source with g++ and runs it with
CUDA's execution model. `python -m gpusim SCRIPT` runs a script on them; standin_*.py are the checks
the suite runs that way (tests/project/test_gpu_budget.py). A development tool, not part of the
mpifsdp package: `make install` installs it into the suite's venv (pip install -e tools).
"""

import sys

from . import cupy_standin


def install(with_cudnn: bool = True):
    """Make `import cupy` (and cupyx, cupy.cuda.nccl, and cudnn unless with_cudnn is False: then
    attention runs as it does on a GPU without cuDNN) give the stand-ins; call before importing mpifsdp."""
    cp = cupy_standin.install()
    if with_cudnn:
        from . import cudnn_standin

        sys.modules["cudnn"] = cudnn_standin.module()
    return cp
