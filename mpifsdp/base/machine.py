"""What this machine can run, asked before anything relies on it: the CPU's instruction sets, the BLAS
NumPy computes with and the OpenBLAS kernels it can be made to use.

Bits and speed follow the BLAS kernel, so checks of determinism and of float bounds run under the
kernels of other CPUs (OPENBLAS_CORETYPE, set for a child process). A kernel that needs instructions
this CPU lacks does not fail politely: the child dies of SIGILL (SkylakeX's AVX-512 on an AMD EPYC).
A build without DYNAMIC_ARCH, or a NumPy on MKL or Accelerate, ignores the variable, and a check
would then pass without having run the kernel it names. So whoever wants a kernel asks
`openblas_kernel_problem` first; the test suite (tests/support.py `require`) and
bench/parity_kernels.py skip with its answer.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

# The /proc/cpuinfo flags each OpenBLAS x86-64 kernel executes (OpenBLAS's driver/others/dynamic.c
# picks them by the same instruction sets). SSE3 is "pni" there.
OPENBLAS_KERNEL_NEEDS = {
    "Prescott": ("pni",),
    "Core2": ("ssse3",),
    "Nehalem": ("sse4_2",),
    "Sandybridge": ("avx",),
    "Haswell": ("avx2", "fma"),
    "Zen": ("avx2", "fma"),
    "SkylakeX": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    "Cooperlake": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16"),
    "SapphireRapids": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16", "amx_tile"),
}

# Run under the kernel asked for: one GEMM checked, then the kernel OpenBLAS says it chose.
_PROBE = """
import numpy as np
from threadpoolctl import threadpool_info
a = np.ones((64, 64), np.float32)
assert (a @ a)[0, 0] == 64
print([i.get("architecture") for i in threadpool_info() if i.get("user_api") == "blas"][0])
"""


def cpu_flags() -> frozenset[str] | None:
    """The instruction-set flags /proc/cpuinfo gives for this CPU; None where there is no such file
    (not Linux): a probe must then decide alone."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return None


def cpu_name() -> str:
    """The CPU's model name, for messages ('AMD EPYC', 'Intel Xeon ...'); the platform's where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "this CPU"


def blas() -> dict | None:
    """threadpoolctl's entry for the BLAS NumPy loaded (internal_api: 'openblas', 'mkl', 'blis';
    version, architecture: the kernel in use, num_threads), or None when threadpoolctl finds none it
    can control (Accelerate, a reference BLAS)."""
    import numpy  # noqa: F401  (loads its BLAS, which threadpoolctl then finds)
    from threadpoolctl import threadpool_info

    return next((i for i in threadpool_info() if i.get("user_api") == "blas"), None)


def blas_threads_problem() -> str | None:
    """Why this process's BLAS threads cannot be read or set here, or None where they can."""
    if blas() is None:
        return "threadpoolctl finds no BLAS whose threads it can set (NumPy's is not OpenBLAS, MKL or BLIS)"
    return None


def openblas_problem() -> str | None:
    """Why NumPy's BLAS here is not an OpenBLAS whose kernels OPENBLAS_CORETYPE selects, or None."""
    loaded = blas()
    if loaded is None or loaded.get("internal_api") != "openblas":
        found = "none threadpoolctl knows" if loaded is None else loaded.get("internal_api")
        return f"NumPy's BLAS is {found}, not OpenBLAS: OPENBLAS_CORETYPE selects no kernel"
    return None


@functools.cache
def openblas_kernel_problem(kernel: str) -> str | None:
    """Why `kernel` (an OPENBLAS_CORETYPE name) cannot be checked here, or None when a GEMM under it
    runs. A kernel whose instructions /proc/cpuinfo lacks is refused without starting it; anything
    else is tried in a child process (probe_openblas_kernel)."""
    if problem := openblas_problem():
        return problem
    flags = cpu_flags()
    if flags is not None and kernel in OPENBLAS_KERNEL_NEEDS:
        missing = [f for f in OPENBLAS_KERNEL_NEEDS[kernel] if f not in flags]
        if missing:
            needs = ", ".join(missing)
            return f"OpenBLAS's {kernel} kernel needs {needs}, which this CPU ({cpu_name()}) lacks"
    return probe_openblas_kernel(kernel)


def probe_openblas_kernel(kernel: str, timeout: float = 120) -> str | None:
    """Run one GEMM under OPENBLAS_CORETYPE=kernel in a child process: why it failed (it died of a
    signal, or OpenBLAS ran this process's own kernel instead: the name is unknown, an alias of it,
    or ignored), or None when it ran another kernel."""
    env = {**os.environ, "OPENBLAS_CORETYPE": kernel, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        why = " (an instruction this CPU lacks)" if name == "SIGILL" else ""
        return f"a GEMM under OpenBLAS's {kernel} kernel died of {name}{why} on {cpu_name()}"
    if done.returncode != 0:
        return f"a GEMM under OpenBLAS's {kernel} kernel failed: {done.stderr.strip()[-300:]}"
    chose = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "?"
    own = (blas() or {}).get("architecture")
    if chose.lower() != kernel.lower() and chose == own:  # an alias (Zen is Haswell), or ignored
        return (
            f"OPENBLAS_CORETYPE={kernel} ran this process's own {own} kernel (an alias, a name this "
            "OpenBLAS lacks, or a build without DYNAMIC_ARCH): nothing more to check"
        )
    return None  # that kernel, or one OpenBLAS reports by another name (Prescott's is Katmai)

