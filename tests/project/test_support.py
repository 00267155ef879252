"""tests/support.py's launcher retry: a launcher that failed to start is started again, and nothing
else is (a job that fails is the behaviour under test); its shared directory is asked for first."""

import sys

import pytest

import support
from support import LAUNCHER_DID_NOT_START, run_launched, shared_dir


def _twice(tmp_path, first_says: str, first_exit: int) -> str:
    """A command that says `first_says` and exits `first_exit` the first time, then says 'ran'."""
    marker = tmp_path / "tried"
    return (
        f"import pathlib, sys; m = pathlib.Path({str(marker)!r}); first = not m.exists(); m.touch(); "
        f"print({first_says!r} if first else 'ran'); sys.exit({first_exit} if first else 0)"
    )


def test_a_launcher_that_did_not_start_is_started_again(tmp_path):
    result = run_launched(
        [sys.executable, "-c", _twice(tmp_path, LAUNCHER_DID_NOT_START[0], 213)], timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == "ran", result


def test_a_job_that_fails_on_its_own_is_not_started_again(tmp_path):
    result = run_launched(
        [sys.executable, "-c", _twice(tmp_path, "planted failure on rank 1", 1)], timeout=60
    )
    assert result.returncode == 1 and "planted failure" in result.stdout, result


@pytest.mark.mpi(min_size=2)
def test_a_directory_some_rank_cannot_see_skips_the_test_on_every_rank(comm, tmp_path, monkeypatch):
    """Across nodes rank 0's temporary directory is on its own node's disk unless MPIFSDP_TEST_TMP puts
    it on a shared one: a rank that cannot see it makes every rank skip (one verdict), never fail."""
    assert shared_dir(comm, tmp_path) == comm.broadcast_object(str(tmp_path))  # one machine: all see it
    if comm.rank == comm.size - 1:
        monkeypatch.setattr(support, "sees_file", lambda path: False)
    with pytest.raises(
        pytest.skip.Exception, match=rf"ranks \[{comm.size - 1}\] do not see rank 0's directory"
    ):
        shared_dir(comm, tmp_path)
