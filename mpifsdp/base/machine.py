"""What this machine can run, asked before anything relies on it: the CPU's instruction sets, the BLAS
NumPy computes with and the OpenBLAS kernels it can be made to use.

Bits and speed follow the BLAS kernel, so checks of determinism and of float bounds run under the
kernels of other CPUs (OPENBLAS_CORETYPE, set for a child process). A kernel that needs instructions
this CPU lacks does not fail politely: the child dies of SIGILL (SkylakeX's AVX-512 on an AMD EPYC).
A name the OpenBLAS build lacks falls back to this CPU's own kernel without a word, and a NumPy on
MKL or Accelerate ignores the variable: a check would then pass without having run anything new.
So whoever wants a kernel asks `openblas_kernel_problem` first; the test suite (tests/support.py
`require`) and bench/parity_kernels.py skip with its answer.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

# The kernels of other CPUs the suite and bench/parity_kernels.py check the bits and bounds under.
OTHER_KERNELS = ("Haswell", "SkylakeX", "Zen", "Sandybridge", "Prescott")

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

# Run under the kernel asked for: OPENBLAS_VERBOSE=2 makes OpenBLAS print the kernel it chose
# ("Core: SkylakeX") when it loads, before the GEMM that may die of it.
_PROBE = "import numpy as np; a = np.ones((64, 64), np.float32); assert (a @ a)[0, 0] == 64"
_CHOSE = re.compile(r"^Core: (\S+)", re.M)


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """/proc/cpuinfo's first processor, by field; empty where there is no such file (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str] | None:
    """The instruction-set flags /proc/cpuinfo gives for this CPU; None where it gives none (not
    Linux): a probe must then decide alone."""
    info = _cpuinfo()
    flags = info.get("flags", info.get("Features"))
    return None if flags is None else frozenset(flags.split())


def cpu_name() -> str:
    """The CPU's model name, for messages ('AMD EPYC', 'Intel Xeon ...'); the platform's where unknown."""
    import platform

    return _cpuinfo().get("model name") or platform.processor() or platform.machine() or "this CPU"


def blas() -> dict | None:
    """threadpoolctl's entry for the BLAS NumPy loaded (internal_api: 'openblas', 'mkl', 'blis';
    version, architecture: the kernel in use, num_threads), or None when threadpoolctl finds none it
    can control (Accelerate, a reference BLAS)."""
    import numpy  # noqa: F401  (loads its BLAS, which threadpoolctl then finds)
    from threadpoolctl import threadpool_info

    found = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    numpys = [i for i in found if "numpy" in i.get("filepath", "")]  # SciPy may load a BLAS of its own
    return (numpys or found or [None])[0]


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


def run_openblas_kernel(kernel: str, timeout: float = 120) -> tuple[str | None, int | None]:
    """One GEMM in a child process under OPENBLAS_CORETYPE=kernel: (the kernel OpenBLAS chose, as it
    reports it; the child's exit status: negative for a signal, None when it did not finish)."""
    env = {**os.environ, "OPENBLAS_CORETYPE": kernel, "OPENBLAS_VERBOSE": "2", "OPENBLAS_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, None
    chose = _CHOSE.search(done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace"))
    return (chose[1] if chose else None), done.returncode


def probe_openblas_kernel(kernel: str) -> str | None:
    """Why a GEMM under OPENBLAS_CORETYPE=kernel checks nothing here (it died of a signal, failed, or
    ran this process's own kernel: the name is unknown to this OpenBLAS, an alias of its own, or
    ignored), or None when it ran another kernel than this process's. That kernel may go by another
    name (Prescott's is Katmai, Zen's is Haswell in builds without Zen kernels)."""
    chose, status = run_openblas_kernel(kernel)
    if status is None:
        return f"a GEMM under OpenBLAS's {kernel} kernel did not finish in time"
    if status < 0:
        name = signal.Signals(-status).name
        why = " (an instruction this CPU lacks)" if name == "SIGILL" else ""
        return f"a GEMM under OpenBLAS's {kernel} kernel died of {name}{why} on {cpu_name()}"
    if status != 0:
        return f"a GEMM under OpenBLAS's {kernel} kernel failed (exit status {status})"
    own = (blas() or {}).get("architecture")
    if chose is None or (chose.lower() != kernel.lower() and chose.lower() == str(own).lower()):
        return (
            f"OPENBLAS_CORETYPE={kernel} ran this process's own {own} kernel (an alias, a name this "
            "OpenBLAS lacks, or a build that ignores it): nothing more to check"
        )
    return None
