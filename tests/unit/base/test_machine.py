"""What this machine can run (base/machine.py): a kernel the CPU lacks is refused before it is run, the
probe tells a kernel that ran from one that crashed or was ignored, and a run lists what it skipped."""

import os
import subprocess
import sys

import pytest

from mpifsdp.base import machine

from support import ROOT, require


@pytest.fixture
def openblas(comm):
    """NumPy's OpenBLAS, asked for first (support.require); one process does the probing."""
    if comm.size > 1:
        pytest.skip("starts its own processes: the plain-pytest pass of make test covers it")
    require(machine.openblas_problem())
    return machine.blas()


def test_a_kernel_whose_instructions_the_cpu_lacks_is_refused_without_running_it(openblas, monkeypatch):
    """SkylakeX on a CPU without AVX-512 dies of SIGILL: the CPU's flags answer first, no child starts."""
    machine.openblas_kernel_problem.cache_clear()
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"pni", "avx", "avx2", "fma"}))
    monkeypatch.setattr(machine, "probe_openblas_kernel", lambda kernel: pytest.fail(f"started {kernel}"))
    try:
        problem = machine.openblas_kernel_problem("SkylakeX")
    finally:
        machine.openblas_kernel_problem.cache_clear()
    assert problem is not None and "SkylakeX kernel needs avx512f" in problem, problem


def test_the_probe_agrees_with_the_cpus_flags(openblas):
    """Run for real: SkylakeX's GEMM runs where /proc/cpuinfo lists AVX-512 and dies of SIGILL where it
    does not (an AMD EPYC one day, an Intel Xeon the next); this process's own kernel always runs."""
    flags = machine.cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo: which instructions this CPU has is unknown")
    assert machine.probe_openblas_kernel(openblas["architecture"]) is None
    problem = machine.probe_openblas_kernel("SkylakeX")
    if set(machine.OPENBLAS_KERNEL_NEEDS["SkylakeX"]) <= flags:
        assert problem is None or "ran this process's own" in problem, problem
    else:
        assert problem is not None and "died of SIGILL" in problem, problem


def test_a_name_openblas_ignores_is_not_taken_for_a_kernel_that_ran(openblas):
    """An unknown OPENBLAS_CORETYPE falls back to the CPU's own kernel without a word: the probe says so."""
    problem = machine.probe_openblas_kernel("NoSuchCore")
    assert problem is not None and "ran this process's own" in problem, problem


def test_a_run_lists_what_this_machine_could_not_check(comm, tmp_path):
    """A test that skips for want of a part of the machine is named, with its reason, in the summary."""
    if comm.size > 1:
        pytest.skip("starts its own pytest: the plain-pytest pass of make test covers it")
    (tmp_path / "test_needs.py").write_text(
        "from support import require\n\n\n"
        "def test_needs_a_kernel():\n    require('the Frob kernel needs avx1024, which this CPU lacks')\n\n\n"
        "def test_plain():\n    require(None)\n"
    )
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}  # the suite's conftest.py as a plugin, and support.py
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest"]
    command.append("test_needs.py")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "1 passed, 1 skipped" in done.stdout, done.stdout + done.stderr
    summary = done.stdout.split("not checked on this machine (1)", 1)
    assert len(summary) == 2, done.stdout
    assert "test_needs.py::test_needs_a_kernel: the Frob kernel needs avx1024" in summary[1], done.stdout
