"""What this machine can run (base/machine.py): a kernel the CPU lacks is refused before it is run, the
probe tells a kernel that ran from one that crashed or was ignored, the tests that need a kernel ask
first, and a run lists what it skipped."""

import os
import signal
import subprocess
import sys

import pytest

from mpifsdp.base import machine

from support import ROOT, require

NO_AVX512 = frozenset({"pni", "ssse3", "sse4_2", "avx", "avx2", "fma"})  # an AMD EPYC of the Zen 1-3 kind


@pytest.fixture
def openblas(comm):
    """NumPy's OpenBLAS, asked for first (support.require); one process does the probing."""
    if comm.size > 1:
        pytest.skip("starts its own processes: the plain-pytest pass of make test covers it")
    require(machine.openblas_problem())
    return machine.blas()


def pytest_in_a_child(tmp_path, *args, plugin: str = "") -> subprocess.CompletedProcess:
    """`pytest -q *args` from the repository root in a child process, with the suite's conftest.py
    and, when given, a plugin written to tmp_path (what the child's machine looks like)."""
    if plugin:
        (tmp_path / "machine_plugin.py").write_text(plugin)
        args = ("-p", "machine_plugin", *args)
    path = os.pathsep.join(filter(None, [str(tmp_path), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_kernel_whose_instructions_the_cpu_lacks_is_refused_without_running_it(monkeypatch):
    """SkylakeX on a CPU without AVX-512 dies of SIGILL: the CPU's flags answer first, no child starts
    (whatever this machine's own CPU and BLAS: both are stood in for)."""
    machine.openblas_kernel_problem.cache_clear()
    monkeypatch.setattr(machine, "openblas_problem", lambda: None)
    monkeypatch.setattr(machine, "cpu_flags", lambda: NO_AVX512)
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
    require(None if flags is not None else "no /proc/cpuinfo: which instructions this CPU has is unknown")
    assert machine.probe_openblas_kernel(openblas["architecture"]) is None
    chose, status = machine.run_openblas_kernel("SkylakeX")
    require(None if chose == "SkylakeX" else f"this OpenBLAS runs its {chose} kernel for SkylakeX")
    problem = machine.probe_openblas_kernel("SkylakeX")
    if set(machine.OPENBLAS_KERNEL_NEEDS["SkylakeX"]) <= flags:
        assert status == 0 and problem is None, (status, problem)
    else:
        assert status == -signal.SIGILL and "died of SIGILL" in problem, (status, problem)


def test_a_name_openblas_ignores_is_not_taken_for_a_kernel_that_ran(openblas):
    """An unknown OPENBLAS_CORETYPE falls back to the CPU's own kernel without a word: the probe says so."""
    problem = machine.probe_openblas_kernel("NoSuchCore")
    assert problem is not None and "ran this process's own" in problem, problem


def test_the_tests_that_need_a_kernel_skip_where_the_cpu_lacks_it(comm, tmp_path):
    """The deterministic threads test under SkylakeX, on a CPU stood in for as one without AVX-512 (an
    AMD EPYC): skipped with the reason and listed, never run (there it dies of SIGILL), on any CPU."""
    if comm.size > 1:
        pytest.skip("starts its own pytest: the plain-pytest pass of make test covers it")
    plugin = (
        "from mpifsdp.base import machine\n\n\n"
        "def pytest_configure(config):  # an OpenBLAS whose threads can be set, on a CPU without AVX-512\n"
        "    machine.blas_threads_problem = machine.openblas_problem = lambda: None\n"
        f"    machine.cpu_flags = lambda: frozenset({sorted(NO_AVX512)!r})\n"
    )
    test = "tests/features/test_deterministic.py::test_blas_threads_do_not_change_the_bits[SkylakeX]"
    done = pytest_in_a_child(tmp_path, test, plugin=plugin)
    assert done.returncode == 0 and "1 skipped" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    assert "not checked on this machine (1)" in done.stdout and "needs avx512f" in done.stdout, done.stdout


def test_a_run_lists_what_this_machine_could_not_check(comm, tmp_path):
    """A test that skips for want of a part of the machine is named, with its reason, in the summary."""
    if comm.size > 1:
        pytest.skip("starts its own pytest: the plain-pytest pass of make test covers it")
    (tmp_path / "test_needs.py").write_text(
        "from support import require\n\n\n"
        "def test_needs_a_kernel():\n    require('the Frob kernel needs avx1024, which this CPU lacks')\n\n\n"
        "def test_plain():\n    require(None)\n"
    )
    done = pytest_in_a_child(tmp_path, "-p", "conftest", str(tmp_path / "test_needs.py"))
    assert done.returncode == 0 and "1 passed, 1 skipped" in done.stdout, done.stdout + done.stderr
    summary = done.stdout.split("not checked on this machine (1)", 1)
    assert len(summary) == 2, done.stdout
    assert "test_needs.py::test_needs_a_kernel: the Frob kernel needs avx1024" in summary[1], done.stdout
