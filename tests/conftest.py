"""Where a new test goes: tests/unit/<package>/ for one sub-package's behaviour (unit/ itself for a
top-level module), tests/features/ for a feature across packages (parity, HSDP, accumulation, ...),
tests/failures/ for misuse, faults and their messages, tests/project/ for the repository itself (docs,
layering). Helpers go in tests/support.py, never in a test module; fixtures here."""

import os

# Ranks share 2 cores here: one BLAS thread per process keeps mpiexec -n 4 from thrashing.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mpifsdp.base.backend import array_module, gpu_available  # noqa: E402
from mpifsdp.comm.presence import report_and_abort  # noqa: E402

_CONFIG = None  # pytest's, for the abort below


def pytest_configure(config):
    """Under mpiexec every rank runs pytest: give each its own temporary root, so that ranks do not
    race to clean up each other's directories (tests that need one shared directory use rank 0's)."""
    from mpi4py import MPI

    global _CONFIG
    _CONFIG = config
    world = MPI.COMM_WORLD
    if world.Get_size() > 1 and not config.option.basetemp:
        # Across nodes, tests that need one directory for all ranks (support.shared_dir) need this
        # root on a file system every rank sees: MPIFSDP_TEST_TMP; they skip, saying so, otherwise.
        parent = os.environ.get("MPIFSDP_TEST_TMP") or f"/tmp/pytest-mpifsdp-{os.getuid()}"
        os.makedirs(parent, exist_ok=True)
        config.option.basetemp = f"{parent}/rank{world.Get_rank()}"


def pytest_runtest_logreport(report):
    """Under mpiexec, a test that failed on this rank ends the whole job, as `python -m mpi4py` does
    for an exception: the other ranks may be waiting in a collective this rank will never join (a
    failed assert between two collectives), and would otherwise hang until the watchdog fires. So
    `mpiexec -n 4 python -m pytest --with-mpi` never hangs on a one-rank failure either."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if report.failed and world.Get_size() > 1:
        capture = _CONFIG.pluginmanager.getplugin("capturemanager") if _CONFIG else None
        if capture is not None:  # the report must reach the terminal before the job ends
            capture.suspend_global_capture(in_=True)
        report_and_abort(  # waits until the launcher has read it: the abort loses what it has not
            f"\n{report.longreprtext}\nmpifsdp tests: FAILED {report.nodeid} on rank {world.Get_rank()} "
            f"(in {report.when}): aborting the job",
            world.Abort,
            1,
        )


@pytest.fixture(params=["cpu", "cuda"] if gpu_available() else ["cpu"])
def device(request):
    """Every test taking `device` runs on numpy, and on cupy when a GPU is present."""
    return request.param


@pytest.fixture
def xp(device):
    return array_module(device)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def comm():
    """The world as a Comm: size 1 under plain pytest, N under `mpiexec -n N python -m mpi4py -m pytest`."""
    from mpifsdp import Comm

    return Comm()


def pytest_terminal_summary(terminalreporter):
    """What this machine could not check, by test and reason (support.require): a kernel, an
    instruction set or a library it lacks is listed at the end of every run, not only under -rs."""
    from support import MACHINE_LACKS

    lacked = []
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if MACHINE_LACKS in reason:
            lacked.append(f"  {report.nodeid}: {reason.split(MACHINE_LACKS, 1)[1]}")
    if lacked:
        terminalreporter.write_sep("-", f"not checked on this machine ({len(lacked)})")
        terminalreporter.write_line("\n".join(lacked))
