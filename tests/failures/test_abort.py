"""An exception on one rank ends the whole mpiexec job promptly (no rank left waiting in a collective)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from support import ROOT, mpiexec

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    from mpifsdp import Comm, fully_shard, AdamW
    from mpifsdp.models import GPT, GPTConfig

    comm = Comm()
    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8))
    fully_shard(model, comm, units=model.blocks)
    x = np.zeros((1, 4), dtype=np.int64)
    model(x, x).backward()
    if comm.rank == 1:
        raise ValueError("injected failure on rank 1")
    for _ in range(1000):  # the other ranks go on into collectives that rank 1 will never join
        model(x, x).backward()
    """
)


def test_exception_on_one_rank_aborts_the_job(tmp_path, comm):
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    result = subprocess.run(
        [*mpiexec(), "-n", "3", sys.executable, "-m", "mpi4py", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"


FAILS_ON_ONE_RANK = textwrap.dedent(
    """
    import pytest
    from mpi4py import MPI

    def test_fails_on_rank_1_only():
        assert MPI.COMM_WORLD.Get_rank() != 1, "planted failure on rank 1"

    def test_then_a_collective():  # the other ranks wait here for rank 1, which never comes
        MPI.COMM_WORLD.Barrier()
    """
)


def test_a_failed_test_on_one_rank_ends_pytest_with_mpi_promptly(tmp_path, comm):
    """`mpiexec -n 2 python -m pytest --with-mpi` (pytest-mpi's way, no `-m mpi4py`) with a failure on
    one rank: conftest.py aborts the job, so no rank waits in the collective after it (the watchdog is
    set far beyond the time allowed, so only the abort can end the job in time)."""
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    (tmp_path / "test_planted.py").write_text(FAILS_ON_ONE_RANK)
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    start = time.monotonic()
    result = subprocess.run(
        [*mpiexec(), "-n", "2", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--with-mpi", str(tmp_path / "test_planted.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "MPIFSDP_TIMEOUT": "600"},
    )  # fmt: skip
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "planted failure on rank 1" in output, output[-2000:]
    assert "FAILED test_planted.py::test_fails_on_rank_1_only on rank 1" in output
    assert elapsed < 60, f"the job took {elapsed:.1f} s to end"
