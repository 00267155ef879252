"""An exception on one rank ends the whole mpiexec job promptly (no rank left waiting in a collective)."""

import os
import re
import sys
import textwrap
import time

import pytest

from support import ROOT, mpiexec, run_job, run_launched

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
    result = run_launched([*mpiexec(), "-n", "3", sys.executable, "-m", "mpi4py", str(script)], timeout=120)
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
    result = run_launched(
        [*mpiexec(), "-n", "2", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--with-mpi", str(tmp_path / "test_planted.py")],
        timeout=120, cwd=tmp_path, env={**os.environ, "MPIFSDP_TIMEOUT": "600"},
    )  # fmt: skip
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "planted failure on rank 1" in output, output[-2000:]
    assert "FAILED test_planted.py::test_fails_on_rank_1_only on rank 1" in output
    assert elapsed < 60, f"the job took {elapsed:.1f} s to end"


LEAVES = textwrap.dedent(
    """
    import os, signal, sys, time
    from mpifsdp import Comm

    comm = Comm()
    how = sys.argv[1]
    for step in range(400):
        if how in ("hooked", "chained") and step == 1:  # the program's own hook, set after Comm()
            before = sys.excepthook if how == "chained" else lambda *exc: None  # handed on, or not

            def own(kind, value, tb, before=before):
                print(f"own hook: {kind.__name__}", file=sys.stderr, flush=True)
                before(kind, value, tb)

            sys.excepthook = own
        if comm.rank == 1 and step == 3:
            if how in ("raise", "hooked", "chained"):
                raise ValueError("injected failure on rank 1")
            if how == "exit":
                sys.exit(0)
            if how == "budget":  # its time budget ran out sooner: it stops, the others go on
                break
            if how == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)
        comm.all_reduce_scalar(1.0, what="a step")
    if how == "rank 0 works on" and comm.rank == 0:
        time.sleep(3)  # a report written by rank 0 alone, after the others ended: legitimate
    print(f"rank {comm.rank} done", flush=True)
    """
)


@pytest.mark.parametrize(
    "how, launcher, says",
    [
        ("exit", "mpi4py", r"rank 1 left the job \(its program ended; its last collective: .*all-reduce"),
        (
            "raise",
            "plain",
            r"rank 1 left the job \(an exception ended it: ValueError: injected failure on rank 1",
        ),
        ("budget", "mpi4py", r"rank 1 left the job \(its program ended"),
        (
            "hooked",
            "plain",
            r"own hook: ValueError(.|\n)*rank 1 left the job \(an exception ended it: ValueError: injected",
        ),
        (  # a hook that hands on to the one it found: ours, wrapped around it since (no recursion)
            "chained",
            "plain",
            r"own hook: ValueError(.|\n)*rank 1 left the job \(an exception ended it: ValueError: injected",
        ),
    ],
    ids=["exit", "raise", "budget", "hooked", "chained"],
)
def test_a_rank_that_leaves_early_is_named_within_seconds(tmp_path, comm, how, launcher, says):
    """sys.exit on one rank, an exception without `-m mpi4py`, ranks with different step budgets: the
    others waited for the 300 s watchdog. The exit handshake ends the job in seconds, naming the rank."""
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES)
    result, elapsed = run_job(script, 3, how, launcher=launcher, env={"MPIFSDP_TIMEOUT": "20"}, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and elapsed < 15, f"exit {result.returncode} after {elapsed:.1f} s:\n{out}"
    assert re.search(says, out), out
    assert re.search(r"while rank [02] waited in .*all-reduce of a step", out), out


def test_a_normal_end_on_every_rank_stays_fast_and_successful(tmp_path, comm):
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    script = tmp_path / "ends.py"
    script.write_text(LEAVES)
    for launcher in ("mpi4py", "plain"):
        result, elapsed = run_job(script, 3, "none", launcher=launcher, timeout=120)
        assert result.returncode == 0 and elapsed < 15, result.stdout + result.stderr
        assert all(f"rank {r} done" in result.stdout for r in range(3)), result.stdout  # lines may interleave


def test_a_frozen_rank_is_named_by_the_watchdog_and_the_running_ones_are_not_blamed(tmp_path, comm):
    """A SIGSTOPped rank of 4: the report said the ranks that did not report never arrived, false for
    the ones that were running. The roll call names who waits where, and who did not answer."""
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    script = tmp_path / "freezes.py"
    script.write_text(LEAVES)
    result, elapsed = run_job(script, 4, "freeze", env={"MPIFSDP_TIMEOUT": "3"}, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and elapsed < 30, f"exit {result.returncode} after {elapsed:.1f} s:\n{out}"
    assert re.search(r"rank\(s\) \[1\] did not answer within 2 s: they are the ones missing", out), out
    assert re.search(r"rank [023] waits in .*all-reduce of a step", out), out


def test_a_rank_still_at_work_after_the_others_ended_is_not_killed(tmp_path, comm):
    """Rank 0 working alone after the others' programs ended (a report, a plot) is no error: the
    ranks waiting at exit say so once, and the job ends with status 0 when rank 0 does."""
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    script = tmp_path / "works_on.py"
    script.write_text(LEAVES)
    result, _ = run_job(script, 3, "rank 0 works on", env={"MPIFSDP_TIMEOUT": "1"}, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ended its program and waits for the others to end" in result.stderr, result.stderr
    assert all(f"rank {r} done" in result.stdout for r in range(3)), result.stdout


SOME_RANKS = textwrap.dedent(
    """
    import sys, time
    from mpi4py import MPI
    from mpifsdp import Comm

    world = MPI.COMM_WORLD
    if sys.argv[1] == "only rank 0 makes a Comm":
        if world.Get_rank() == 0:
            Comm()  # a Clone here waited for ever: the others never make theirs
        else:
            time.sleep(20)
    else:  # two independent groups, each its own Comm: rank 1 leaves its group early
        comm = Comm(world.Split(world.Get_rank() // 2))
        for step in range(400):
            if world.Get_rank() == 1 and step == 3:
                sys.exit(0)
            comm.all_reduce_scalar(1.0, what="a group's step")
    """
)


@pytest.mark.parametrize(
    "how, says",
    [
        (
            "only rank 0 makes a Comm",
            r"rank 0 waited 2.0 s in setup Comm\(\) \(every rank of the communicator",
        ),
        ("groups", r"rank 1 left the job \(its program ended.*while rank 0 waited in .*a group's step"),
    ],
    ids=["comm-on-one-rank", "sub-communicator"],
)
def test_a_comm_made_on_some_ranks_or_over_a_group_ends_in_seconds(tmp_path, comm, how, says):
    """Comm() on one rank only hung for ever in MPI's Clone (now an Idup under the watchdog); a Comm
    over a group of the job, made first, had no exit handshake (now its ranks watch each other)."""
    if comm.size > 1:
        pytest.skip("drives its own mpiexec: runs in the plain-pytest pass of make test")
    script = tmp_path / "some_ranks.py"
    script.write_text(SOME_RANKS)
    result, elapsed = run_job(script, 4, how, env={"MPIFSDP_TIMEOUT": "2"}, timeout=30)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and elapsed < 20, f"exit {result.returncode} after {elapsed:.1f} s:\n{out}"
    assert re.search(says, out), out
